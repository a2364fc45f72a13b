"""`composer report RUN_DIR`: plot a run's metrics and summarise every series."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console(soft_wrap=True)


def report(
    run_dir: Path = typer.Argument(..., help="Run directory (holds metrics.jsonl)."),
    every_series: bool = typer.Option(False, "--all", help="Summarise every series, not only the headline ones."),
) -> None:
    """Plot a run's metrics.jsonl into RUN_DIR/report/, write RUN_DIR/report.html (self-contained) and summarise the
    headline series (report.html has every one)."""
    from runtime.report import is_headline, render_report  # imports matplotlib: keep `composer --help` fast

    result = render_report(run_dir)
    shown = [s for s in result.series if every_series or is_headline(s.name)]
    table = Table(title=escape(str(run_dir)))
    for column in ("series", "points", "first", "last", "min", "max"):
        table.add_column(column, justify="left" if column == "series" else "right")
    for s in shown:
        table.add_row(escape(s.name), str(len(s.values)), *(f"{v:.4g}" for v in (s.first, s.last, s.min, s.max)))
    console.print(table)
    more = f" ({len(result.series) - len(shown)} more series there; --all prints them)" if len(shown) < len(result.series) else ""
    console.print(f"{len(result.images)} plot(s) in {escape(str(run_dir / 'report'))}/, all in {escape(str(result.html))}{more}", highlight=False)
