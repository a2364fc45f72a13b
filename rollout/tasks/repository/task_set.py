"""A built repository task set: its tasks loaded with their tests (`repo_tests`), an episode's workspace opened on
them, and `composer env check`'s second look at every task."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from composer.recipes.env_schema import RepoTaskSettings, SandboxSection
from composer.recipes.errors import UserError
from composer.rollout.sandbox.isolation import installed_copies
from composer.rollout.sandbox.results import RewardMode
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.boundary import crosses
from composer.rollout.tasks.repository.build import set_dir
from composer.rollout.tasks.repository.grading_policy import Scope
from composer.rollout.tasks.repository.projects import load_environment, resolve_project
from composer.rollout.tasks.repository.projects import project_bases as _bases_of
from composer.rollout.tasks.repository.surveys import grading_area, worker_sandbox
from composer.rollout.tasks.repository.workspace import RepoTests, RepoWorkspace, run_tests_across


def project_bases(cache_dir: Path, name: str) -> Path:
    """The bases of a ready-made project (`projects.project_bases` for any)."""
    return _bases_of(cache_dir, resolve_project(name, []))


def open_workspace(tests: RepoTests, sandbox: Sandbox, reward: RewardMode = "fraction") -> RepoWorkspace:
    """A fresh episode view of a repository task (close it when the episode ends)."""
    return RepoWorkspace(tests, sandbox, sandbox.root / "workspaces", reward)


# --- loading a built set -------------------------------------------------------------------------


def load_tasks(settings: RepoTaskSettings) -> list[dict]:
    """The validated tasks of a built set (its first num_tasks), each with its project's test setup (`setup`)."""
    index = set_dir(settings) / "tasks.json"
    if not index.is_file():
        raise UserError(f"env.tasks: the repo task set is not built yet (no {index}): run `composer env build RECIPE`")
    try:
        built = json.loads(index.read_text())
        tasks, projects = built["tasks"], built["projects"]
    except (ValueError, KeyError) as e:
        raise UserError(f"env.tasks: {index} is not a task index ({e}); rebuild it with `composer env build RECIPE`") from None
    return [{**t, "setup": projects[t["project"]]} for t in tasks[: settings.num_tasks]]


def repo_tests(record: dict, settings: RepoTaskSettings) -> RepoTests:
    """A built task's tests, as its workspaces run and grade them."""
    setup = record["setup"]
    if "scope" not in record:
        raise UserError(
            f"env.tasks: task {record['id']} was built by an older composer (its index names no scope); "
            "rebuild the tasks with `composer env build RECIPE`"
        )
    scope = tuple(Scope(path, tuple(functions)) for path, functions in record["scope"])
    if not crosses(scope):
        raise UserError(
            f"env.tasks: task {record['id']} was built by an older composer (its scope is whole files, graded in pytest's "
            "process, which grading no longer does); rebuild the tasks with `composer env build RECIPE`"
        )
    cache_dir = Path(settings.cache_dir).resolve()
    key = record["base"][:16] if record["base"] else record["version"] if setup["ready_made"] else setup["digest"]
    bases = cache_dir / "projects" / f"{record['project']}-{key}"
    environment = None
    if setup["environment"] is not None:
        built = load_environment(Path(setup["environment"]))
        if built is None:
            raise UserError(
                f"env.tasks: the environment of project {record['project']} ({setup['environment']}) is gone; "
                "rebuild it with `composer env build RECIPE`"
            )
        environment = built.run_environment()
    return RepoTests(
        packages=tuple(setup["packages"] if "packages" in setup else [setup["package"]]),  # or an index from before `packages`
        test_files=tuple(record["test_files"]),
        fail_to_pass=tuple(record["fail_to_pass"]),
        pass_to_pass=tuple(record["pass_to_pass"]),
        pytest_args=tuple(setup["pytest_args"]),
        layer=set_dir(settings) / record["layer"],
        episode_base=bases / "episode",
        grading_base=bases / "grading",
        hidden=installed_copies(record["project"]) if setup["ready_made"] else (),
        timeout_s=max(60.0, 4 * record["test_seconds"]),
        pass_to_pass_policy=settings.pass_to_pass,
        environment=environment,
        scope=scope,
    )


# --- checking a built set -------------------------------------------------------------------------


@dataclass
class RepoCheckReport:
    """`composer env check` on a repository task set: every task's original and changed files, tested again."""

    checked: int = 0
    originals_passing: int = 0
    """Tasks whose original passes every expected test."""
    changed_failing: int = 0
    """Tasks whose changed files fail every fail-to-pass test and pass every pass-to-pass test."""
    failures: list[tuple[str, str]] = field(default_factory=list)


def check_task(config: dict, sandbox_root: str, tests: RepoTests, paths: list[str]) -> tuple[bool, bool, str]:
    """(original passes, changed fails as recorded, why not) for one built task, across the grading boundary as it is
    graded (the episode's process holds the version tried)."""
    sandbox = worker_sandbox(config, sandbox_root)
    task_files = {path: (tests.layer / path).read_bytes() for path in paths}
    run = lambda changes: run_tests_across(sandbox, tests, changes, grading_area(sandbox))
    expected = (*tests.fail_to_pass, *tests.pass_to_pass)
    original = run({})
    original_ok = original.complete and not original.flags and all(original.outcomes.get(i) == "passed" for i in expected)
    changed = run(task_files)
    changed_ok = (
        changed.complete
        and not changed.flags
        and all(changed.outcomes.get(i) != "passed" for i in tests.fail_to_pass)
        and all(changed.outcomes.get(i) == "passed" for i in tests.pass_to_pass)
    )
    why = []
    if not original_ok:
        why.append(f"original: {original.detail or [i for i in expected if original.outcomes.get(i) != 'passed'][:3]}")
    if not changed_ok:
        why.append(f"changed: {changed.detail or 'outcomes differ from the recorded ones'}")
    return original_ok, changed_ok, "; ".join(why)


def check_repo_tasks(
    settings: RepoTaskSettings,
    sandbox: SandboxSection,
    sandbox_root: Path,
    max_tasks: int | None,
    workers: int,
    on_task: Callable[[], None] = lambda: None,
) -> RepoCheckReport:
    records = load_tasks(settings)[:max_tasks]
    report = RepoCheckReport()
    config = sandbox.model_dump()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(check_task, config, str(sandbox_root), repo_tests(r, settings), r["paths"]): r["id"] for r in records}
        for future in futures:
            original_ok, changed_ok, why = future.result()
            report.checked += 1
            report.originals_passing += original_ok
            report.changed_failing += changed_ok
            if why:
                report.failures.append((futures[future], why))
            on_task()
    return report
