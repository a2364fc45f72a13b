"""`composer train`: mid-training and RL runs from recipes."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from recipes.loader import load_recipe

app = typer.Typer(help="Run training from a recipe.", no_args_is_help=True)
console = Console(soft_wrap=True)

SetOption = typer.Option([], "--set", "-s", help="Override a recipe key: --set train.steps=10. Repeatable.")
ResumeOption = typer.Option(False, "--resume", help="Continue the run in the recipe's run directory after a stop or crash.")


@app.command()
def rl(recipe_file: Path = typer.Argument(..., help="RL recipe."), overrides: list[str] = SetOption, resume: bool = ResumeOption) -> None:
    """Asynchronous RL: vLLM rollouts in sandboxed coding tasks, Megatron learner, delta weight sync."""
    from rl.driver import run_rl

    root = run_rl(load_recipe(recipe_file, overrides), resume, console)
    console.print(f"[green]done[/]: {root} (metrics.jsonl, rollout_metrics.jsonl; `composer report {root}`)")
