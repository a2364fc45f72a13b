"""What a run directory says about its run, read from its files only: kind, status, steps, last figures, age.

running    a live process holds the run's lock (runtime.run_dir.RunDir)
failed     it last stopped on an error: logs/failure.txt, or a rank's logs/error-rank-N.txt
finished   every step done and the run's output written (midtrain: export/, RL: the last policy published)
resumable  stopped before the end (killed, interrupted): `--resume` continues from the newest checkpoint
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.runtime.run_dir import FAILURE_FILE, RunDir, read_metrics

KEY_FIGURES = {
    "midtrain": ("loss", "eval_loss", "tokens_per_s"),
    "rl": ("reward_mean", "pass_rate", "staleness_mean", "trained_tokens_per_s"),
}
SEARCH_DEPTH = 3
"""How deep `find_runs` looks for run directories under the directory it is given."""


@dataclass
class RunStatus:
    root: Path
    kind: str
    status: str
    steps_done: int
    steps: int
    checkpoint_step: int | None
    age_seconds: float | None
    figures: dict[str, float] = field(default_factory=dict)
    """The newest value of each key figure, and of every held-out `eval_*` series."""
    reason: str = ""
    """Why it failed (first line), who runs it, or why the directory cannot be read."""


def run_status(root: Path) -> RunStatus:
    run = RunDir(root)
    if not run.recipe_path.is_file():
        raise UserError(f"{root}: not a run directory (no recipe.yaml)")
    holder = run.holder()
    try:
        recipe = load_recipe(run.recipe_path)
    except UserError as e:
        return RunStatus(root, "?", "running" if holder else "unreadable", 0, 0, None, _age(run), reason=str(e).splitlines()[0])
    kind = "rl" if recipe.rl is not None else "midtrain"
    records = list(read_metrics(run.metrics_path)) if run.metrics_path.is_file() else []
    done = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
    newest: dict[str, float] = {}
    for record in records:
        for key, value in record.items():
            if (key in KEY_FIGURES[kind] or key.startswith("eval_")) and isinstance(value, (int, float)) and not isinstance(value, bool):
                newest[key] = value
    figures = {key: newest.pop(key) for key in KEY_FIGURES[kind] if key in newest} | newest
    status, reason = _status(run, kind, done, recipe.train.steps, holder)
    return RunStatus(root, kind, status, done, recipe.train.steps, _checkpoint_step(run), _age(run), figures, reason)


def _status(run: RunDir, kind: str, done: int, steps: int, holder: str | None) -> tuple[str, str]:
    if holder:
        return "running", holder
    failures = [run.logs / FAILURE_FILE, *sorted(run.logs.glob("error-rank-*.txt"))]
    failure = next((p for p in failures if p.is_file()), None)
    if failure is not None:
        return "failed", failure.read_text(errors="replace").strip().splitlines()[0] if failure.stat().st_size else failure.name
    if done >= steps and _output_written(run, kind, steps):
        return "finished", ""
    return "resumable", ""


def _output_written(run: RunDir, kind: str, steps: int) -> bool:
    if kind == "midtrain":
        return (run.root / "export" / "config.json").is_file()
    try:
        return json.loads((run.root / "policy.json").read_text())["version"] >= steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _checkpoint_step(run: RunDir) -> int | None:
    steps = [
        int(p.name.removeprefix("step-"))
        for p in run.checkpoints.glob("step-*")
        if p.name.removeprefix("step-").isdigit() and (p / "trainer_state.json").is_file()
    ]
    return max(steps, default=None)


def _age(run: RunDir) -> float | None:
    """Seconds since the run last wrote its metrics (or its recipe, before the first record)."""
    times = [p.stat().st_mtime for p in (run.metrics_path, run.recipe_path) if p.is_file()]
    return time.time() - max(times) if times else None


def find_runs(directory: Path) -> list[Path]:
    """Run directories (holding recipe.yaml) at or under `directory`, newest activity first."""
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory")
    found: list[Path] = []

    def visit(path: Path, depth: int) -> None:
        if (path / "recipe.yaml").is_file():
            found.append(path)
            return  # a run's own subdirectories hold no runs
        if depth < SEARCH_DEPTH:
            try:
                children = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                return  # unreadable: not ours to list
            for child in children:
                visit(child, depth + 1)

    visit(directory, 0)
    return sorted(
        found, key=lambda p: -max((f.stat().st_mtime for f in (p / "metrics.jsonl", p / "recipe.yaml") if f.is_file()), default=0)
    )
