"""Plots of runs' metrics: one PNG per group of related series, grouped into panels (the headline ones first),
first/last/min/max per series, and `report.html`: all of it in one self-contained page (plots inline, the run's
status and resolved recipe) that opens offline. `render_comparison` overlays several runs on the same axes.

Generic on purpose: every numeric key of the records becomes a series plotted against `step`, so the
metrics of any loop (mid-training, RL rewards, sync sizes) are plotted without registering them here.
Related series share a figure (loss with eval loss, every MoE balance series together); a held-out pass rate with
`_low`/`_high` series is drawn with its interval as a band.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from composer.recipes.errors import UserError
from composer.runtime.run_dir import atomic_write_bytes, atomic_write_text, read_metrics
from composer.runtime.status import run_status

NOT_SERIES = ("step", "time")
EVAL_METRICS = "eval_metrics.jsonl"
BAND = ("_low", "_high")

# First matching rule names the figure a series goes to; a series matching none gets a figure of its own.
SERIES_GROUPS: list[tuple[str, Callable[[str], bool]]] = [
    ("eval", lambda key: key.startswith("eval_") and ("pass@" in key or "reward" in key)),  # RL held-out (eval_metrics.jsonl)
    ("summarization", lambda key: "summar" in key or "compaction" in key or key == "episode_tokens_over_context"),
    ("moe", lambda key: key.startswith("moe") or "expert" in key or "load_balanc" in key),
    ("sync", lambda key: key.startswith("sync_")),
    ("sandbox", lambda key: key.startswith(("flag_", "sandbox_", "canary_")) or "infra_failure" in key),
    ("loss", lambda key: "loss" in key),
    ("lr", lambda key: key in ("lr", "learning_rate") or key.endswith("_lr")),
    ("grad_norm", lambda key: "grad_norm" in key),
    ("mismatch", lambda key: "logprob" in key or "prob_ratio" in key or key.startswith(("is_", "alarm_", "routing_disagreement"))),
    ("policy", lambda key: key in ("entropy", "kl_ref", "uniform_group_fraction") or key.startswith("response_tokens")),
    ("staleness", lambda key: "stale" in key),
    ("throughput", lambda key: key.endswith("_per_s") or "per_sec" in key or "throughput" in key),
    ("step_time", lambda key: key.endswith("_seconds")),
    ("reward", lambda key: "reward" in key or key == "pass_rate"),
]

PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("Reward and held-out evaluation", ("reward", "eval")),
    ("Loss and optimizer", ("loss", "lr", "grad_norm")),
    ("Self-summarization", ("summarization",)),
    ("Train/inference mismatch and importance sampling", ("mismatch", "policy", "staleness")),
    ("Throughput and step time", ("throughput", "step_time")),
    ("Weight sync", ("sync",)),
    ("Sandbox: flags and infra failures", ("sandbox",)),
    ("MoE balance", ("moe",)),
]
"""The page's panels in order (headline first) and the figure groups each holds; the other groups go last."""
OTHER_PANEL = "Other series"

HEADLINE_SERIES = (
    "loss",
    "eval_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "moe_aux_loss",
    "reward_mean",
    "pass_rate",
    "staleness_mean",
    "trained_tokens_per_s",
    "generated_tokens_per_s",
    "sync_ratio",
    "sync_seconds",
)
"""What `composer report` summarises on the console (held-out `eval_*` series too); report.html has every series."""


def is_headline(name: str) -> bool:
    return name in HEADLINE_SERIES or name.startswith("eval_")


_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # how MetricsWriter records them


@dataclass
class Series:
    name: str
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    run: str = ""
    """The run it was read from (a comparison's legend)."""

    @property
    def finite(self) -> list[float]:
        return [v for v in self.values if math.isfinite(v)]

    @property
    def first(self) -> float:
        return self.values[0]

    @property
    def last(self) -> float:
        return self.values[-1]

    @property
    def min(self) -> float:
        return min(self.finite, default=math.nan)

    @property
    def max(self) -> float:
        return max(self.finite, default=math.nan)


@dataclass(frozen=True)
class Report:
    series: list[Series]
    images: list[Path]
    html: Path
    plotted: dict[str, list[str]] = field(default_factory=dict)
    """Per image (its stem), the runs whose series it draws."""


def read_series(metrics_path: Path, run: str = "") -> list[Series]:
    """Every numeric series of a metrics file, in order of first appearance."""
    found: dict[str, Series] = {}
    for record in read_metrics(metrics_path):
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, value in record.items():
            number = _as_number(value)
            if key in NOT_SERIES or number is None:
                continue
            series = found.setdefault(key, Series(key, run=run))
            series.steps.append(step)
            series.values.append(number)
    return list(found.values())


def _as_number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _NON_FINITE.get(value)
    return None


def group_of(name: str) -> str:
    return next((group for group, matches in SERIES_GROUPS if matches(name)), name)


def group_series(series: list[Series]) -> dict[str, list[Series]]:
    groups: dict[str, list[Series]] = {}
    for s in series:
        groups.setdefault(group_of(s.name), []).append(s)
    return groups


def panel_of(group: str) -> str:
    return next((title for title, groups in PANELS if group in groups), OTHER_PANEL)


def run_series(run_dir: Path, run: str = "") -> list[Series]:
    """A run's series: its metrics.jsonl and, for an RL run, its held-out evaluations."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (not a run directory, or the run has not logged yet)")
    series = read_series(metrics_path, run)
    if (run_dir / EVAL_METRICS).is_file():  # an RL run's held-out evaluations, written by its rollout driver
        series += read_series(run_dir / EVAL_METRICS, run)
    if not series:
        raise UserError(f"{metrics_path}: no numeric metrics recorded yet")
    return series


def render_report(run_dir: Path) -> Report:
    """Write `run_dir/report/<group>.png` for every series group (PNGs of groups no longer present are removed) and
    `run_dir/report.html`."""
    series = run_series(run_dir)
    images, plotted = _write_plots(run_dir / "report", series)
    page = run_dir / "report.html"
    atomic_write_text(page, report_html([run_dir], series, images))
    return Report(series, images, page, plotted)


def render_comparison(run_dirs: list[Path], out: Path) -> Report:
    """Every series of every run in `run_dirs`, the runs overlaid on the same axes, into `out/report/` and
    `out/report.html`."""
    labels = _run_labels(run_dirs)
    series = [s for run_dir, label in zip(run_dirs, labels) for s in run_series(run_dir, label)]
    images, plotted = _write_plots(out / "report", series)
    page = out / "report.html"
    atomic_write_text(page, report_html(run_dirs, series, images))
    return Report(series, images, page, plotted)


def _run_labels(run_dirs: list[Path]) -> list[str]:
    """Short names that tell the runs apart: their directory names, with their parents' where two share one."""
    names = [d.resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{d.resolve().parent.name}/{d.resolve().name}" for d in run_dirs]


def _write_plots(out_dir: Path, series: list[Series]) -> tuple[list[Path], dict[str, list[str]]]:
    groups = group_series(series)
    order = {title: n for n, (title, _) in enumerate(PANELS)}
    images, plotted = [], {}
    for group in sorted(groups, key=lambda g: order.get(panel_of(g), len(PANELS))):
        members = groups[group]
        path = out_dir / f"{_file_name(group)}.png"
        atomic_write_bytes(path, _plot(group, members))
        images.append(path)
        plotted[path.stem] = list(dict.fromkeys(s.run for s in members))
    for stale in set(out_dir.glob("*.png")) - set(images):
        stale.unlink()
    return images, plotted


def report_html(run_dirs: list[Path], series: list[Series], images: list[Path]) -> str:
    """One page holding everything: the runs' status, the plots in panels (headline first), the summary of every
    series, the resolved recipe of a single run; no script, no link outside it (images are data URIs)."""
    esc = html.escape
    statuses, recipes = [], []
    for run_dir in run_dirs:
        recipe_path = run_dir / "recipe.yaml"
        if recipe_path.is_file():
            s = run_status(run_dir)
            statuses.append(
                f"<p class=status>{esc(run_dir.name) + ': ' if len(run_dirs) > 1 else ''}<b>{esc(s.kind)}</b> run, "
                f"<b class={esc(s.status)}>{esc(s.status)}</b>{': ' + esc(s.reason) if s.reason else ''}; "
                f"step {s.steps_done} of {s.steps}"
                f"{f'; newest checkpoint step {s.checkpoint_step}' if s.checkpoint_step is not None else ''}</p>"
            )
            if len(run_dirs) == 1:
                recipes.append(f"<h2>Resolved recipe</h2><pre>{esc(recipe_path.read_text(errors='replace'))}</pre>")
        else:
            statuses.append(f"<p class=status>{esc(run_dir.name)}: no recipe.yaml: status unknown</p>")
    many = len(run_dirs) > 1
    rows = "".join(
        f"<tr><td>{esc(x.name)}</td>{f'<td>{esc(x.run)}</td>' if many else ''}<td>{len(x.values)}</td>"
        + "".join(f"<td>{v:.4g}</td>" for v in (x.first, x.last, x.min, x.max))
        + "</tr>"
        for x in series
    )
    group_files = {_file_name(group): group for group in group_series(series)}
    panels: dict[str, list[Path]] = {}
    for image in images:
        panels.setdefault(panel_of(group_files.get(image.stem, image.stem)), []).append(image)
    sections = "".join(
        f"<section><h2>{esc(title)}</h2><div class=grid>"
        + "".join(
            f'<figure><img alt="{esc(p.stem)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}"></figure>'
            for p in members
        )
        + "</div></section>"
        for title, members in panels.items()
    )
    title = ", ".join(d.name for d in run_dirs)
    return f"""<!DOCTYPE html>
<html lang=en><head><meta charset=utf-8><title>{esc(title)}: composer report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:110em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:right}} td:first-child{{text-align:left}}
.grid{{display:flex;flex-wrap:wrap;gap:.5em}} figure{{margin:0;flex:1 1 34em;max-width:54em}} img{{width:100%}}
pre{{background:#f4f4f4;padding:1em;overflow:auto}}
.finished{{color:#070}} .failed{{color:#b00}} .resumable{{color:#a60}} .running{{color:#06a}}</style></head>
<body><h1>{esc(", ".join(str(d) for d in run_dirs))}</h1>{"".join(statuses)}<p>written {time.strftime("%Y-%m-%d %H:%M:%S")}</p>
{sections}
<h2>Summary of every series</h2><table><tr><th>series</th>{"<th>run</th>" if many else ""}<th>points</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>{rows}</table>
{"".join(recipes)}</body></html>
"""


def _file_name(group: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", group)


def _bands(members: list[Series]) -> dict[tuple[str, str], tuple[Series, Series]]:
    """(run, name) of each series drawn with an interval -> its `_low` and `_high` series."""
    by_key = {(s.run, s.name): s for s in members}
    return {
        (run, name[: -len(BAND[0])]): (s, by_key[(run, name[: -len(BAND[0])] + BAND[1])])
        for (run, name), s in by_key.items()
        if name.endswith(BAND[0]) and (run, name[: -len(BAND[0])]) in by_key and (run, name[: -len(BAND[0])] + BAND[1]) in by_key
    }


def _plot(title: str, members: list[Series]) -> bytes:
    # A bare Figure renders with Agg and touches no pyplot global state, so no display is needed.
    runs = list(dict.fromkeys(s.run for s in members))
    bands = _bands(members)
    drawn_as_band = {(run, name + suffix) for run, name in bands for suffix in BAND}
    lines = [s for s in members if (s.run, s.name) not in drawn_as_band]
    names = list(dict.fromkeys(s.name for s in lines))
    panels = [names] if _comparable(lines) else [[n] for n in names]
    figure = Figure(figsize=(8, 2.2 + 2.3 * len(panels)), layout="constrained")
    figure.suptitle(title)
    all_axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    compared = len(runs) > 1  # a colour per run, a line style per series
    for axes, panel in zip(all_axes, panels):
        for s in (x for x in lines if x.name in panel):
            marker = "o" if len(s.steps) <= 50 else None  # sparse series (eval) stay visible as points
            style = {"color": f"C{runs.index(s.run)}", "linestyle": ("-", "--", ":", "-.")[panel.index(s.name) % 4]} if compared else {}
            [line] = axes.plot(
                s.steps, s.values, label=f"{s.run}: {s.name}" if compared else s.name, marker=marker, markersize=3, linewidth=1.2, **style
            )
            if (s.run, s.name) in bands:
                low, high = bands[(s.run, s.name)]
                if low.steps == s.steps == high.steps:
                    axes.fill_between(s.steps, low.values, high.values, color=line.get_color(), alpha=0.15, linewidth=0)
        axes.grid(True, alpha=0.3)
        if len(panel) > 1 or panel[0] != title or compared:
            axes.legend(fontsize="small")
    all_axes[-1].set_xlabel("step")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _comparable(members: list[Series]) -> bool:
    """Series share one panel when their magnitudes are within 10x (train vs eval loss); else one panel each."""
    peaks = [max((abs(v) for v in s.finite), default=0.0) for s in members]
    low, high = min(peaks), max(peaks)
    return high == 0 or (low > 0 and high / low <= 10)


# --- composer eval's page ----------------------------------------------------------------------


def _fraction(value: float | None, interval: list[float] | None = None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = f"{value:.3f}"
    return text + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def _eval_rows(name: str, entry: dict, roles: list[str], pass_k: list[int]) -> list[tuple[str, list[str]]]:
    """The rows of one set's table: a figure per row, a checkpoint per column."""

    def figure(fn: Callable[[dict], str]) -> list[str]:
        return [fn(entry[role]) for role in roles]

    def record(s: dict, key: str) -> float | None:
        return s["record"].get(f"eval_{name}_{key}")

    rows = [
        ("tasks (skipped)", figure(lambda s: f"{s['tasks']} ({s['skipped']})")),
        (
            "greedy pass@1 [95% CI]",
            figure(lambda s: _fraction(record(s, "greedy_pass@1"), [record(s, "greedy_pass@1_low"), record(s, "greedy_pass@1_high")])),
        ),
        ("greedy reward", figure(lambda s: _fraction(record(s, "greedy_reward")))),
    ]
    rows += [(f"pass@{k} (sampled)", figure(lambda s, k=k: _fraction(record(s, f"pass@{k}")))) for k in pass_k]
    rows += [
        ("infra failures (episodes)", figure(lambda s: str(s["infra_failures"]))),
        ("greedy pass@1 without infra failures", figure(lambda s: _fraction(s["greedy_pass@1_without_infra_failures"]))),
        (
            "flagged episodes",
            figure(
                lambda s: f"{s['flagged_episodes']}" + (f" ({', '.join(f'{f} {n}' for f, n in s['flags'].items())})" if s["flags"] else "")
            ),
        ),
        ("summaries per episode", figure(lambda s: f"{s['summaries_per_episode']:.2f}")),
        ("summary tokens (mean)", figure(lambda s: f"{s['summary_tokens_mean']:.1f}" if "summary_tokens_mean" in s else "-")),
        ("compaction error [95% CI]", figure(lambda s: _fraction(s.get("compaction_error"), s.get("compaction_error_interval")))),
        ("episode ends (greedy)", figure(lambda s: ", ".join(f"{r} {n}" for r, n in s["end_reasons"].items()))),
    ]
    return rows


def _kind_cell(kind: dict) -> str:
    """Pass@1 of one kind of task and, with the tools harness, whether the policy speaks its format."""
    text = f"{_fraction(kind['greedy_pass@1'], kind['interval'])} of {kind['tasks']}"
    if kind.get("tool_calls") is not None:
        text += (
            f"; tool calls parsed {_fraction(kind['tool_calls_parsed'])} of {kind['tool_calls']}; finish {_fraction(kind['finish_called'])}"
        )
    return text


def eval_report_html(results: dict) -> str:
    """`composer eval`'s results on one self-contained page: per set a table of figures per checkpoint, the paired
    differences with --compare, and pass@1 per kind of task."""
    esc = html.escape
    roles = list(results["checkpoints"])
    head = "".join(f"<th>{esc(role)}<br><small>{esc(spec)}</small></th>" for role, spec in results["checkpoints"].items())
    sections = []
    for name, entry in results["sets"].items():
        rows = "".join(
            f"<tr><td>{esc(label)}</td>" + "".join(f"<td>{esc(v)}</td>" for v in values) + "</tr>"
            for label, values in _eval_rows(name, entry, roles, results["pass_k"])
        )
        part = f"<h2>{esc(name)}</h2><table><tr><th>figure</th>{head}</tr>{rows}</table>"
        if "difference" in entry:
            d = entry["difference"]
            sampled = (
                f"<tr><td>sampled pass@1 difference [95% paired bootstrap CI]</td><td>{_signed(d['sampled_pass@1'], d['sampled_pass@1_interval'])}</td></tr>"
                if "sampled_pass@1" in d
                else ""
            )
            part += (
                f"<h3>checkpoint - compare (same {d['tasks']} tasks)</h3><table>"
                f"<tr><td>greedy pass@1 difference [95% paired bootstrap CI]</td><td>{_signed(d['greedy_pass@1'], d['greedy_pass@1_interval'])}</td></tr>"
                f"{sampled}<tr><td>tasks gained</td><td>{len(d['gained'])}: {esc(', '.join(d['gained']))}</td></tr>"
                f"<tr><td>tasks lost</td><td>{len(d['lost'])}: {esc(', '.join(d['lost']))}</td></tr></table>"
            )
        kinds = sorted({k for role in roles for k in entry[role]["kinds"]})
        spoken = any(entry[r]["kinds"][k].get("tool_calls") for r in roles for k in entry[r]["kinds"])
        if len(kinds) > 1 or spoken:
            kind_rows = "".join(
                f"<tr><td>{esc(k)}</td>"
                + "".join(f"<td>{esc(_kind_cell(entry[r]['kinds'][k]))}</td>" if k in entry[r]["kinds"] else "<td>-</td>" for r in roles)
                + "</tr>"
                for k in kinds
            )
            part += f"<h3>greedy pass@1 per kind (tools harness: the share of tool calls that parse, of episodes that call finish)</h3><table><tr><th>kind</th>{head}</tr>{kind_rows}</table>"
        sections.append(part)
    return f"""<!DOCTYPE html>
<html lang=en><head><meta charset=utf-8><title>composer eval</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:70em}} table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:right}} td:first-child{{text-align:left}}</style></head>
<body><h1>composer eval</h1><p>{results["samples"]} sampled episode(s) per task; written {time.strftime("%Y-%m-%d %H:%M:%S")}</p>
{"".join(sections)}</body></html>
"""


def _signed(value: float, interval: list[float]) -> str:
    return f"{value:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]"


def write_eval_report(path: Path, results: dict) -> None:
    atomic_write_text(path, eval_report_html(results))
