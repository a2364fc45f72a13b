"""`composer cluster`: the training hosts of a recipe, checked before anything launches; launch plans."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from composer.recipes.loader import load_recipe
from composer.runtime.run_dir import RunDir

app = typer.Typer(help="Training hosts: check them before a run, see how a run reaches them.", no_args_is_help=True)
console = Console(soft_wrap=True)


@app.command()
def check(
    recipe_file: Path = typer.Argument(..., metavar="RECIPE", help="Recipe whose `cluster` section to check."),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a key: --set cluster.rdzv_port=29500. Repeatable."),
) -> None:
    """Per training host: reachable, same composer/torch/megatron-core/vLLM, GPUs or CPU, free disk in run.dir,
    clock skew, rendezvous port free, run.dir shared. Exit 2 on any problem."""
    from composer.cluster.check import PACKAGES, check_cluster

    recipe = load_recipe(recipe_file, overrides)
    run_dir = RunDir.of(recipe).root
    reports = check_cluster(recipe.cluster, run_dir)
    table = Table(title=f"cluster check: {len(reports)} host(s), launcher {recipe.cluster.launcher}, run.dir {run_dir}")
    for column in ("host", *PACKAGES, "devices", "free GiB", "clock skew s", "problems"):
        table.add_column(column, overflow="fold")
    for r in reports:
        f = r.facts
        if f is None:
            table.add_row(escape(r.host), *["-"] * (len(PACKAGES) + 3), f"[red]{escape('; '.join(r.problems))}[/]")
            continue
        devices = f"{len(f['gpus'])} GPU ({escape(f['gpus'][0][0])}, {f['gpus'][0][1]} MiB)" if f["gpus"] else f"CPU x{f['cpus']}"
        verdict = f"[red]{escape('; '.join(r.problems))}[/]" if r.problems else "[green]ok[/]"
        table.add_row(
            escape(r.host),
            *(escape(f["versions"].get(n) or "-") for n in PACKAGES),
            devices,
            f"{f['free_gib']:.1f}",
            f"{r.skew:+.3f}",
            verdict,
        )
    console.print(table)
    problems = sum(len(r.problems) for r in reports)
    if problems:
        console.print(f"[bold red]{problems} problem(s)[/]; fix them before launching")
        raise typer.Exit(2)
    console.print("[green]✓[/] every host is ready")


def print_plan(plan, parallelism, world_size: int, out: Console) -> None:
    """A launch plan for --dry-run: hosts, node ranks, ranks, the command each host runs, and the parallel groups."""
    from composer.cluster.groups import describe_group, parallel_groups

    out.print(
        f"[bold]launch plan[/]: launcher {plan.launcher}, {len(plan.hosts)} host(s), world size {world_size}, "
        f"rendezvous {escape(plan.rendezvous)}",
        highlight=False,
    )
    hosts = Table(show_lines=False)
    for column in ("host", "node rank", "ranks", "command"):
        hosts.add_column(column, overflow="fold")
    for h in plan.hosts:
        hosts.add_row(escape(h.host), str(h.node_rank), f"{h.ranks.start}-{h.ranks.stop - 1}", escape(h.shell()))
    out.print(hosts)
    for note in plan.notes:
        out.print(escape(note), highlight=False)
    groups = Table(title="parallel groups (global ranks, as Megatron-Core's parallel_state builds them)")
    for column in ("group", "size", "count", "ranks"):
        groups.add_column(column, overflow="fold")
    names = {
        "tp": "tensor (TP)",
        "cp": "context (CP)",
        "pp": "pipeline (PP)",
        "dp": "data (DP)",
        "ep": "expert (EP)",
        "etp": "expert tensor (ETP)",
        "edp": "expert data (EDP)",
    }
    trivial = []
    for kind, members in parallel_groups(parallelism, world_size).items():
        if len(members[0]) == 1:
            trivial.append(kind)
            continue
        groups.add_row(names[kind], str(len(members[0])), str(len(members)), "  ".join(describe_group(g) for g in members))
    out.print(groups)
    if trivial:
        out.print(f"[dim]groups of one rank each: {', '.join(names[k] for k in trivial)}[/]", highlight=False)


def print_rollout_plan(plan, engine_kind: str, out: Console) -> None:
    """Per rollout host for --dry-run: which devices each learner rank and each engine rank gets, and the commands
    that start the engines."""
    from composer.cluster.placement import describe_devices

    table = Table(title="rollout placement (devices per rank; engines' environment and command)")
    for column in ("host", "devices", "learner ranks", "engine", "ranks", "command"):
        table.add_column(column, overflow="fold")
    for host, placement, commands in plan:
        if placement is None:
            table.add_row(escape(host), "found at start (no rollout.devices)", "-", "-", "-", "-")
            continue
        d = placement.devices
        devices = f"{len(d.ids)} {d.unit}s {describe_devices(d.ids)}, {d.memory_gib:.0f} GiB{' each' if d.kind == 'gpu' else ''}"
        learner = " ".join(f"{i}:{describe_devices(r)}" for i, r in enumerate(placement.learner)) or "-"
        if placement.learner_shares:
            learner += " (shared with the engines)"
        for engine, command in zip(placement.engines, commands):
            where = f"{engine.number}" + (f" (host {engine.node_rank + 1} of {engine.nodes})" if engine.nodes > 1 else "")
            ranks = " ".join(f"{i}:{describe_devices(r)}" for i, r in enumerate(engine.ranks))
            if engine_kind == "embedded":
                single_cpu_rank = len(engine.ranks) == 1 and engine.kind == "cpu"
                command = (
                    "in the driver's process (a single CPU rank is not bound)"
                    if single_cpu_rank
                    else f"in the driver's process, with {' '.join(f'{k}={v}' for k, v in engine.env().items())}"
                )
            table.add_row(escape(host), devices, learner, escape(where), ranks, escape(command))
            devices = learner = ""
        if placement.front_end:
            table.add_row("", "", "", "front ends", describe_devices(placement.front_end), "")
    out.print(table)
