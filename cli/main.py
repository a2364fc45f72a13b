"""The `composer` command: one Typer sub-app per command group, user errors without tracebacks."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

import typer
from rich.console import Console
from rich.markup import escape

from composer.cli import cluster as cluster_cmd
from composer.cli import data as data_cmd
from composer.cli import env as env_cmd
from composer.cli import eval as eval_cmd
from composer.cli import export as export_cmd
from composer.cli import model as model_cmd
from composer.cli import plan as plan_cmd
from composer.cli import recipe as recipe_cmd
from composer.cli import report as report_cmd
from composer.cli import runs as runs_cmd
from composer.cli import sync as sync_cmd
from composer.cli import train as train_cmd
from composer.recipes.errors import UserError

app = typer.Typer(
    name="composer",
    help="Train agentic coding MoE models: Megatron-Core mid-training, async RL with vLLM, delta weight sync.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(recipe_cmd.app, name="recipe")
app.add_typer(model_cmd.app, name="model")
app.add_typer(data_cmd.app, name="data")
app.command("report")(report_cmd.report)
app.command("runs")(runs_cmd.runs)
app.command("eval")(eval_cmd.eval_command)
app.command("plan")(plan_cmd.plan)
app.add_typer(train_cmd.app, name="train")
app.add_typer(export_cmd.app, name="export")
app.add_typer(sync_cmd.app, name="sync")
app.add_typer(env_cmd.app, name="env")
app.add_typer(cluster_cmd.app, name="cluster")

err_console = Console(stderr=True, soft_wrap=True)
_debug = False


def _version() -> str:
    try:
        return version("composer-train")
    except PackageNotFoundError:
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"composer {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True, callback=_print_version),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    global _debug
    _debug = debug


def main() -> None:
    try:
        app()
    except UserError as e:
        if _debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(130)
