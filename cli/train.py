"""`composer train`: mid-training and RL runs from recipes."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from recipes.loader import load_recipe, recipe_to_yaml
from recipes.runs import RunDir

app = typer.Typer(help="Train from a recipe: mid-training with Megatron-Core, RL with vLLM rollouts.", no_args_is_help=True)
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

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
    from trainer import midtrain
    from trainer.launch import RanksFailed, launch_ranks

    midtrain.check_midtrain_recipe(recipe)
    run = RunDir.of(recipe)
    if resume:
        midtrain.check_resume(run, recipe)  # before the run's recipe.yaml is replaced
    run.prepare(recipe_to_yaml(recipe), resume)
    args = ["train", str(run.root), *(["--resume"] if resume else [])]
    try:
        launch_ranks(run, recipe.cluster.procs_per_host, midtrain.MODULE, args)
    except RanksFailed as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}\n{escape(e.tail)}", highlight=False)
        raise typer.Exit(1) from None
    console.print(f"[green]✓[/] run {escape(str(run.root))}: metrics.jsonl, tensorboard/, checkpoints/, export/", highlight=False)


@app.command()
def rl(
    recipe_file: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file with rollout, env and rl sections."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run after a stop or crash."),
    replay: Path | None = typer.Option(None, "--replay", metavar="RUN_DIR",
                                       help="Train the learner on RUN_DIR's recorded trajectory groups, step by step as that run did; no engines."),
    overrides: list[str] = SetOption,
) -> None:
    """Asynchronous RL: vLLM rollouts in sandboxed coding tasks, Megatron learner, delta weight sync."""
    from rl.driver import run_rl

    root = run_rl(load_recipe(recipe_file, overrides), resume, console, replay=replay)
    console.print(f"[green]✓[/] run {escape(str(root))}: metrics.jsonl, rollout_metrics.jsonl, trajectories/, checkpoints/", highlight=False)
