"""Plots of a run's metrics.jsonl: one PNG per group of related series, and first/last/min/max per series.

Generic on purpose: every numeric key of the records becomes a series plotted against `step`, so the
metrics of any loop (mid-training, RL rewards, sync sizes) are plotted without registering them here.
Related series share a figure (loss with eval loss, every MoE balance series together).
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from matplotlib.figure import Figure

from recipes.errors import UserError
from recipes.runs import atomic_write_bytes, read_metrics

NOT_SERIES = ("step", "time")
EVAL_METRICS = "eval_metrics.jsonl"

# First matching rule names the figure a series goes to; a series matching none gets a figure of its own.
SERIES_GROUPS: list[tuple[str, Callable[[str], bool]]] = [
    ("eval", lambda key: key.startswith("eval_") and "pass@" in key),  # RL held-out pass rates (eval_metrics.jsonl)
    ("moe", lambda key: key.startswith("moe") or "expert" in key or "load_balanc" in key),
    ("loss", lambda key: "loss" in key),
    ("lr", lambda key: key in ("lr", "learning_rate") or key.endswith("_lr")),
    ("grad_norm", lambda key: "grad_norm" in key),
    ("throughput", lambda key: key.endswith("_per_s") or "per_sec" in key or "throughput" in key),
    ("reward", lambda key: "reward" in key),
]

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # how MetricsWriter records them


@dataclass
class Series:
    name: str
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

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


def read_series(metrics_path: Path) -> list[Series]:
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
            series = found.setdefault(key, Series(key))
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


def group_series(series: list[Series]) -> dict[str, list[Series]]:
    groups: dict[str, list[Series]] = {}
    for s in series:
        group = next((name for name, matches in SERIES_GROUPS if matches(s.name)), s.name)
        groups.setdefault(group, []).append(s)
    return groups


def render_report(run_dir: Path) -> Report:
    """Write `run_dir/report/<group>.png` for every series group; PNGs of groups no longer present are removed."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (not a run directory, or the run has not logged yet)")
    series = read_series(metrics_path)
    if (run_dir / EVAL_METRICS).is_file():  # an RL run's held-out evaluations, written by its rollout driver
        series += read_series(run_dir / EVAL_METRICS)
    if not series:
        raise UserError(f"{metrics_path}: no numeric metrics recorded yet")
    out_dir = run_dir / "report"
    images = []
    for group, members in group_series(series).items():
        path = out_dir / f"{_file_name(group)}.png"
        atomic_write_bytes(path, _plot(group, members))
        images.append(path)
    for stale in set(out_dir.glob("*.png")) - set(images):
        stale.unlink()
    return Report(series, images)


def _file_name(group: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", group)


def _plot(title: str, members: list[Series]) -> bytes:
    # A bare Figure renders with Agg and touches no pyplot global state, so no display is needed.
    panels = [members] if _comparable(members) else [[s] for s in members]
    figure = Figure(figsize=(8, 2.2 + 2.3 * len(panels)), layout="constrained")
    figure.suptitle(title)
    all_axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axes, panel in zip(all_axes, panels):
        for s in panel:
            marker = "o" if len(s.steps) <= 50 else None  # sparse series (eval) stay visible as points
            axes.plot(s.steps, s.values, label=s.name, marker=marker, markersize=3, linewidth=1.2)
        axes.grid(True, alpha=0.3)
        if len(panel) > 1 or panel[0].name != title:
            axes.legend()
    all_axes[-1].set_xlabel("step")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _comparable(members: list[Series]) -> bool:
    """Series share one panel when their magnitudes are within 10x (train vs eval loss); else one panel each."""
    peaks = [max((abs(v) for v in s.finite), default=0.0) for s in members]
    low, high = min(peaks), max(peaks)
    return high == 0 or (low > 0 and high / low <= 10)
