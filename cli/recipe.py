"""`composer recipe`: validate, show and describe recipes."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from composer.cluster.plan import check_fits
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe, recipe_to_yaml
from composer.recipes.schema import Recipe

app = typer.Typer(help="Validate, show and describe recipes.", no_args_is_help=True)
console = Console(soft_wrap=True)

SetOption = typer.Option([], "--set", "-s", help="Override a key: --set train.steps=10 (value parsed as YAML). Repeatable.")


@app.command()
def validate(
    files: list[Path] = typer.Argument(..., help="Recipe files."),
    overrides: list[str] = SetOption,
) -> None:
    """Check recipes against the schema, the cross-field rules and the memory plan (with cluster.device_memory_gib),
    and a model.checkpoint this machine can read against the recipe (its config.json and tensor files); report every
    problem at once."""
    failed = 0
    for file in files:
        try:
            recipe = load_recipe(file, overrides)
            _check_checkpoint(recipe)
        except UserError as e:
            failed += 1
            console.print(f"[red]✗[/] {escape(str(e))}", highlight=False)
            continue
        try:
            check_fits(recipe)
        except UserError as e:
            failed += 1
            console.print(f"[red]✗[/] {escape(str(file))}: {escape(str(e))}", highlight=False)
            continue
        kind = "rl" if recipe.rl else "sft" if recipe.sft else "midtrain" if recipe.data else "model"
        console.print(f"[green]✓[/] {escape(str(file))} [dim]({kind}, world size {recipe.cluster.world_size})[/]", highlight=False)
    if failed:
        raise UserError(f"{failed} of {len(files)} recipe(s) invalid")


def _check_checkpoint(recipe: Recipe) -> None:
    checkpoint = recipe.model.checkpoint
    if checkpoint and (Path(checkpoint) / "config.json").is_file():
        from composer.rollout.agent.harness import check_tokenizer_code
        from composer.trainer.weights import check_checkpoint_before_launch  # torch: only when there is a checkpoint to read

        check_checkpoint_before_launch(recipe.model)
        if recipe.rl:
            check_tokenizer_code(checkpoint, recipe.model.trust_remote_code)  # the agent loop's tokenizer


@app.command()
def show(file: Path = typer.Argument(..., help="Recipe file."), overrides: list[str] = SetOption) -> None:
    """Print the fully resolved recipe (extends merged, overrides applied, defaults filled in)."""
    typer.echo(recipe_to_yaml(load_recipe(file, overrides)), nl=False)


@app.command()
def schema() -> None:
    """Print the recipe JSON Schema (for editor completion and validation)."""
    typer.echo(json.dumps(Recipe.model_json_schema(), indent=2))
