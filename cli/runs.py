"""`composer runs [DIR]` and `composer runs show RUN`: the runs under a directory, and one run in detail."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from composer.runtime.progress import duration_text, print_whole_table
from composer.runtime.status import RunStatus, find_runs, run_status

console = Console()

SHORT_NAMES = {
    "reward_mean": "reward",
    "pass_rate": "pass",
    "staleness_mean": "stale",
    "trained_tokens_per_s": "tok/s",
    "eval_loss": "eval",
    "tokens_per_s": "tok/s",
}
STATUS_STYLE = {"running": "cyan", "finished": "green", "failed": "red", "resumable": "yellow", "unreadable": "red"}


def runs(
    target: str = typer.Argument(
        "runs", metavar="DIR|show", help="Directory to list (default: runs), or `show` followed by one run directory."
    ),
    run: Path | None = typer.Argument(None, metavar="RUN", help="With `show`: the run directory."),
) -> None:
    """List the runs under DIR (searched three levels deep), or `composer runs show RUN` for one run."""
    if target == "show":
        if run is None:
            raise typer.BadParameter("composer runs show RUN: name the run directory")
        show(run_status(run))
        return
    if run is not None:
        raise typer.BadParameter(f"unexpected argument {run} (did you mean `composer runs show {run}`?)")
    directory = Path(target)
    statuses = [run_status(path) for path in find_runs(directory)]
    if not statuses:
        console.print(f"no runs under {escape(target)}", highlight=False)
        return
    table = Table(title=escape(str(directory)))
    for column in ("run", "kind", "status", "steps", "last figures", "age"):
        table.add_column(
            column, justify="right" if column in ("steps", "age") else "left", overflow="fold", no_wrap=column != "last figures"
        )
    for s in statuses:
        name = str(s.root.relative_to(directory)) if s.root != directory else str(s.root)
        table.add_row(escape(name), s.kind, status_text(s), f"{s.steps_done}/{s.steps}", escape(figures_text(s)), age_text(s))
    print_whole_table(console, table)


def show(s: RunStatus) -> None:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("run", escape(str(s.root)))
    table.add_row("kind", s.kind)
    table.add_row("status", status_text(s) + (f"  {escape(s.reason)}" if s.reason else ""))
    table.add_row("steps", f"{s.steps_done}/{s.steps}")
    table.add_row("checkpoint", f"step {s.checkpoint_step}" if s.checkpoint_step is not None else "none")
    for key, value in s.figures.items():
        table.add_row(escape(key), f"{value:.4g}")
    table.add_row("last write", age_text(s) + " ago")
    table.add_row("logs", escape(str(s.root / "logs")) + "/")
    console.print(table)


def status_text(s: RunStatus) -> str:
    return f"[{STATUS_STYLE.get(s.status, 'white')}]{s.status}[/]"


def figures_text(s: RunStatus) -> str:
    return "  ".join(f"{SHORT_NAMES.get(key, key)} {value:.4g}" for key, value in s.figures.items() if math.isfinite(value))


def age_text(s: RunStatus) -> str:
    return duration_text(s.age_seconds) if s.age_seconds is not None else "-"
