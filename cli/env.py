"""`composer env`: health checks of the coding environments and the sandbox."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe

app = typer.Typer(help="Coding environments: tasks, sandbox, rewards.", no_args_is_help=True)
console = Console()


@app.command()
def check(
    file: Path = typer.Argument(..., help="Recipe file with an `env` section."),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a key: --set env.reward=fraction (value parsed as YAML). Repeatable."
    ),
    max_tasks: int = typer.Option(50, "--max-tasks", min=0, help="Check the first N tasks of each task set; 0 checks all."),
    workers: int = typer.Option(2, "--workers", min=1, help="Sandboxes run at once."),
) -> None:
    """Run each task set's reference solutions against their hidden tests in the sandbox; report pass rates. Repository
    task sets: each built task's original must pass its expected tests, its change fail its fail-to-pass tests."""
    from composer.rollout.agent.environment import CodingEnvironment, check_references

    recipe = load_recipe(file, overrides)
    if recipe.env is None:
        raise UserError(f"{file}: the recipe has no `env` section to check")
    env = CodingEnvironment(recipe.env, seed=recipe.train.seed, ssh=recipe.cluster.ssh)
    try:
        network = recipe.env.sandbox.network
        for host, iso in env.sandbox.isolations.items():
            kinds = (["mount", "PID"] if iso.dedicated_uid else ["user"]) + ([] if network else ["network"]) if iso.namespaces else []
            namespaces = f"{', '.join(kinds[:-1])} and {kinds[-1]} namespaces" if len(kinds) > 1 else "no namespaces"
            own_root = ", a root of its own" if iso.dedicated_uid and iso.namespaces else ", the host's filesystem"
            where = "" if list(env.sandbox.isolations) == ["localhost"] else f" on {host} ({env.sandbox.capacities[host]} at once)"
            console.print(
                f"sandbox{escape(where)}: {'a dedicated uid per run' if iso.dedicated_uid else 'the caller uid'}, {namespaces}{own_root}"
                f"{', network allowed' if network else ''}",
                highlight=False,
            )
        limit = max_tasks or None
        repo_sets = [ts for ts in env.pool.task_sets if ts.name == "repo"]
        total = sum(len(env.pool.indices(i)[:limit]) for i, ts in enumerate(env.pool.task_sets) if ts.name != "repo")
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task("reference solutions", total=total)
            reports = check_references(env, limit, workers, on_task=lambda _: progress.advance(bar))
    finally:
        env.close()

    if not reports:
        failed = sum(_check_repo(ts, recipe.env.sandbox, env.sandbox.root, limit, workers) for ts in repo_sets)
        if failed:
            raise UserError(f"{failed} repository task(s) failed their checks")
        return
    table = Table(title="reference solutions in the sandbox")
    for column in ("task set", "checked", "passed", "failed", "skipped", "pass rate", "mean wall s"):
        table.add_column(column, justify="left" if column == "task set" else "right")
    for r in reports:
        rate = f"{r.passed / r.checked:.1%}" if r.checked else "-"
        mean = f"{r.wall_seconds / r.checked:.3f}" if r.checked else "-"
        table.add_row(r.task_set, str(r.checked), str(r.passed), str(len(r.failures)), str(r.skipped), rate, mean)
    console.print(table)
    for r in reports:
        if r.checked:
            console.print(
                f"{r.task_set}: {r.all_calls}/{r.checked} task(s) fully protected (every case a (call, expected) "
                f"pair judged outside the sandbox); {len(r.by_statements)} with cases judged by their own test "
                "statements, also outside the sandbox",
                highlight=False,
            )
        by_reason: dict[str, list[str]] = {}
        for task_id, reason in r.by_statements:
            by_reason.setdefault(reason, []).append(task_id)
        for reason, ids in by_reason.items():
            shown = ", ".join(ids[:12]) + (f" and {len(ids) - 12} more" if len(ids) > 12 else "")
            console.print(f"[dim]  {escape(reason)}: {escape(shown)}[/]", highlight=False)
    for r in reports:
        if r.skipped:
            console.print(
                f"[dim]{r.task_set}: {r.skipped} task(s) skipped: their reference program fails on its own inputs or does not reproduce its outputs[/]"
            )
        for task_id, result in r.failures:
            flags = f", flags: {escape('; '.join(result.flag_details))}" if result.flags else ""
            console.print(
                f"[red]✗[/] {escape(task_id)}: {result.status} {escape(result.detail)}, {result.passed}/{result.total} tests{flags}",
                highlight=False,
            )
    failed = sum(len(r.failures) for r in reports)
    failed += sum(_check_repo(ts, recipe.env.sandbox, env.sandbox.root, limit, workers) for ts in repo_sets)
    if failed:
        raise UserError(f"{failed} reference solution(s) or repository task(s) failed their checks")


def _check_repo(task_set, sandbox, sandbox_root: Path, limit: int | None, workers: int) -> int:
    """Test each built repository task again: its original passes, its change fails as recorded; the failures."""
    from composer.rollout.tasks.repository.task_set import check_repo_tasks, load_tasks

    total = len(load_tasks(task_set.repo)[:limit])
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task("repository tasks: originals and changes", total=total)
        report = check_repo_tasks(task_set.repo, sandbox, sandbox_root, limit, workers, on_task=lambda: progress.advance(bar))
    console.print(
        f"repo: {report.checked} task(s) checked: originals passing every expected test "
        f"{report.originals_passing}/{report.checked}, changed failing every fail-to-pass test (pass-to-pass "
        f"passing) {report.changed_failing}/{report.checked}",
        highlight=False,
    )
    for task_id, why in report.failures:
        console.print(f"[red]✗[/] {escape(task_id)}: {escape(why)}", highlight=False)
    return len(report.failures)


@app.command()
def build(
    file: Path = typer.Argument(..., help="Recipe file whose `env.tasks` has a `repo` task set."),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a key: --set env.tasks.0.repo.num_tasks=50 (value parsed as YAML). Repeatable."
    ),
    workers: int = typer.Option(
        2,
        "--workers",
        min=1,
        help="Processes validating tasks at once here (with localhost among env.sandbox.hosts; remote hosts run sandboxes_per_host each).",
    ),
) -> None:
    """Build the recipe's repository task sets: seeded changes of real projects, each validated against the project's
    own tests (the original passes, the change fails). Cached; an interrupted build resumes where it stopped."""
    from composer.rollout.sandbox.isolation import DEFAULT_ROOT
    from composer.rollout.tasks.repository.build import build_counts, build_repo_tasks, set_dir

    recipe = load_recipe(file, overrides)
    sets = [(i, ts) for i, ts in enumerate(recipe.env.tasks if recipe.env else []) if ts.name == "repo"]
    if not sets:
        raise UserError(f"{file}: env.tasks has no `repo` task set to build")
    for index, ts in sets:
        settings = ts.repo
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task("validated repo tasks", total=settings.num_tasks)

            def show(report) -> None:
                progress.update(
                    bar,
                    completed=report.validated,
                    description=f"validated repo tasks ({report.tried} tried, {sum(report.rejected.values())} rejected)",
                )

            try:
                report = build_repo_tasks(settings, recipe.env.sandbox, DEFAULT_ROOT, workers, on_progress=show, ssh=recipe.cluster.ssh)
            except UserError as error:  # a project's key, with the task set's index only this loop knows
                raise UserError(str(error).replace("env.tasks[]", f"env.tasks[{index}]", 1)) from None
        table = Table(title="repository tasks")
        for column in ("project", "kind", "tried", "validated", "rejected"):
            table.add_column(column, justify="left" if column in ("project", "kind") else "right")
        counts = build_counts(report)
        for row in counts:
            table.add_row(row["project"], row["kind"], str(row["tried"]), str(row["validated"]), str(sum(row["rejected"].values())))
        console.print(table)
        console.print(
            f"{report.validated} validated of {report.tried} candidates tried ({report.resumed} verdicts from the "
            f"cache) in {report.seconds:.0f} s; the set: {set_dir(settings)}",
            highlight=False,
        )
        for row in counts:
            for reason, count in row["rejected"].items():
                console.print(f"[dim]  rejected ({escape(row['project'])} {row['kind']}): {escape(reason)}: {count}[/]", highlight=False)
        if set(report.host_runs) - {"localhost"}:
            runs = ", ".join(f"{host} {count}" for host, count in sorted(report.host_runs.items()))
            console.print(f"surveys and validations by sandbox host: {escape(runs)}", highlight=False)
        if report.validated < settings.num_tasks:
            raise UserError(
                f"only {report.validated} of num_tasks {settings.num_tasks} candidates validated: every candidate "
                "was tried; widen `projects`, `kinds` or `include`"
            )


@app.command()
def show(
    file: Path = typer.Argument(..., help="Recipe file whose `env.tasks` has a built `repo` task set."),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a key (value parsed as YAML). Repeatable."),
) -> None:
    """List the built repository tasks of the recipe, by project and kind, with where each comes from: the commit of
    a history task, the function and seeded change of the others."""
    from composer.rollout.tasks.repository.task_set import load_tasks

    recipe = load_recipe(file, overrides)
    sets = [(i, ts) for i, ts in enumerate(recipe.env.tasks if recipe.env else []) if ts.name == "repo"]
    if not sets:
        raise UserError(f"{file}: env.tasks has no `repo` task set to show")
    for index, ts in sets:
        tasks = sorted(load_tasks(ts.repo), key=lambda t: (t["project"], t["kind"]))
        table = Table(title=f"env.tasks[{index}]: {len(tasks)} repository task(s)")
        for column in ("project", "kind", "id", "origin", "fail-to-pass"):
            table.add_column(column, justify="right" if column == "fail-to-pass" else "left")
        for t in tasks:
            if t["kind"] == "history":
                origin = f"commit {t['base'][:12]}"
            else:
                origin = f"{t['path']}: {t['function']}: {t['description']}"
            table.add_row(t["project"], t["kind"], escape(t["id"]), escape(origin), str(len(t["fail_to_pass"])))
        console.print(table)
