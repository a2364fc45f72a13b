"""`composer export RUN`: an HF checkpoint (for vLLM and `sync`) from a run's newest training checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.runtime.run_dir import RunDir

app = typer.Typer(help="Export a run's newest checkpoint as an HF checkpoint (safetensors, config.json, tokenizer).")
console = Console()


@app.callback(invoke_without_command=True, context_settings={"allow_interspersed_args": True})
def export(
    run_dir: Path = typer.Argument(..., metavar="RUN", help="Run directory (holds recipe.yaml and checkpoints/)."),
    out: Path = typer.Option(None, "--out", "-o", help="New directory for the HF checkpoint; RUN/export-step-N when unset."),
) -> None:
    """Export a run's newest checkpoint as an HF checkpoint (safetensors, config.json, tokenizer)."""
    run = RunDir(run_dir)
    if not run.recipe_path.is_file():
        raise UserError(f"{run_dir}: not a run directory (no recipe.yaml)")
    recipe = load_recipe(run.recipe_path)
    from composer.cluster.launch import run_to_end
    from composer.cluster.launchers import build_launcher
    from composer.trainer import midtrain, sft
    from composer.trainer.checkpointing import Checkpointer

    latest = Checkpointer(run.checkpoints, recipe.train.keep_checkpoints).latest()
    if latest is None:
        raise UserError(f"{run_dir}: the run has no checkpoint yet")
    out = out or run.root / f"export-{latest.name}"
    if out.exists():
        raise UserError(f"{out}: already exists; export into a new directory")
    module = sft.MODULE if recipe.sft else midtrain.MODULE
    run_to_end(build_launcher(recipe.cluster).start(module, ["export", str(run.root), str(out.absolute())], run, console))
    console.print(f"[green]✓[/] {escape(str(out))} [dim](from {escape(latest.name)})[/]", highlight=False)
