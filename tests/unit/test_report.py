"""`composer report`: a run's metrics.jsonl as PNG plots and a summary table."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from composer.recipes.errors import UserError
from composer.runtime.report import render_report
from composer.runtime.run_dir import MetricsWriter

REPO = Path(__file__).resolve().parents[2]


def write_run(run_dir: Path) -> None:
    with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
        for step in range(1, 41):
            metrics.write(
                step,
                loss=4.0 / step + 1.0,
                lr=1e-3 * min(1.0, step / 5),
                grad_norm=float("nan") if step == 3 else 2.0 / step,
                tokens_per_s=1000.0 + step,
                moe_load_imbalance=1.0 + 1.0 / step,
                moe_aux_loss=1e-3 / step,
                phase="warmup" if step <= 5 else "stable",  # not numeric: not a series
            )
            if step % 10 == 0:
                metrics.write(step, eval_loss=4.0 / step + 1.2, reward_mean=step / 40, episode_turns=3)


def test_every_numeric_series_is_plotted_and_summarised(tmp_path):
    write_run(tmp_path)
    report = render_report(tmp_path)

    assert sorted(p.name for p in report.images) == sorted(
        f"{g}.png" for g in ("loss", "lr", "grad_norm", "throughput", "moe", "reward", "episode_turns")
    )
    for image in report.images:
        pixels = imread(image)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 600
        assert pixels[..., :3].std() > 0.05  # something was drawn on the white canvas

    by_name = {s.name: s for s in report.series}
    assert set(by_name) == {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "moe_load_imbalance",
        "moe_aux_loss",
        "eval_loss",
        "reward_mean",
        "episode_turns",
    }
    loss = by_name["loss"]
    assert (len(loss.values), loss.first, loss.last, loss.min, loss.max) == (40, 5.0, 1.1, 1.1, 5.0)
    eval_loss = by_name["eval_loss"]
    assert eval_loss.steps == [10, 20, 30, 40] and eval_loss.first == pytest.approx(1.6)
    grad_norm = by_name["grad_norm"]
    assert math.isnan(grad_norm.values[2]) and grad_norm.max == 2.0 and grad_norm.min == 0.05


def test_a_new_report_replaces_plots_of_series_that_are_gone(tmp_path):
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        metrics.write(1, loss=2.0, extra_metric=1.0)
    assert {p.name for p in render_report(tmp_path).images} == {"loss.png", "extra_metric.png"}
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    report = render_report(tmp_path)
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["loss.png"]
    assert report.series[0].values == [2.0, 1.5]  # the torn last line of a killed writer is skipped


def test_missing_run_or_metrics_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such run directory"):
        render_report(tmp_path / "absent")
    with pytest.raises(UserError, match="no metrics.jsonl"):
        render_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "phase": "setup"}\n')
    with pytest.raises(UserError, match="no numeric metrics"):
        render_report(tmp_path)
    assert not (tmp_path / "report").exists()


def test_cli_prints_the_summary_and_errors_without_traceback(tmp_path):
    write_run(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    command = [sys.executable, "-c", "from composer.cli.main import main; main()", "report"]
    done = subprocess.run([*command, str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "eval_loss" in done.stdout and "7 plot(s)" in done.stdout
    assert "episode_turns" not in done.stdout and "2 more series there" in done.stdout  # not a headline series
    every = subprocess.run([*command, str(tmp_path / "run"), "--all"], env=env, capture_output=True, text=True, timeout=60)
    assert "episode_turns" in every.stdout and "more series" not in every.stdout
    failed = subprocess.run([*command, str(tmp_path / "nothing")], env=env, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 2 and "no such run directory" in failed.stderr and "Traceback" not in failed.stderr


def test_plots_are_grouped_into_panels_headline_first(tmp_path):
    from composer.runtime.report import OTHER_PANEL, PANELS

    write_run(tmp_path)
    with MetricsWriter(tmp_path / "eval_metrics.jsonl") as evals:
        for step in (0, 20, 40):
            evals.write(
                step,
                **{
                    "eval_smoke_greedy_pass@1": step / 80,
                    "eval_smoke_greedy_pass@1_low": step / 100,
                    "eval_smoke_greedy_pass@1_high": step / 60,
                },
            )
    page = render_report(tmp_path).html.read_text()
    titles = [title for title, _ in PANELS] + [OTHER_PANEL]
    shown = [t for t in titles if f"<h2>{t}</h2>" in page]
    assert shown == ["Reward and held-out evaluation", "Loss and optimizer", "Throughput and step time", "MoE balance", OTHER_PANEL]
    assert page.index('alt="eval"') < page.index('alt="loss"') < page.index('alt="moe"') < page.index('alt="episode_turns"')


def test_compare_overlays_every_run_in_every_plot(tmp_path):
    from composer.runtime.report import render_comparison

    for name in ("a", "b"):
        write_run(tmp_path / "runs" / name)
    report = render_comparison([tmp_path / "runs" / "a", tmp_path / "runs" / "b"], tmp_path / "both")
    assert report.html == tmp_path / "both" / "report.html" and len(report.images) == 7
    assert all(runs == ["a", "b"] for runs in report.plotted.values()) and set(report.plotted) == {p.stem for p in report.images}
    page = report.html.read_text()
    assert "<th>run</th>" in page and page.count("<td>loss</td>") == 2


def test_the_eval_page_shows_per_kind_whether_the_policy_speaks_the_harness():
    from composer.runtime.report import eval_report_html

    def summary(parsed: float, finished: float) -> dict:
        kind = {
            "tasks": 4,
            "greedy_pass@1": 0.25,
            "interval": [0.0, 0.75],
            "tool_calls": 10,
            "tool_calls_parsed": parsed,
            "finish_called": finished,
        }
        return {
            "tasks": 4,
            "skipped": 0,
            "record": {"eval_repo_greedy_pass@1": 0.25, "eval_repo_greedy_pass@1_low": 0.0, "eval_repo_greedy_pass@1_high": 0.75},
            "infra_failures": 0,
            "greedy_pass@1_without_infra_failures": 0.25,
            "flagged_episodes": 0,
            "flags": {},
            "summaries_per_episode": 0.0,
            "end_reasons": {"finished": 1},
            "kinds": {"bug": kind},
        }

    page = eval_report_html(
        {
            "checkpoints": {"before": "a", "after": "b"},
            "pass_k": [],
            "samples": 0,
            "sets": {"repo": {"before": summary(0.1, 0.0), "after": summary(0.9, 0.75)}},
        }
    )
    assert "tool calls parsed 0.100 of 10; finish 0.000" in page and "tool calls parsed 0.900 of 10; finish 0.750" in page
