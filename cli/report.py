"""`composer report RUN_DIR` (or `--compare RUN RUN...`): plot runs' metrics and summarise every series."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from composer.recipes.errors import UserError

console = Console(soft_wrap=True)


def report(
    run_dirs: list[Path] = typer.Argument(..., metavar="RUN_DIR...", help="Run directory (holds metrics.jsonl); several with --compare."),
    every_series: bool = typer.Option(False, "--all", help="Summarise every series, not only the headline ones."),
    compare: bool = typer.Option(False, "--compare", help="Overlay the runs on the same axes, in one page."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="--compare: where report.html and its plots go (default: compare-<runs> beside the first run)."
    ),
) -> None:
    """Plot a run's metrics.jsonl into RUN_DIR/report/, write RUN_DIR/report.html (self-contained: plots in panels, the
    headline ones first) and summarise the headline series; --compare overlays several runs in one page."""
    from composer.runtime.report import (  # imports matplotlib: keep `composer --help` fast
        is_headline,
        render_comparison,
        render_report,
    )

    if compare and len(run_dirs) < 2:
        raise UserError("--compare needs two runs or more")
    if not compare and len(run_dirs) > 1:
        raise UserError(f"{len(run_dirs)} runs given: pass --compare to overlay them, or one run")
    if compare:
        out = out or run_dirs[0].parent / ("compare-" + "-".join(d.resolve().name for d in run_dirs))
        result = render_comparison(run_dirs, out)
    else:
        result = render_report(run_dirs[0])
    shown = [s for s in result.series if every_series or is_headline(s.name)]
    table = Table(title=escape(", ".join(str(d) for d in run_dirs)))
    columns = ("series", *(("run",) if compare else ()), "points", "first", "last", "min", "max")
    for column in columns:
        table.add_column(column, justify="left" if column in ("series", "run") else "right")
    for s in shown:
        table.add_row(
            escape(s.name),
            *((escape(s.run),) if compare else ()),
            str(len(s.values)),
            *(f"{v:.4g}" for v in (s.first, s.last, s.min, s.max)),
        )
    console.print(table)
    more = f" ({len(result.series) - len(shown)} more series there; --all prints them)" if len(shown) < len(result.series) else ""
    console.print(
        f"{len(result.images)} plot(s) in {escape(str(result.html.parent / 'report'))}/, all in {escape(str(result.html))}{more}",
        highlight=False,
    )
