"""`composer runs`: the status of runs read from their files (synthesized here; test_midtrain and test_rl list real
finished, failed and killed runs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from composer.recipes.loader import load_recipe, recipe_to_yaml
from composer.runtime.run_dir import MetricsWriter, RunDir
from composer.runtime.status import find_runs, run_status
from tests.conftest import RECIPES, REPO


def make_run(parent, name, recipe_file, steps, done, checkpoints=(), export=False, policy=None, failure=None):
    recipe = load_recipe(RECIPES / recipe_file, [f"run.dir={parent}", f"run.name={name}", f"train.steps={steps}"])
    root = parent / name
    (root / "logs").mkdir(parents=True)
    (root / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    with MetricsWriter(root / "metrics.jsonl") as metrics:
        for step in range(1, done + 1):
            if recipe.rl:
                metrics.write(step, reward_mean=step / 10, pass_rate=0.0, loss=0.1, groups="g0000000")
            else:
                metrics.write(step, loss=5.0 - step / 10, tokens_per_s=1000.0)
    for step in checkpoints:
        (root / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (root / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").write_text("{}")
    if export:
        (root / "export").mkdir()
        (root / "export" / "config.json").write_text("{}")
    if policy is not None:
        (root / "policy.json").write_text(json.dumps({"version": policy, "store_version": "v"}))
    if failure:
        (root / "logs" / "failure.txt").write_text(failure)
    return root


@pytest.fixture
def runs_dir(tmp_path):
    parent = tmp_path / "runs"
    make_run(parent, "mid-done", "smoke-midtrain.yaml", 10, 10, checkpoints=[10], export=True)
    make_run(parent, "mid-killed", "smoke-midtrain.yaml", 10, 7, checkpoints=[4])
    make_run(parent, "rl-failed", "smoke-rl.yaml", 5, 2, policy=2, failure="the learner failed (torchrun exit code 1)\n  ValueError: x")
    make_run(parent / "nested", "rl-done", "smoke-rl.yaml", 5, 5, checkpoints=[4, 5], policy=5)
    make_run(parent, "rl-steps-done-no-policy", "smoke-rl.yaml", 5, 5, policy=4)
    return parent


def test_status_comes_from_the_files(runs_dir):
    by_name = {p.name: run_status(p) for p in find_runs(runs_dir)}
    assert {name: (s.kind, s.status) for name, s in by_name.items()} == {
        "mid-done": ("midtrain", "finished"),
        "mid-killed": ("midtrain", "resumable"),
        "rl-failed": ("rl", "failed"),
        "rl-done": ("rl", "finished"),
        "rl-steps-done-no-policy": ("rl", "resumable"),
    }
    killed = by_name["mid-killed"]
    assert (killed.steps_done, killed.steps, killed.checkpoint_step) == (7, 10, 4)
    assert killed.figures == {"loss": pytest.approx(4.3), "tokens_per_s": 1000.0}
    assert by_name["rl-failed"].reason == "the learner failed (torchrun exit code 1)"
    assert by_name["rl-done"].figures["reward_mean"] == 0.5 and by_name["rl-done"].age_seconds < 60


def test_a_live_process_holding_the_run_makes_it_running(runs_dir):
    root = runs_dir / "mid-killed"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from composer.runtime.run_dir import RunDir; "
            "run = RunDir(Path(sys.argv[1])); run.prepare(run.recipe_path.read_text(), resume=True); "
            "print('held', flush=True); sys.stdin.read()",
            str(root),
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        status = run_status(root)
        assert status.status == "running" and status.reason == f"pid {holder.pid}"
        with pytest.raises(Exception, match=f"in use by another composer process \\(pid {holder.pid}\\)"):
            RunDir(root).prepare(root.joinpath("recipe.yaml").read_text(), resume=True)
    finally:
        holder.kill()  # as kill -9 would: the kernel drops the lock
        holder.wait()
    assert run_status(root).status == "resumable"


def test_runs_command_lists_and_shows(runs_dir, composer):
    result = composer("runs", str(runs_dir))
    assert result.returncode == 0, result.stderr
    rows = {
        line.split("│")[1].strip().rsplit("/", 1)[-1]: [c.strip() for c in line.split("│")[2:]]
        for line in result.stdout.splitlines()
        if line.startswith("│")
    }
    assert rows["mid-killed"][:3] == ["midtrain", "resumable", "7/10"]
    assert rows["rl-failed"][:3] == ["rl", "failed", "2/5"] and "reward 0.2" in rows["rl-failed"][3]
    shown = composer("runs", "show", str(runs_dir / "rl-failed"))
    assert shown.returncode == 0 and re.search(r"status +failed  the learner failed \(torchrun exit code 1\)", shown.stdout)
    assert re.search(r"checkpoint +none", shown.stdout)
    missing = composer("runs", str(runs_dir / "absent"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr and "Traceback" not in missing.stderr
    not_a_run = composer("runs", "show", str(runs_dir))
    assert not_a_run.returncode == 2 and "not a run directory" in not_a_run.stderr


def test_an_unreadable_recipe_is_listed_not_fatal(runs_dir):
    (runs_dir / "mid-done" / "recipe.yaml").write_text("run: [unclosed\n")
    status = run_status(runs_dir / "mid-done")
    assert status.status == "unreadable" and status.reason
    assert len(find_runs(runs_dir)) == 5


def test_runs_piped_to_a_file_keep_every_name_whole(tmp_path):
    """Two runs of one job differ only at the end of their names: a listing written to a pipe (80 columns by
    default) must not cut them."""
    parent = tmp_path / "runs"
    names = ["main-20261204-224958-nightly/smoke-midtrain", "main-20261204-231502-nightly/smoke-midtrain"]
    for name in names:
        job, run = name.split("/")
        make_run(parent / job, run, "smoke-midtrain.yaml", 10, 10, checkpoints=[10], export=True)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    result = subprocess.run(
        [sys.executable, "-m", "composer.cli", "runs", str(parent)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in names), result.stdout
    assert "…" not in result.stdout


def test_a_table_written_to_a_file_cuts_no_number():
    """`composer data stats` and `composer runs` print their tables whole when the output is not a terminal."""
    import io

    from rich.console import Console
    from rich.table import Table

    from composer.runtime.progress import print_whole_table

    out = io.StringIO()
    table = Table()
    for column in ("source", "documents", "tokens", "mixture tokens"):
        table.add_column(column)
    table.add_row("stdlib-python-and-more", "1,163,842", "98,765,432,101", "12,345,678,901")
    print_whole_table(Console(file=out, width=40), table)
    assert all(text in out.getvalue() for text in ("stdlib-python-and-more", "1,163,842", "98,765,432,101", "12,345,678,901"))
