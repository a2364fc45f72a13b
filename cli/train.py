"""`composer train`: mid-training and RL runs from recipes."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from composer.cluster.plan import check_fits
from composer.recipes.env_schema import slurm_server_names
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe, recipe_to_yaml
from composer.runtime.run_dir import RunDir

app = typer.Typer(help="Train from a recipe: mid-training and SFT with Megatron-Core, RL with vLLM rollouts.", no_args_is_help=True)
console = Console(soft_wrap=True)

SetOption = typer.Option([], "--set", "-s", help="Override a key: --set train.steps=10 (value parsed as YAML). Repeatable.")
DryRunOption = typer.Option(False, "--dry-run", help="Print the launch plan (hosts, ranks, parallel groups, commands) and exit.")
SubmitOption = typer.Option(
    False, "--submit", help="cluster.launcher slurm: write an sbatch script into the run directory, submit it, print the job id."
)


def _dry_run(kind: str, recipe, launcher, module: str, args: list[str], resume: bool) -> None:
    from composer.cli.cluster import print_plan
    from composer.cluster.slurm import SlurmLauncher, batch_script, in_allocation

    print_plan(launcher.plan(module, args, recipe.run.name), recipe.parallelism, recipe.cluster.world_size, console)
    if isinstance(launcher, SlurmLauncher) and not in_allocation():
        console.print("[bold]sbatch script[/] (--submit):", highlight=False)
        console.print(escape(batch_script(launcher, kind, RunDir.of(recipe), resume)), highlight=False)


def _submit(kind: str, recipe, run: RunDir, resume: bool) -> None:
    from composer.cluster.launchers import build_launcher
    from composer.cluster.slurm import SlurmLauncher, submit

    launcher = build_launcher(recipe.cluster)
    if not isinstance(launcher, SlurmLauncher):
        raise UserError(f"--submit needs cluster.launcher: slurm (the recipe says {recipe.cluster.launcher})")
    if not resume and run.metrics_path.exists():
        raise UserError(f"{run.root} already holds a run; pass --resume to continue it, or choose another run.name")
    job_id, script = submit(launcher, kind, recipe_to_yaml(recipe), run, resume)
    console.print(
        f"submitted SLURM job {job_id} ({escape(str(script))}); its output: {escape(str(run.root / 'slurm'))}/job-{job_id}.out",
        highlight=False,
    )


def _train(kind: str, recipe, loop, resume: bool, dry_run: bool, submit: bool, prepare) -> RunDir | None:
    """What mid-training and SFT share: the loop's recipe check, --dry-run, the resume check, --submit, then
    `prepare(run)` (before the run directory is written; it returns what to write into it) and the ranks to the end.
    Returns the finished run (None for --dry-run and --submit)."""
    from composer.cluster.launch import run_to_end
    from composer.cluster.launchers import build_launcher

    loop.check_recipe(recipe)
    run = RunDir.of(recipe)
    args = ["train", str(run.root), *(["--resume"] if resume else [])]
    launcher = build_launcher(recipe.cluster)
    if dry_run:
        _dry_run(kind, recipe, launcher, loop.MODULE, args, resume)
        return None
    if resume:
        loop.check_resume(run, recipe)  # before the run's recipe.yaml is replaced
    if submit:
        _submit(kind, recipe, run, resume)
        return None
    launcher.check_startable()
    write = prepare(run)
    run.prepare(recipe_to_yaml(recipe), resume)
    with run.failures_recorded():
        write(run.root)
        run_to_end(launcher.start(loop.MODULE, args, run, console))
    return run


@app.command()
def midtrain(
    recipe_file: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file with a data section."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its newest checkpoint."),
    dry_run: bool = DryRunOption,
    submit: bool = SubmitOption,
    overrides: list[str] = SetOption,
) -> None:
    """Continued pre-training: prepare the corpus (cached), train, checkpoint, evaluate, export an HF checkpoint."""
    recipe = load_recipe(recipe_file, overrides)
    check_fits(recipe)
    # torch is imported from here on; `composer --help` stays fast
    from composer.trainer import midtrain as midtrain_loop

    def prepare(run: RunDir):
        from composer.data.prepare import prepare_data

        def write(root: Path) -> None:
            # inside the run's failure record: a corpus that cannot be prepared is the run's failure
            prepared = prepare_data(
                recipe.data, model_checkpoint=recipe.model.checkpoint, model_vocab_size=recipe.model.vocab_size, console=console
            )
            prepared.for_training().write(root)

        return write

    run = _train("midtrain", recipe, midtrain_loop, resume, dry_run, submit, prepare)
    if run is not None:
        console.print(f"[green]✓[/] run {escape(str(run.root))}: metrics.jsonl, tensorboard/, checkpoints/, export/", highlight=False)


@app.command()
def sft(
    recipe_file: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file with an sft section."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its newest checkpoint (same conversations, same order)."),
    dry_run: bool = DryRunOption,
    submit: bool = SubmitOption,
    overrides: list[str] = SetOption,
) -> None:
    """Supervised fine-tuning on agent conversations in the harness's format: render, train, evaluate, export."""
    recipe = load_recipe(recipe_file, overrides)
    check_fits(recipe)
    from composer.trainer import sft as sft_loop

    def prepare(run: RunDir):
        from composer.rl.sft_data import prepare_sft_examples
        from composer.runtime.sft_examples import SftExamples

        # a resumed run keeps the conversations it started with; a fresh one renders them all before writing anything
        examples = None if resume and SftExamples.exists(run.root) else prepare_sft_examples(recipe, console)
        return examples.write if examples is not None else lambda root: None

    run = _train("sft", recipe, sft_loop, resume, dry_run, submit, prepare)
    if run is not None:
        console.print(f"[green]✓[/] run {escape(str(run.root))}: metrics.jsonl, sft-examples/, checkpoints/, export/", highlight=False)


@app.command()
def rl(
    recipe_file: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file with rollout, env and rl sections."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run after a stop or crash."),
    replay: Path | None = typer.Option(
        None,
        "--replay",
        metavar="RUN_DIR",
        help="Train the learner on RUN_DIR's recorded trajectory groups, step by step as that run did; no engines.",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print a line per trajectory group."),
    dry_run: bool = DryRunOption,
    submit: bool = SubmitOption,
    overrides: list[str] = SetOption,
) -> None:
    """Asynchronous RL: vLLM rollouts in sandboxed coding tasks, Megatron learner, delta weight sync."""
    from composer.rl.driver import check_rl_recipe, learner_launch, run_rl

    recipe = load_recipe(recipe_file, overrides)
    check_fits(recipe)
    if dry_run:
        check_rl_recipe(recipe)
        from composer.cli.cluster import print_rollout_plan
        from composer.rl.rollout_hosts import rollout_plan

        p = recipe.rollout.parallelism
        console.print(
            f"rollout hosts: {', '.join(recipe.rollout.hosts)} ({recipe.rollout.engine}, "
            f"{recipe.rollout.engines_per_host} engine(s) per host, each tp {p.tp} x pp {p.pp} x dp {p.dp}"
            f"{f', expert parallel over {p.ep}' if p.enable_expert_parallel else ''})",
            highlight=False,
        )
        print_rollout_plan(rollout_plan(recipe), recipe.rollout.engine, console)
        sandbox = recipe.env.sandbox  # check_rl_recipe: an RL recipe has an env
        slurm_servers = slurm_server_names(sandbox.slurm.servers) if sandbox.slurm else []
        console.print(
            f"sandbox hosts: {', '.join([*sandbox.hosts, *slurm_servers])} ({sandbox.sandboxes_per_host or 'CPU count'} sandboxes per host"
            f"{'; slurm-* are started as SLURM job steps' if slurm_servers else ''}); the learner:",
            highlight=False,
        )
        _dry_run("rl", recipe, *learner_launch(recipe), resume)
        return
    if submit:
        if replay is not None:
            raise UserError("--submit runs rollouts in the allocation; replay a run with --replay outside --submit")
        check_rl_recipe(recipe)
        _submit("rl", recipe, RunDir.of(recipe), resume)
        return
    root = run_rl(recipe, resume, replay=replay, verbose=verbose)
    console.print(
        f"[green]✓[/] run {escape(str(root))}: metrics.jsonl, rollout_metrics.jsonl, trajectories/, checkpoints/", highlight=False
    )
