"""`composer train`: training runs launched under torchrun on this host."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from recipes.loader import load_recipe, recipe_to_yaml
from recipes.runs import RunDir

app = typer.Typer(help="Train: mid-training with Megatron-Core.", no_args_is_help=True)
console = Console()
err_console = Console(stderr=True)

SetOption = typer.Option([], "--set", "-s", help="Override a key: --set train.steps=10 (value parsed as YAML). Repeatable.")


@app.command()
def midtrain(
    recipe_file: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file with a data section."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its newest checkpoint."),
    overrides: list[str] = SetOption,
) -> None:
    """Continued pre-training: tokenize the corpus, train, checkpoint, evaluate, export an HF checkpoint."""
    recipe = load_recipe(recipe_file, overrides)
    # torch is imported from here on; `composer --help` stays fast
    from trainer.launch import RanksFailed, launch_ranks
    from trainer.midtrain import check_midtrain_recipe, check_resume

    check_midtrain_recipe(recipe)
    run = RunDir.of(recipe)
    if resume:
        check_resume(run, recipe)  # before the run's recipe.yaml is replaced
    run.prepare(recipe_to_yaml(recipe), resume)
    args = ["train", str(run.root), *(["--resume"] if resume else [])]
    try:
        launch_ranks(run, recipe.cluster.procs_per_host, "trainer.midtrain", args)
    except RanksFailed as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}\n{escape(e.tail)}", highlight=False)
        raise typer.Exit(1) from None
    console.print(f"[green]✓[/] run {escape(str(run.root))}: metrics.jsonl, tensorboard/, checkpoints/, export/", highlight=False)
