"""`composer plan RECIPE`: memory per rank and per rollout engine, FLOPs and step time, layouts that fit."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from composer.recipes.loader import load_recipe

console = Console(soft_wrap=True)


def plan(
    recipe_file: Path = typer.Argument(..., metavar="RECIPE", help="Recipe to plan."),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a key: --set parallelism.tp=4. Repeatable."),
    mfu: float = typer.Option(
        0.35, "--mfu", min=0.01, max=1.0, help="Model FLOPs utilisation the step time assumes (with cluster.device_tflops)."
    ),
    measured: Path | None = typer.Option(
        None, "--measured", metavar="RUN_DIR", help="Take step, learner and rollout times from a run's metrics."
    ),
    generated_tokens_per_s: float | None = typer.Option(
        None, "--generated-tokens-per-s", min=0.0, help="RL: tokens/s of one engine generating a group."
    ),
    grade_seconds: float | None = typer.Option(
        None, "--grade-seconds", min=0.0, help="RL: seconds to grade an episode (a group's at once)."
    ),
    generated_tokens: float | None = typer.Option(None, "--generated-tokens", min=1.0, help="RL: generated tokens per episode."),
    episode_tokens: float | None = typer.Option(
        None, "--episode-tokens", min=1.0, help="RL: trained tokens per episode (default: rollout.max_context, the bound)."
    ),
) -> None:
    """Per rank: parameters, gradients, optimizer state, activations; per rollout engine: weights and KV cache; FLOPs
    and step time; RL's synchronous vs asynchronous step; the layouts of the same world size that fit. Exit 2 when
    the recipe does not fit."""
    from composer.cluster.plan import GIB, Rates, fit_problems, layouts_that_fit, make_plan, measured_rates

    recipe = load_recipe(recipe_file, overrides)
    rates = measured_rates(measured) if measured else Rates(generated_tokens_per_s, grade_seconds, generated_tokens, episode_tokens)
    result = make_plan(recipe, mfu=mfu, rates=rates)
    p, c, t, rank = result.layout, recipe.cluster, recipe.train, result.rank
    dp = c.world_size // (p.tp * p.pp * p.cp)
    console.print(
        f"[bold]plan[/] {escape(recipe.run.name)}: world size {c.world_size} = tp {p.tp} x pp {p.pp} x cp {p.cp} x dp {dp}; "
        f"ep {p.ep}, etp {p.etp}; sequence parallel {p.sequence_parallel}, distributed optimizer {p.distributed_optimizer}, "
        f"recompute {t.recompute_activations}; {recipe.model.dtype}",
        highlight=False,
    )
    table = Table(title=f"memory per rank (the most loaded), {result.tokens_per_micro_batch} tokens per micro-batch per rank")
    table.add_column("")
    table.add_column("GiB", justify="right")
    other = "off" if t.recompute_activations else "on"
    optimizer = "Muon + Adam" if recipe.optim.name == "muon" else "Adam"
    rows = [
        ("parameters", rank.parameters),
        ("gradients (fp32 buffers)", rank.gradients),
        (f"optimizer state ({optimizer})", rank.optimizer),
        ("activations", rank.activations),
        (f"  (with recompute {other})", rank.activations_other),
    ]
    if rank.reference:
        rows.append(("reference policy (rl.kl_coeff)", rank.reference))
    for name, value in rows + [("total", rank.total)]:
        table.add_row(name, f"{value / GIB:.2f}")
    if result.device_bytes is not None:
        verdict = "[green]fits[/]" if result.fits else "[red]does not fit[/]"
        table.add_row(f"usable of cluster.device_memory_gib={c.device_memory_gib}", f"{result.device_bytes / GIB:.2f}  {verdict}")
    console.print(table)
    if result.engine is not None:
        e, r = result.engine, recipe.rollout
        console.print(
            f"rollout engine, per device (tp {r.parallelism.tp} x pp {r.parallelism.pp} x dp {r.parallelism.dp}): weights "
            f"{e.weights / GIB:.2f} GiB ({r.dtype}), KV cache "
            f"{e.kv_per_sequence / GIB:.3f} GiB per rollout.max_context={r.max_context} sequence; kv_cache_gib={r.kv_cache_gib} "
            f"holds {e.sequences}",
            highlight=False,
        )
    speed = f"step {result.step_seconds:.1f} s" if result.step_seconds is not None else "step time: set cluster.device_tflops or --measured"
    how = "measured" if measured else f"at MFU {mfu} on {c.world_size} x {c.device_tflops} TFLOP/s" if c.device_tflops else ""
    console.print(
        f"compute: {result.tokens_per_step} tokens per step, {result.flops_per_step / 1e15:.1f} PFLOP per step (model FLOPs); "
        f"{speed} {how}",
        highlight=False,
    )
    if result.rl is not None:
        rl = result.rl
        console.print(
            f"RL: rollouts {rl.rollout_seconds:.1f} s, learner {rl.train_seconds:.1f} s per step: synchronous {rl.sync_seconds:.1f} s, "
            f"asynchronous {rl.async_seconds:.1f} s (x{rl.sync_seconds / rl.async_seconds:.2f})",
            highlight=False,
        )
    elif recipe.rl is not None:
        console.print(
            "RL: give --generated-tokens-per-s and --grade-seconds (or --measured RUN) for synchronous vs asynchronous step time",
            highlight=False,
        )
    fitting = layouts_that_fit(recipe, mfu)
    layouts = Table(
        title=f"layouts of world size {c.world_size} that fit, best first" + ("" if c.device_memory_gib else " (no device memory set: all)")
    )
    for column in ("tp", "pp", "cp", "ep", "dp", "GiB per rank", "relative step time"):
        layouts.add_column(column, justify="right")
    for candidate, seconds in fitting[:10]:
        q = candidate.layout
        layouts.add_row(
            str(q.tp),
            str(q.pp),
            str(q.cp),
            str(q.ep),
            str(c.world_size // (q.tp * q.pp * q.cp)),
            f"{candidate.rank.total / GIB:.2f}",
            f"{seconds / fitting[0][1]:.2f}",
        )
    console.print(layouts)
    problems = fit_problems(recipe)
    for problem in problems:
        console.print(f"[red]✗[/] {escape(str(problem))}", highlight=False)
    if problems:
        raise typer.Exit(2)
