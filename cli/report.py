"""`composer report RUN_DIR`: plot a run's metrics and summarise every series."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(help="Plot a run's metrics.jsonl into RUN_DIR/report/, write RUN_DIR/report.html and print a summary of every series.")
console = Console()


@app.callback(invoke_without_command=True)
def report(run_dir: Path = typer.Argument(..., help="Run directory (holds metrics.jsonl).")) -> None:
    """Plot a run's metrics.jsonl into RUN_DIR/report/, write RUN_DIR/report.html (self-contained) and print a summary."""
    from trainer.report import render_report  # imports matplotlib: keep `composer --help` fast

    result = render_report(run_dir)
    table = Table(title=escape(str(run_dir)))
    for column in ("series", "points", "first", "last", "min", "max"):
        table.add_column(column, justify="left" if column == "series" else "right")
    for s in result.series:
        table.add_row(escape(s.name), str(len(s.values)), *(f"{v:.4g}" for v in (s.first, s.last, s.min, s.max)))
    console.print(table)
    console.print(f"{len(result.images)} plot(s) in {escape(str(run_dir / 'report'))}/, all in {escape(str(result.html))}", highlight=False)
