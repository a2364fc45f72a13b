"""Repository tasks: a real Python project with its own test suite, in which a change was made that the agent must
undo (*bug*: a seeded semantic mutation of a function; *multi*: several at once, in different functions or files;
*history*: a commit of the project's log with its source change taken out, `rollout.tasks.history`) or complete
(*feature*: a function's body removed, its signature and docstring kept).

Projects (`rollout.tasks.projects`): the ready-made ones ship their test suites inside their installed packages (no
checkout, no network) and are pure Python, so a mutation changes behaviour the tests can see, the tests need no
compiler, and many files run in about a second:
  networkx   about 265 test files; deterministic (seeded random graphs), no hidden state between tests;
  sympy      about 610 test files; deterministic once its `slow` tests are left out (`-m "not slow"`) and files
             using hypothesis (random examples) are skipped.
numpy, numba and matplotlib also ship tests but are mostly compiled code (a mutation of their Python layer rarely
reaches the tests, and their suites are slow); mpmath's 31 files are few. A user's own project (a directory or a git
checkout at a pinned commit) runs its tests in a virtual environment of its own, made once per digest.

How a task set is built (`build_repo_tasks`, `composer env build`):
  1. each project's files are copied twice (`rollout.tasks.workspace`: episode and grading bases; a history task's
     base is its commit's tree) and its environment made;
  2. candidates: for each module `pkg/.../mod.py` with a test file (`pkg/.../tests/test_mod.py`, or `test_mod.py`
     under a user project's test paths), every mutation site of its functions named in that test file (bug kinds:
     comparison, boundary (off by one), operator, negated condition, removed branch, constant), every function
     with a docstring and a body of 3+ statements (feature), seeded combinations of sites (multi), and the commits
     that changed source and tests together (history); shuffled by the seed, interleaved over (project, kind);
  3. each test file used is surveyed per base: run twice on the original (in the sandbox, through the guarded runner
     the grader uses); its *expected* tests are those that passed both times; a file that needs more CPU time than
     `max_test_seconds` (CPU, not wall time: the same on a busy host) or has no passing test is not used;
  4. a candidate is validated: its changed files alone, its test files run again; fail-to-pass = expected tests
     that now fail (at least one), pass-to-pass = those still passing.
Everything is cached under `cache_dir`, keyed by the settings that decide the set and the projects' digests; each
survey and each candidate's verdict is its own atomically written file, so a killed build resumes where it
stopped, and the set (the first `num_tasks` validated candidates in candidate order) is the same for any number of
workers. The unchanged original stays out of reach of episodes: every installed copy of a ready-made project
(`sandbox.installed_copies`) is hidden in the sandbox, a user's project is not installed in its environment, and the
workspace's copy is first on sys.path.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from composer.recipes.errors import UserError
from composer.recipes.env_schema import RepoTaskSettings, SandboxSection
from composer.recipes.schema import SSHSection
from composer.rollout.sandbox.hosts import LOCALHOST, SandboxFleet
from composer.rollout.sandbox.isolation import installed_copies
from composer.rollout.sandbox.results import RewardMode, RunEnvironment
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.grading_policy import Scope
from composer.rollout.tasks.history import history_commits, is_test_file, parent_text
from composer.rollout.tasks.mutations import Mutation, changed_module, mutations
from composer.rollout.tasks.projects import (
    ProjectSpec,
    _chmod_tree,
    environment_dir,
    load_environment,
    project_environment,
    ready_made_version,
    resolve_project,
    resolve_projects,
)
from composer.rollout.tasks.projects import project_bases as _bases_of
from composer.rollout.tasks.remote import remote_test_run
from composer.rollout.tasks.workspace import RepoTests, RepoWorkspace, TestReport, run_tests_guarded, unmount
from composer.runtime.run_dir import atomic_write_text

log = logging.getLogger("composer.repo_tasks")

# Bump when candidates, validation or records change: it is part of every set's cache key.
ENGINE_VERSION = 3
# Bump when a survey's record or the runner that makes it changes.
SURVEY_VERSION = 1


def project_version(name: str) -> str:
    return ready_made_version(name)


def project_bases(cache_dir: Path, name: str) -> Path:
    """The bases of a ready-made project (`rollout.tasks.projects.project_bases` for any)."""
    return _bases_of(cache_dir, resolve_project(name, []))


def open_workspace(tests: RepoTests, sandbox: Sandbox, reward: RewardMode = "fraction") -> RepoWorkspace:
    """A fresh episode view of a repository task (close it when the episode ends)."""
    return RepoWorkspace(tests, sandbox, sandbox.root / "workspaces", reward)


# --- candidates ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edit:
    """One file of a task's change: a seeded change of the base's file (`mutations`, all in other functions),
    or its new text (a history task: the parent's version)."""

    path: str
    mutations: tuple[Mutation, ...] = ()
    text: str | None = None


@dataclass(frozen=True)
class Candidate:
    id: str
    project: str
    kind: str
    edits: tuple[Edit, ...]
    test_files: tuple[str, ...]
    base: str = ""
    """The commit whose tree is the task's base (history); "" for the project's pinned files."""
    statement: str = ""
    """What the task asks, in the project's words (history: the commit message)."""

    @property
    def mutations(self) -> tuple[Mutation, ...]:
        return tuple(m for e in self.edits for m in e.mutations)

    @property
    def operator(self) -> str:
        return "commit" if self.kind == "history" else "+".join(m.operator for m in self.mutations)

    @property
    def function(self) -> str:
        return ", ".join(m.function for m in self.mutations)

    @property
    def description(self) -> str:
        if self.kind == "history":
            return f"commit {self.base[:12]}: {self.statement.splitlines()[0] if self.statement else ''}"
        return "; ".join(m.description for m in self.mutations)


def _test_file_for(module: str, spec: ProjectSpec, root: Path) -> str | None:
    """A module's test file: `<module dir>/tests/test_<module>.py` (ready-made), else the first `test_<module>.py`
    under the project's test paths."""
    stem = PurePosixPath(module).stem
    if not spec.test_paths:
        test = PurePosixPath(module).parent / "tests" / f"test_{stem}.py"
        return str(test) if (root / test).is_file() else None
    for test_path in spec.test_paths:
        found = sorted(str(p.relative_to(root)) for p in (root / test_path).rglob(f"test_{stem}.py"))
        if found:
            return found[0]
    return None


SITES_PER_MODULE = {"bug": 4, "feature": 2, "multi": 2}
"""Candidates taken from one module per pass over a project's modules: tasks spread over the whole project."""


def _modules(spec: ProjectSpec, kind: str, seed: int, root: Path, include: list[str]) -> list[tuple[str, str]]:
    """(module, its test file) of the project's package, in a seeded order."""
    modules = []
    for module in sorted((root / spec.package).rglob("*.py")):
        relative = str(module.relative_to(root))
        if "tests" in PurePosixPath(relative).parts or module.name.startswith("test_") or module.name == "conftest.py":
            continue
        if spec.test_paths and is_test_file(relative, spec.test_paths):
            continue
        if include and not any(fnmatch.fnmatch(relative, pattern) for pattern in include):
            continue
        if (test_file := _test_file_for(relative, spec, root)) is not None:
            modules.append((relative, test_file))
    random.Random(f"{seed}/{spec.name}/{kind}").shuffle(modules)
    return modules


def _sites(spec: ProjectSpec, root: Path, relative: str, test_file: str, kind: str) -> list[Mutation]:
    test_text = (root / test_file).read_text(errors="replace")
    if any(marker in test_text for marker in spec.skip_files_with):
        return []
    try:
        return mutations((root / relative).read_text(), kind, test_text)
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return []


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _stream(spec: ProjectSpec, kind: str, seed: int, root: Path, include: list[str]) -> Iterator[Candidate]:
    """One (project, kind)'s candidates: its modules that have a test file, in a seeded order, up to
    SITES_PER_MODULE seeded sites from each (a module is parsed only when the stream reaches it)."""
    rng = random.Random(f"{seed}/{spec.name}/{kind}")
    for relative, test_file in _modules(spec, kind, seed, root, include):
        found = _sites(spec, root, relative, test_file, kind)
        for m in rng.sample(found, min(len(found), SITES_PER_MODULE[kind])):
            digest = _digest(f"{relative}:{m.start}:{m.end}:{m.text}")
            yield Candidate(f"repo/{spec.name}/{kind}/{digest}", spec.name, kind, (Edit(relative, (m,)),), (test_file,))


def _multi_stream(spec: ProjectSpec, settings: RepoTaskSettings, root: Path) -> Iterator[Candidate]:
    """Several seeded bugs at once, each in another function: from one module while it has functions enough, then
    from the modules after it in the seeded order (their test files all run)."""
    rng = random.Random(f"{settings.seed}/{spec.name}/multi")
    modules = _modules(spec, "multi", settings.seed, root, settings.include)
    by_function: dict[int, dict[tuple[str, str], list[Mutation]]] = {}

    def functions_of(index: int) -> dict[tuple[str, str], list[Mutation]]:
        if index not in by_function:
            relative, test_file = modules[index]
            grouped: dict[tuple[str, str], list[Mutation]] = {}
            for m in _sites(spec, root, relative, test_file, "bug"):
                grouped.setdefault((relative, m.function), []).append(m)
            by_function[index] = grouped
        return by_function[index]

    for index in range(len(modules)):
        for _ in range(SITES_PER_MODULE["multi"]):
            wanted = rng.randint(*settings.multi_changes)
            chosen: list[tuple[str, Mutation]] = []
            for other in range(index, len(modules)):
                functions = functions_of(other)
                for key in rng.sample(sorted(functions), min(len(functions), wanted - len(chosen))):
                    chosen.append((key[0], rng.choice(functions[key])))
                if len(chosen) >= wanted:
                    break
            if len(chosen) < wanted:
                break
            paths = sorted({path for path, _ in chosen})
            edits = tuple(Edit(path, tuple(m for p, m in chosen if p == path)) for path in paths)
            tests = tuple(sorted({modules[i][1] for i in range(len(modules)) if modules[i][0] in paths}))
            digest = _digest(";".join(f"{p}:{m.start}:{m.end}:{m.text}" for p, m in chosen))
            yield Candidate(f"repo/{spec.name}/multi/{digest}", spec.name, "multi", edits, tests)


def _history_stream(spec: ProjectSpec, settings: RepoTaskSettings) -> Iterator[Candidate]:
    for commit in history_commits(spec, settings.history_commits, settings.seed):
        paths = [p for p in commit.sources if not settings.include or any(fnmatch.fnmatch(p, g) for g in settings.include)]
        if len(paths) != len(commit.sources):
            continue
        edits = tuple(Edit(path, text=parent_text(spec, commit, path)) for path in paths)
        yield Candidate(f"repo/{spec.name}/history/{commit.commit[:12]}", spec.name, "history", edits, commit.test_files,
                        base=commit.commit, statement=commit.message)


def candidates(settings: RepoTaskSettings, bases: dict[str, Path], specs: dict[str, ProjectSpec] | None = None) -> Iterator[Candidate]:
    """The set's candidates in the order they are validated: one from each (project, kind) stream in turn."""
    specs = specs or resolve_projects(settings)
    streams = []
    for name in settings.project_names():
        spec, root = specs[name], bases[name] / "grading"
        for kind in settings.kinds:
            if kind == "history":
                if spec.checkout is not None:
                    streams.append(_history_stream(spec, settings))
            elif kind == "multi":
                streams.append(_multi_stream(spec, settings, root))
            else:
                streams.append(_stream(spec, kind, settings.seed, root, settings.include))
    while streams:
        for stream in list(streams):
            try:
                yield next(stream)
            except StopIteration:
                streams.remove(stream)


# --- survey and validation (run in worker processes) ------------------------------------------------

_worker_sandbox: Sandbox | None = None


def _sandbox(config: dict, root: str) -> Sandbox:
    global _worker_sandbox
    if _worker_sandbox is None:
        _worker_sandbox = Sandbox(SandboxSection(**config), root=Path(root))
    return _worker_sandbox


def _process_start(pid: int | str) -> str | None:
    """A live process's start time (ticks since boot), None when it is gone or a zombie (pids are reused)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _area(sandbox: Sandbox) -> Path:
    """This process's grading views (named by pid and start time, so a later build can tell they are stale)."""
    return sandbox.root / f"views-{os.getpid()}-{_process_start(os.getpid())}"


@dataclass(frozen=True)
class TestSetup:
    """How a project's tests run (what the build's workers and the checks need of a project)."""

    project: str
    pytest_args: tuple[str, ...]
    hidden: tuple[str, ...]
    environment: RunEnvironment | None
    source: str

    @property
    def ready_made(self) -> bool:
        """A ready-made project: installed with every host's composer (its copies hidden there too)."""
        return self.environment is None and bool(self.hidden)

    def grading_environment(self) -> RunEnvironment | None:
        tests = RepoTests(package="", test_files=(), fail_to_pass=(), pass_to_pass=(), pytest_args=(), layer=Path(),
                          episode_base=Path(), grading_base=Path(), hidden=(), timeout_s=0, environment=self.environment,
                          source=self.source)
        return tests.run_environment("repo")


TestRun = Callable[[dict[str, str], tuple[str, ...], float], TestReport]
"""A guarded test run over the project's grading base with changes (path -> text): here, or on a sandbox host."""


def _local_run(config: dict, sandbox_root: str, bases: str, setup: TestSetup) -> TestRun:
    sandbox = _sandbox(config, sandbox_root)
    grading = Path(bases) / "grading"
    return lambda changes, test_files, timeout_s: run_tests_guarded(
        sandbox, grading, {p: t.encode() for p, t in changes.items()}, test_files, setup.pytest_args, timeout_s,
        setup.hidden, _area(sandbox), setup.grading_environment())


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
    return {"test_file": test_file, "complete": complete, "passing": passing if complete else [],
            "wall_seconds": max(r.wall_seconds for r in runs), "cpu_seconds": max(r.cpu_seconds for r in runs),
            "status": runs[-1].status,
            "infra_failure": any(r.infra_failure for r in runs), "detail": runs[-1].detail or runs[-1].output[-500:]}


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


def validate_with(run: TestRun, changed: dict[str, str] | None, test_files: tuple[str, ...], expected: list[str],
                  timeout_s: float) -> dict:
    """The changed files alone: which expected tests fail now."""
    if changed is None:
        return {"verdict": "rejected", "reason": "the change does not parse or changes nothing"}
    report = run(changed, test_files, timeout_s)
    if report.infra_failure:
        return {"verdict": "infra", "reason": "sandbox failure"}
    if not report.complete:
        return {"verdict": "rejected", "reason": "timeout" if report.status == "timeout" else "incomplete test run"}
    if report.flags:
        return {"verdict": "rejected", "reason": "flagged test run"}
    fail_to_pass = [i for i in expected if report.outcomes.get(i) != "passed"]
    pass_to_pass = [i for i in expected if report.outcomes.get(i) == "passed"]
    if not fail_to_pass:
        return {"verdict": "rejected", "reason": "no test fails"}
    return {"verdict": "validated", "fail_to_pass": fail_to_pass, "pass_to_pass": pass_to_pass,
            "changed_files": changed, "wall_seconds": report.wall_seconds}


def survey(config: dict, sandbox_root: str, bases: str, setup: TestSetup, test_file: str, timeout_s: float) -> dict:
    """`survey_with` in a worker process of this machine."""
    return survey_with(_local_run(config, sandbox_root, bases, setup), test_file, timeout_s)


def validate(config: dict, sandbox_root: str, bases: str, setup: TestSetup, changed: dict[str, str] | None,
             test_files: tuple[str, ...], expected: list[str], timeout_s: float) -> dict:
    """`validate_with` in a worker process of this machine."""
    return validate_with(_local_run(config, sandbox_root, bases, setup), changed, test_files, expected, timeout_s)


class _Runners:
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
        remote = [name for name in sandbox.hosts if name != LOCALHOST] if fleet is not None else []
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
            run = remote_test_run(self.fleet, slot, setup.project, bases / "grading", setup.environment, setup.pytest_args,
                                  setup.ready_made, setup.source)
            return survey_with(run, *args) if kind == "survey" else validate_with(run, *args)
        finally:
            self.slots.put(slot)

    def close(self) -> None:
        self.threads.shutdown(wait=True)
        if self.processes is not None:
            self.processes.shutdown(wait=True)


# --- the build -----------------------------------------------------------------------------------


def set_key(settings: RepoTaskSettings, specs: dict[str, ProjectSpec] | None = None) -> str:
    """The cache key of a task set: what decides its candidates and verdicts (not how many are wanted)."""
    specs = specs or resolve_projects(settings)
    decided = {"projects": {name: f"{spec.digest}/{spec.tests_key}" for name, spec in specs.items()}, "kinds": list(settings.kinds),
               "seed": settings.seed, "max_test_seconds": settings.max_test_seconds, "include": settings.include,
               "engine": ENGINE_VERSION}
    if "history" in settings.kinds:
        decided["history_commits"] = settings.history_commits
    if "multi" in settings.kinds:
        decided["multi_changes"] = list(settings.multi_changes)
    return hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()[:16]


def set_dir(settings: RepoTaskSettings, specs: dict[str, ProjectSpec] | None = None) -> Path:
    return Path(settings.cache_dir).resolve() / "sets" / set_key(settings, specs)


def _file_name(text: str) -> str:
    return text.replace("/", "__")


def _survey_path(bases: Path, spec: ProjectSpec, test_file: str) -> Path:
    return bases / f"survey-{SURVEY_VERSION}-{spec.tests_key}" / f"{_file_name(test_file)}.json"


def _read_json(path: Path, required: str) -> dict | None:
    """A cached record, or None when it is missing or unreadable (a torn or foreign file is redone, not trusted)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and required in record else None


@dataclass
class BuildReport:
    validated: int = 0
    tried: int = 0
    rejected: Counter = field(default_factory=Counter)
    by_project_kind: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    resumed: int = 0
    """Verdicts found in the cache (not rerun)."""
    host_runs: dict = field(default_factory=dict)
    """Surveys and validations run on each sandbox host."""


RULES = ("Do not change the tests or the pytest configuration: they are restored before grading, and a change to them "
         "counts as tampering.")


def _shown(ids: list[str]) -> str:
    return "\n".join(f"  {i}" for i in ids[:8]) + (f"\n  ... and {len(ids) - 8} more" if len(ids) > 8 else "")


def _prompt(c: Candidate, version: str, fail_to_pass: list[str]) -> str:
    """What the agent is shown (README: per kind): the problem, how to run the tests, and which of them fail."""
    where = f"You are working in a checkout of {c.project} {c.base[:12] if c.base else version} at /sandbox."
    tests = " ".join(c.test_files)
    run = f"python -m pytest {tests}"
    if c.kind == "feature":
        (m,) = c.mutations
        return (f"{where} The function `{m.function}` in `{c.edits[0].path}` has no implementation yet: its signature and "
                f"docstring say what it must do. Implement it so that the tests in `{tests}` pass (run them with `{run}`). {RULES}")
    if c.kind == "history":
        return (f"{where} Resolve this issue:\n\n{c.statement}\n\nThese tests fail until it is resolved:\n{_shown(fail_to_pass)}\n"
                f"Change the project's code (run the tests with `{run}`). {RULES}")
    several = " (there is more than one bug, in different functions)" if c.kind == "multi" else ""
    return (f"{where} These tests of `{tests}` fail:\n{_shown(fail_to_pass)}\nFind the bug{'s' if several else ''} in the "
            f"library code{several} and fix {'them' if several else 'it'} (run the tests with `{run}`). {RULES}")


def build_repo_tasks(settings: RepoTaskSettings, sandbox: SandboxSection, sandbox_root: Path, workers: int,
                     on_progress: Callable[[BuildReport], None] = lambda report: None,
                     ssh: SSHSection | None = None) -> BuildReport:
    """Build (or finish building) the task set: at least `num_tasks` validated tasks, or every candidate tried; the
    surveys and validations spread over `workers` processes here (when localhost is among the sandbox's hosts) and
    the sandbox's remote hosts (reached with `ssh`)."""
    build = _Build(settings, sandbox, sandbox_root, on_progress)
    remote = [name for name in sandbox.hosts if name != LOCALHOST]
    fleet = SandboxFleet(sandbox, ssh or SSHSection(), root=sandbox_root) if remote else None
    try:
        runners = _Runners(sandbox, sandbox_root, workers, fleet)
        try:
            build.run(runners)
        finally:
            runners.close()
        build.report.host_runs = dict(runners.runs)
    finally:
        if fleet is not None:
            fleet.close()
    build.refuse_failing_originals()
    _write_index(build)
    return build.report


def _setup_of(spec: ProjectSpec, environment) -> TestSetup:
    return TestSetup(spec.name, spec.pytest_args, spec.hidden, environment.run_environment() if environment else None, spec.source)


class _Build:
    """One build of a task set: each project's environment made (once per digest), candidates taken in order, each
    test file surveyed once per base, candidates validated in worker processes; every verdict recorded as it comes
    (a killed build resumes from them)."""

    def __init__(self, settings: RepoTaskSettings, sandbox: SandboxSection, sandbox_root: Path,
                 on_progress: Callable[[BuildReport], None]):
        self.started = time.monotonic()
        self.settings, self.sandbox_root, self.on_progress = settings, sandbox_root, on_progress
        self.config = sandbox.model_dump()
        self.cache_dir = Path(settings.cache_dir).resolve()
        self.specs = resolve_projects(settings)
        self.bases = {name: _bases_of(self.cache_dir, spec) for name, spec in self.specs.items()}
        sandbox_root.mkdir(parents=True, exist_ok=True)
        self.setups = {name: _setup_of(spec, project_environment(self.cache_dir, spec, sandbox, sandbox_root))
                       for name, spec in self.specs.items()}
        self.directory = set_dir(settings, self.specs)
        (self.directory / "verdicts").mkdir(parents=True, exist_ok=True)
        (self.directory / "layers").mkdir(exist_ok=True)
        _clean_stale_views(sandbox_root)
        self.stream = candidates(settings, self.bases, self.specs)
        self.ordered: list[Candidate] = []
        self.report = BuildReport()
        self.verdicts: dict[str, dict] = {}
        self.surveys: dict[tuple[str, str, str], dict] = {}
        """(project, base, test file) -> its survey."""
        self.in_flight: dict[Future, tuple[str, object]] = {}
        self.waiting: dict[tuple[str, str, str], list[Candidate]] = {}
        """Candidates waiting for a test file's survey, by (project, base, test file)."""

    def bases_of(self, c: Candidate) -> Path:
        return _bases_of(self.cache_dir, self.specs[c.project], c.base or None) if c.base else self.bases[c.project]

    def next_candidate(self) -> Candidate | None:
        """The next candidate in order (its cached verdict loaded), or None when every one was taken."""
        c = next(self.stream, None)
        if c is not None:
            self.ordered.append(c)
            if found := _read_json(self.directory / "verdicts" / f"{_file_name(c.id)}.json", "verdict"):
                self.verdicts[c.id] = found
                self.report.resumed += 1
        return c

    def survey_of(self, c: Candidate, test_file: str) -> dict | None:
        key = (c.project, c.base, test_file)
        if key not in self.surveys and (found := _read_json(_survey_path(self.bases_of(c), self.specs[c.project], test_file), "cpu_seconds")):
            self.surveys[key] = found
        return self.surveys.get(key)

    def record(self, c: Candidate, verdict: dict) -> None:
        self.verdicts[c.id] = verdict
        if verdict["verdict"] == "infra":
            return  # kept in memory only: retried by the next build
        if verdict["verdict"] == "validated":
            _write_layer(self.directory / "layers" / _file_name(c.id), verdict["changed_files"])
        atomic_write_text(self.directory / "verdicts" / f"{_file_name(c.id)}.json", json.dumps(verdict))

    def tally(self) -> None:
        report = self.report
        report.validated = report.tried = 0
        report.rejected, report.by_project_kind = Counter(), Counter()
        for c in self.ordered:
            if c.id not in self.verdicts or report.validated >= self.settings.num_tasks:
                continue
            v = self.verdicts[c.id]
            report.tried += 1
            if v["verdict"] == "validated":
                report.validated += 1
                report.by_project_kind[(c.project, c.kind)] += 1
            else:
                report.rejected[v["reason"]] += 1
        report.seconds = time.monotonic() - self.started
        self.on_progress(report)

    def enough(self) -> bool:
        """`num_tasks` validated among the first candidates, every one before them decided."""
        validated = 0
        for c in self.ordered:
            if c.id not in self.verdicts:
                return False
            validated += self.verdicts[c.id]["verdict"] == "validated"
            if validated >= self.settings.num_tasks:
                return True
        return False

    def dispatch(self, pool: _Runners, c: Candidate) -> None:
        """Survey the candidate's test files first where needed, reject it on a survey, or validate it."""
        missing = [t for t in c.test_files if self.survey_of(c, t) is None]
        if missing:
            for test_file in missing:
                key = (c.project, c.base, test_file)
                if key not in self.waiting:
                    self.waiting[key] = []
                    future = pool.submit("survey", self.bases_of(c), self.setups[c.project], test_file,
                                         max(60.0, 3 * self.settings.max_test_seconds))
                    self.in_flight[future] = ("survey", key)
                self.waiting[key].append(c)
            return
        surveys = [self.survey_of(c, t) for t in c.test_files]
        if not all(s["complete"] and s["passing"] for s in surveys):
            self.record(c, {"verdict": "rejected", "reason": "test file fails or errs on the original"})
        elif sum(s["cpu_seconds"] for s in surveys) > self.settings.max_test_seconds:
            self.record(c, {"verdict": "rejected", "reason": "test file needs more than max_test_seconds of CPU"})
        else:
            expected = [i for s in surveys for i in s["passing"]]
            changed = changed_files(self.bases_of(c) / "grading", c)
            future = pool.submit("validate", self.bases_of(c), self.setups[c.project], changed, c.test_files, expected,
                                 10 + 3 * sum(s["wall_seconds"] for s in surveys))
            self.in_flight[future] = ("validate", c)

    def take(self, pool: _Runners, kind: str, item, result: dict) -> None:
        """A finished survey (its waiting candidates dispatched once all theirs are in) or validation (its verdict)."""
        if kind == "validate":
            self.record(item, result)
            return
        waiting = self.waiting.pop(item)
        if result["infra_failure"]:
            for c in waiting:
                if c.id not in self.verdicts:
                    self.record(c, {"verdict": "infra", "reason": "sandbox failure"})
            return
        project, base, test_file = item
        atomic_write_text(_survey_path(self.bases_of(waiting[0]), self.specs[project], test_file), json.dumps(result))
        self.surveys[item] = result
        for c in waiting:
            if c.id not in self.verdicts and not any((c.project, c.base, t) in self.waiting for t in c.test_files):
                self.dispatch(pool, c)

    def run(self, pool: _Runners) -> None:
        self.tally()
        exhausted = False
        while True:
            # Keep every slot busy with the next candidates in order, while more could still be needed.
            while len(self.in_flight) < 2 * pool.size and not exhausted and not self.enough():
                c = self.next_candidate()
                if c is None:
                    exhausted = True
                elif c.id not in self.verdicts:
                    self.dispatch(pool, c)
            if not self.in_flight:
                if exhausted or self.enough():
                    break
                continue
            done, _ = wait(self.in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                kind, item = self.in_flight.pop(future)
                self.take(pool, kind, item, future.result())
            self.tally()
        self.tally()

    def refuse_failing_originals(self) -> None:
        """A user's project whose every surveyed test file fails on the original has a broken environment or
        test setup, not hard tasks: one clear error (its verdicts stay cached; no index is written)."""
        for name, spec in self.specs.items():
            if spec.settings is None:
                continue
            mine = [s for (project, base, _), s in self.surveys.items() if project == name and not base]
            if mine and not any(s["complete"] and s["passing"] for s in mine):
                worst = mine[0]
                raise UserError(f"env.tasks: project {name}: its tests fail on the original ({len(mine)} test file(s) "
                                f"surveyed at {spec.version}, none passes; e.g. {worst['test_file']}: {worst['status']}, "
                                f"{worst['detail'].strip().splitlines()[-1] if worst['detail'].strip() else 'no test passed'})")


def _write_layer(layer: Path, files: dict[str, str]) -> None:
    """The task's changed files in a tree of their own, writable by any uid (the episode's top lower layer)."""
    if layer.is_dir():
        return
    staging = Path(tempfile.mkdtemp(prefix=".layer-", dir=layer.parent))
    try:
        for relative, text in files.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        _chmod_tree(staging, 0o666, 0o777)
        os.chmod(staging, 0o755)
        os.rename(staging, layer)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_index(build: _Build) -> None:
    """tasks.json: the validated tasks in candidate order (what a task pool loads), and how each project's tests run."""
    tasks = []
    for c in build.ordered:
        v = build.verdicts.get(c.id)
        if v is None or v["verdict"] == "infra":
            break
        if v["verdict"] != "validated":
            continue
        spec = build.specs[c.project]
        seconds = sum(json.loads(_survey_path(build.bases_of(c), spec, t).read_text())["cpu_seconds"] for t in c.test_files)
        tasks.append({"id": c.id, "project": c.project, "version": spec.version, "kind": c.kind, "operator": c.operator,
                      "path": c.edits[0].path, "paths": [e.path for e in c.edits], "function": c.function,
                      "scope": [[e.path, [m.function for m in e.mutations]] for e in c.edits],
                      "description": c.description, "test_file": c.test_files[0], "test_files": list(c.test_files),
                      "base": c.base, "fail_to_pass": v["fail_to_pass"], "pass_to_pass": v["pass_to_pass"],
                      "test_seconds": seconds, "layer": f"layers/{_file_name(c.id)}",
                      "prompt": _prompt(c, spec.version, v["fail_to_pass"])})
    projects = {name: {"package": spec.package, "source": spec.source, "pytest_args": list(spec.pytest_args),
                       "ready_made": spec.settings is None, "digest": spec.digest,
                       "environment": str(environment_dir(build.cache_dir, spec)) if spec.settings is not None else None}
                for name, spec in build.specs.items()}
    atomic_write_text(build.directory / "tasks.json", json.dumps({"key": build.directory.name, "projects": projects,
                                                                  "versions": {n: s.version for n, s in build.specs.items()},
                                                                  "tasks": tasks}))


def _clean_stale_views(sandbox_root: Path) -> None:
    """Views left by build workers that were killed: unmounted and removed."""

    for area in sandbox_root.glob("views-*"):
        pid, _, start = area.name.removeprefix("views-").partition("-")
        if pid.isdigit() and _process_start(pid) == start:
            continue
        for view in area.glob("grade-*/repo"):
            if os.path.ismount(view):
                unmount(view)
        shutil.rmtree(area, ignore_errors=True)


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
        raise UserError(f"env.tasks: task {record['id']} was built by an older composer (its index names no scope); "
                        "rebuild the tasks with `composer env build RECIPE`")
    cache_dir = Path(settings.cache_dir).resolve()
    key = record["base"][:16] if record["base"] else record["version"] if setup["ready_made"] else setup["digest"]
    bases = cache_dir / "projects" / f"{record['project']}-{key}"
    environment = None
    if setup["environment"] is not None:
        built = load_environment(Path(setup["environment"]))
        if built is None:
            raise UserError(f"env.tasks: the environment of project {record['project']} ({setup['environment']}) is gone; "
                            "rebuild it with `composer env build RECIPE`")
        environment = built.run_environment()
    return RepoTests(
        package=setup["package"], test_files=tuple(record["test_files"]), fail_to_pass=tuple(record["fail_to_pass"]),
        pass_to_pass=tuple(record["pass_to_pass"]), pytest_args=tuple(setup["pytest_args"]),
        layer=set_dir(settings) / record["layer"], episode_base=bases / "episode", grading_base=bases / "grading",
        hidden=installed_copies(record["project"]) if setup["ready_made"] else (),
        timeout_s=max(60.0, 4 * record["test_seconds"]), pass_to_pass_policy=settings.pass_to_pass,
        environment=environment, source=setup["source"],
        scope=tuple(Scope(path, tuple(functions)) for path, functions in record["scope"]))


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
    """(original passes, changed fails as recorded, why not) for one built task."""
    sandbox = _sandbox(config, sandbox_root)
    run = lambda changes: run_tests_guarded(sandbox, tests.grading_base, changes, tests.test_files, tests.pytest_args,
                                            tests.timeout_s, tests.hidden, _area(sandbox), tests.run_environment("repo"))
    expected = (*tests.fail_to_pass, *tests.pass_to_pass)
    original = run({})
    original_ok = original.complete and not original.flags and all(original.outcomes.get(i) == "passed" for i in expected)
    changed = run({path: (tests.layer / path).read_bytes() for path in paths})
    changed_ok = (changed.complete and not changed.flags and all(changed.outcomes.get(i) != "passed" for i in tests.fail_to_pass)
                  and all(changed.outcomes.get(i) == "passed" for i in tests.pass_to_pass))
    why = []
    if not original_ok:
        why.append(f"original: {original.detail or [i for i in expected if original.outcomes.get(i) != 'passed'][:3]}")
    if not changed_ok:
        why.append(f"changed: {changed.detail or 'outcomes differ from the recorded ones'}")
    return original_ok, changed_ok, "; ".join(why)


def check_repo_tasks(settings: RepoTaskSettings, sandbox: SandboxSection, sandbox_root: Path, max_tasks: int | None,
                     workers: int, on_task: Callable[[], None] = lambda: None) -> RepoCheckReport:
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
