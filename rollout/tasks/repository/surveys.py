"""The build's guarded test runs: a test file's survey on the original and a candidate's validation, in worker
processes of this machine or on the fleet's remote sandbox hosts (`Runners`), each through the runner the grader
uses."""

from __future__ import annotations

import multiprocessing
import queue
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.hosts import LOCALHOST
from composer.rollout.sandbox.results import RunEnvironment
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.candidates import Candidate
from composer.rollout.tasks.repository.grading_policy import Scope
from composer.rollout.tasks.repository.mutations import changed_module
from composer.rollout.tasks.repository.remote import remote_test_run
from composer.rollout.tasks.repository.workspace import RepoTests, TestReport, packages_environment, run_tests_across, run_tests_guarded
from composer.rollout.tasks.workspace import views_area

_worker_sandbox: Sandbox | None = None


def worker_sandbox(config: dict, root: str) -> Sandbox:
    global _worker_sandbox
    if _worker_sandbox is None:
        _worker_sandbox = Sandbox(SandboxSection(**config), root=Path(root))
    return _worker_sandbox


def grading_area(sandbox: Sandbox) -> Path:
    """This process's grading views (`views_area`: a killed process's are reclaimed)."""
    return views_area(sandbox.root)


@dataclass(frozen=True)
class TestSetup:
    """How a project's tests run (what the build's workers and the checks need of a project)."""

    project: str
    pytest_args: tuple[str, ...]
    hidden: tuple[str, ...]
    environment: RunEnvironment | None
    packages: tuple[str, ...]

    @property
    def ready_made(self) -> bool:
        """A ready-made project: installed with every host's composer (its copies hidden there too)."""
        return self.environment is None and bool(self.hidden)

    def grading_environment(self) -> RunEnvironment | None:
        return packages_environment(self.environment, self.packages, "repo")


TestRun = Callable[[dict[str, str], tuple[str, ...], float], TestReport]
"""A guarded test run over the project's grading base with changes (path -> text): here, or on a sandbox host."""


def _local_run(config: dict, sandbox_root: str, bases: str, setup: TestSetup) -> TestRun:
    sandbox = worker_sandbox(config, sandbox_root)
    grading = Path(bases) / "grading"
    return lambda changes, test_files, timeout_s: run_tests_guarded(
        sandbox,
        grading,
        {p: t.encode() for p, t in changes.items()},
        test_files,
        setup.pytest_args,
        timeout_s,
        setup.hidden,
        grading_area(sandbox),
        setup.grading_environment(),
    )


AcrossRun = Callable[[dict[str, str], float], TestReport]
"""A test run across the grading boundary (`workspace.run_tests_across`) of one candidate: the episode's files over
the original (the grader's view is the original with the task's functions as proxies), the timeout."""


def _local_across(
    config: dict, sandbox_root: str, bases: str, setup: TestSetup, scope: tuple[Scope, ...], test_files: tuple[str, ...]
) -> AcrossRun:
    sandbox = worker_sandbox(config, sandbox_root)

    def run(episode: dict[str, str], timeout_s: float) -> TestReport:
        tests = RepoTests(
            packages=setup.packages,
            test_files=test_files,
            fail_to_pass=(),
            pass_to_pass=(),
            pytest_args=setup.pytest_args,
            timeout_s=timeout_s,
            scope=scope,
            layer=Path(),
            episode_base=Path(),
            grading_base=Path(bases) / "grading",
            hidden=setup.hidden,
            environment=setup.environment,
        )
        return run_tests_across(sandbox, tests, {p: t.encode() for p, t in episode.items()}, grading_area(sandbox))

    return run


def survey_with(run: TestRun, test_file: str, timeout_s: float) -> dict:
    """Run a test file twice on the original; its expected tests passed both times."""
    runs = []
    for _ in range(2):
        report = run({}, (test_file,), timeout_s)
        runs.append(report)
        if not report.complete:
            break
    passing = sorted(set.intersection(*({i for i, o in r.outcomes.items() if o == "passed"} for r in runs)))
    complete = all(r.complete and not r.flags for r in runs)
    return {
        "test_file": test_file,
        "complete": complete,
        "passing": passing if complete else [],
        "wall_seconds": max(r.wall_seconds for r in runs),
        "cpu_seconds": max(r.cpu_seconds for r in runs),
        "status": runs[-1].status,
        "infra_failure": any(r.infra_failure for r in runs),
        "detail": runs[-1].detail or runs[-1].output[-500:],
    }


def changed_files(grading: Path, candidate: Candidate) -> dict[str, str] | None:
    """The task's changed files (path -> text), or None when a change does not parse or changes nothing."""
    changed = {}
    for edit in candidate.edits:
        original = (grading / edit.path).read_text()
        text = edit.text if edit.text is not None else changed_module(original, *edit.mutations)
        if text is None or text == original:
            return None
        changed[edit.path] = text
    return changed


def _kind_of(refused: dict[str, int]) -> str:
    """What kind of value could not cross, from the most frequent refusal ("argument: a networkx...View")."""
    reason = sorted(refused, key=refused.get)[-1]
    return reason.partition(": a ")[2].split(".")[-1][:60] or reason.partition(": ")[2][:60] or reason[:60]


def validate_with(
    run: TestRun,
    across: AcrossRun,
    changed: dict[str, str] | None,
    test_files: tuple[str, ...],
    expected: list[str],
    timeout_s: float,
) -> dict:
    """The changed files alone (`run`, in pytest's process: the task's own change) must fail some expected tests:
    the project's tests catch it. Then through the grading boundary (`across`), where episodes are graded: the
    original must pass every expected test there, and the change must fail some of the tests it failed here; the
    task's tests are split by what the change does there (a test whose outcome on the change differs across the
    boundary is graded as it is there: the original passes it there, so a fix can)."""
    if changed is None:
        return {"verdict": "rejected", "reason": "the change does not parse or changes nothing"}
    report = run(changed, test_files, timeout_s)
    if report.infra_failure:
        return {"verdict": "infra", "reason": "sandbox failure"}
    if not report.complete:
        return {"verdict": "rejected", "reason": "timeout" if report.status == "timeout" else "incomplete test run"}
    if report.flags:
        return {"verdict": "rejected", "reason": "flagged test run"}
    failing_here = [i for i in expected if report.outcomes.get(i) != "passed"]
    if not failing_here:
        return {"verdict": "rejected", "reason": "no test fails"}
    passing_across = {}
    for episode in ({}, changed):
        crossed = across(episode, timeout_s)
        if crossed.infra_failure:
            return {"verdict": "infra", "reason": "sandbox failure"}
        if crossed.refused:
            reason = sorted(crossed.refused, key=crossed.refused.get)[-1].split(":")[0]
            return {"verdict": "rejected", "reason": f"cannot cross the grading boundary ({reason}: {_kind_of(crossed.refused)})"}
        if crossed.flags or not crossed.complete:
            return _otherwise(f"the run across the boundary {'was flagged' if crossed.flags else 'is incomplete'}", crossed)
        passing_across[bool(episode)] = {i for i in expected if crossed.outcomes.get(i) == "passed"}
        if not episode and len(passing_across[False]) < len(expected):
            first = next(i for i in expected if i not in passing_across[False])
            return _otherwise(f"{first}: {crossed.outcomes.get(first, 'not run')} on the original across the boundary", crossed)
    fail_to_pass = [i for i in expected if i not in passing_across[True]]
    if not set(fail_to_pass) & set(failing_here):
        return _otherwise(f"none of the {len(failing_here)} tests the change fails here fails across the boundary", crossed)
    verdict = {
        "verdict": "validated",
        "fail_to_pass": fail_to_pass,
        "pass_to_pass": [i for i in expected if i in passing_across[True]],
        "changed_files": changed,
        "wall_seconds": report.wall_seconds,
    }
    if set(fail_to_pass) != set(failing_here):
        verdict["detail"] = f"{len(set(fail_to_pass) ^ set(failing_here))} tests graded by their outcome on the change across the boundary"
    return verdict


def _otherwise(what: str, crossed: TestReport) -> dict:
    return {
        "verdict": "rejected",
        "reason": "behaves otherwise across the grading boundary",
        "detail": f"{what}\n{crossed.detail}\n{crossed.output[-3000:]}".strip(),
    }


def survey(config: dict, sandbox_root: str, bases: str, setup: TestSetup, test_file: str, timeout_s: float) -> dict:
    """`survey_with` in a worker process of this machine."""
    return survey_with(_local_run(config, sandbox_root, bases, setup), test_file, timeout_s)


def validate(
    config: dict,
    sandbox_root: str,
    bases: str,
    setup: TestSetup,
    changed: dict[str, str] | None,
    test_files: tuple[str, ...],
    expected: list[str],
    timeout_s: float,
    scope: tuple[Scope, ...],
) -> dict:
    """`validate_with` in a worker process of this machine."""
    across = _local_across(config, sandbox_root, bases, setup, scope, test_files)
    return validate_with(_local_run(config, sandbox_root, bases, setup), across, changed, test_files, expected, timeout_s)


class Runners:
    """Where the build's surveys and validations run: worker processes here (when localhost is a sandbox host) and
    the fleet's remote hosts, as many at once as each has sandboxes; a job takes the next free slot."""

    def __init__(self, sandbox: SandboxSection, sandbox_root: Path, workers: int, fleet):
        self.config, self.sandbox_root, self.fleet = sandbox.model_dump(), sandbox_root, fleet
        local = workers if LOCALHOST in sandbox.hosts else 0
        # Jobs reach the processes from this class's threads: a process forked from a threaded one can inherit a
        # held lock, so the workers start from a fork server instead.
        self.processes = ProcessPoolExecutor(max_workers=local, mp_context=multiprocessing.get_context("forkserver")) if local else None
        self.slots: queue.Queue = queue.Queue()
        for _ in range(local):
            self.slots.put(LOCALHOST)
        # the fleet's hosts as the build starts (SLURM-started servers that come up later take no build jobs)
        remote = [name for name in fleet.capacities if name != LOCALHOST] if fleet is not None else []
        for name in remote:
            for _ in range(fleet.capacities[name]):
                self.slots.put(name)
        self.size = self.slots.qsize()
        self.threads = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="build")
        self.runs: Counter[str] = Counter()
        """Jobs run per host."""

    def submit(self, kind: str, bases: Path, setup: TestSetup, *args) -> Future:
        return self.threads.submit(self._run, kind, bases, setup, args)

    def _run(self, kind: str, bases: Path, setup: TestSetup, args: tuple) -> dict:
        slot = self.slots.get()
        try:
            self.runs[slot] += 1
            if slot == LOCALHOST:
                job = survey if kind == "survey" else validate
                return self.processes.submit(job, self.config, str(self.sandbox_root), str(bases), setup, *args).result()
            where = (
                self.fleet,
                slot,
                setup.project,
                bases / "grading",
                setup.environment,
                setup.pytest_args,
                setup.ready_made,
                setup.packages,
            )
            run = remote_test_run(*where)
            if kind == "survey":
                return survey_with(run, *args)
            changed, test_files, expected, timeout_s, scope = args
            crossing = remote_test_run(*where, scope)
            across = lambda episode, seconds: crossing(episode, test_files, seconds)
            return validate_with(run, across, changed, test_files, expected, timeout_s)
        finally:
            self.slots.put(slot)

    def close(self) -> None:
        self.threads.shutdown(wait=True)
        if self.processes is not None:
            self.processes.shutdown(wait=True)
