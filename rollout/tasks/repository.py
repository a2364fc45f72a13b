"""Repository tasks: a real Python project with its own test suite, in which a change was made that the agent must
undo (*bug*: a seeded semantic mutation of a function) or complete (*feature*: a function's body removed, its
signature and docstring kept).

Projects. Both ship their test suites inside their installed packages (no checkout, no network) and are pure
Python, so a mutation changes behaviour the tests can see, the tests need no compiler, and many files run in about a
second:
  networkx   about 265 test files; deterministic (seeded random graphs), no hidden state between tests;
  sympy      about 610 test files; deterministic once its `slow` tests are left out (`-m "not slow"`) and files
             using hypothesis (random examples) are skipped.
numpy, numba and matplotlib also ship tests but are mostly compiled code (a mutation of their Python layer rarely
reaches the tests, and their suites are slow); mpmath's 31 files are few.

How a task set is built (`build_repo_tasks`, `composer env build`):
  1. each project's installed package is copied twice (`rollout.tasks.workspace`: episode and grading bases);
  2. candidates: for each module `pkg/.../mod.py` with a test file `pkg/.../tests/test_mod.py`, every mutation
     site of its functions named in that test file (bug kinds: comparison, boundary (off by one), operator,
     negated condition, removed branch, constant) and every function with a docstring and a body of 3+
     statements (feature); shuffled by the seed, interleaved over (project, kind);
  3. each test file used is surveyed: run twice on the original (in the sandbox, through the guarded runner the
     grader uses); its *expected* tests are those that passed both times; a file that needs more CPU time than
     `max_test_seconds` (CPU, not wall time: the same on a busy host) or has no passing test is not used;
  4. a candidate is validated: its changed file alone, the test file run again; fail-to-pass = expected tests
     that now fail (at least one), pass-to-pass = those still passing.
Everything is cached under `cache_dir`, keyed by the settings that decide the set and the projects' versions; each
survey and each candidate's verdict is its own atomically written file, so a killed build resumes where it
stopped, and the set (the first `num_tasks` validated candidates in candidate order) is the same for any number of
workers. The unchanged original stays out of reach of episodes: every installed copy of the project
(`sandbox.installed_copies`) is hidden in the sandbox, and the workspace's copy is first on sys.path.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

from recipes.errors import UserError
from recipes.schema import RepoTaskSettings, SandboxSection
from rollout.sandbox.isolation import installed_copies
from rollout.sandbox.results import RewardMode
from rollout.sandbox.runs import Sandbox
from rollout.tasks.grading_policy import Scope
from rollout.tasks.mutations import Mutation, changed_module, mutations
from rollout.tasks.workspace import RepoTests, RepoWorkspace, TestReport, run_tests_guarded, unmount
from runtime.run_dir import atomic_write_text

log = logging.getLogger("composer.repo_tasks")

# Bump when candidates, validation or records change: it is part of every set's cache key.
ENGINE_VERSION = 2
# Bump when a survey's record or the runner that makes it changes.
SURVEY_VERSION = 1


@dataclass(frozen=True)
class Project:
    name: str
    """Distribution and top-level package."""
    pytest_args: tuple[str, ...] = ()
    skip_files_with: tuple[str, ...] = ()
    """Test files whose text holds one of these are not used (nondeterministic tools)."""


PROJECTS = {
    "networkx": Project("networkx"),
    "sympy": Project("sympy", pytest_args=("-m", "not slow"), skip_files_with=("hypothesis",)),
}


def project_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"env.tasks: the repo task project {name} is not installed (pip install {name})") from None


def _package_dir(name: str) -> Path:
    # Found without importing it (sympy's import takes a second).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"env.tasks: the repo task project {name} is not installed as a package")
    return Path(spec.submodule_search_locations[0])


def open_workspace(tests: RepoTests, sandbox: Sandbox, reward: RewardMode = "fraction") -> RepoWorkspace:
    """A fresh episode view of a repository task (close it when the episode ends)."""
    return RepoWorkspace(tests, sandbox, sandbox.root / "workspaces", reward)


# --- the projects' bases ---------------------------------------------------------------------------


def _chmod_tree(root: Path, file_mode: int, dir_mode: int) -> None:
    for directory, _, files in os.walk(root):
        os.chmod(directory, dir_mode)
        for name in files:
            path = Path(directory, name)
            if not path.is_symlink():
                os.chmod(path, file_mode)


def project_bases(cache_dir: Path, name: str) -> Path:
    """<cache>/projects/<name>-<version>/{episode,grading}/<package>: the installed package without bytecode,
    made once (atomically) per version."""
    version = project_version(name)
    target = cache_dir / "projects" / f"{name}-{version}"
    if (target / "grading").is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        source = _package_dir(name)
        for kind, (file_mode, dir_mode) in {"episode": (0o666, 0o777), "grading": (0o644, 0o755)}.items():
            shutil.copytree(source, staging / kind / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            _chmod_tree(staging / kind, file_mode, dir_mode)
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "grading").is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# --- candidates ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    id: str
    project: str
    path: str
    """The changed module, relative to the project root (`<package>/...`)."""
    test_file: str
    mutation: Mutation


def _test_file_for(module: Path, package_root: Path) -> str | None:
    test = module.parent / "tests" / f"test_{module.stem}.py"
    return str(test.relative_to(package_root)) if test.is_file() else None


SITES_PER_MODULE = {"bug": 4, "feature": 2}
"""Candidates taken from one module per pass over a project's modules: tasks spread over the whole project."""


def _stream(name: str, kind: str, seed: int, root: Path, include: list[str]) -> Iterator[Candidate]:
    """One (project, kind)'s candidates: its modules that have a test file, in a seeded order, up to
    SITES_PER_MODULE seeded sites from each (a module is parsed only when the stream reaches it)."""
    project = PROJECTS[name]
    modules = []
    for module in sorted((root / name).rglob("*.py")):
        if "tests" in module.parts or module.name.startswith("test_") or module.name == "conftest.py":
            continue
        if include and not any(fnmatch.fnmatch(str(module.relative_to(root)), pattern) for pattern in include):
            continue
        if (test_file := _test_file_for(module, root)) is not None:
            modules.append((str(module.relative_to(root)), test_file))
    rng = random.Random(f"{seed}/{name}/{kind}")
    rng.shuffle(modules)
    for relative, test_file in modules:
        test_text = (root / test_file).read_text(errors="replace")
        if any(marker in test_text for marker in project.skip_files_with):
            continue
        try:
            found = mutations((root / relative).read_text(), kind, test_text)
        except (SyntaxError, ValueError, UnicodeDecodeError):
            continue
        for m in rng.sample(found, min(len(found), SITES_PER_MODULE[kind])):
            digest = hashlib.sha256(f"{relative}:{m.start}:{m.end}:{m.text}".encode()).hexdigest()[:10]
            yield Candidate(f"repo/{name}/{kind}/{digest}", name, relative, test_file, m)


def candidates(settings: RepoTaskSettings, bases: dict[str, Path]) -> Iterator[Candidate]:
    """The set's candidates in the order they are validated: one from each (project, kind) stream in turn."""
    streams = [_stream(name, kind, settings.seed, bases[name] / "grading", settings.include) for name in settings.projects for kind in settings.kinds]
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


def survey(config: dict, sandbox_root: str, bases: str, project: str, test_file: str, timeout_s: float) -> dict:
    """Run a test file twice on the original; its expected tests passed both times."""
    sandbox = _sandbox(config, sandbox_root)
    grading = Path(bases) / "grading"
    runs = []
    for _ in range(2):
        report = run_tests_guarded(sandbox, grading, {}, (test_file,), PROJECTS[project].pytest_args, timeout_s,
                                   installed_copies(project), _area(sandbox))
        runs.append(report)
        if not report.complete:
            break
    passing = sorted(set.intersection(*({i for i, o in r.outcomes.items() if o == "passed"} for r in runs)))
    complete = all(r.complete and not r.flags for r in runs)
    return {"test_file": test_file, "complete": complete, "passing": passing if complete else [],
            "wall_seconds": max(r.wall_seconds for r in runs), "cpu_seconds": max(r.cpu_seconds for r in runs),
            "status": runs[-1].status,
            "infra_failure": any(r.infra_failure for r in runs), "detail": runs[-1].detail or runs[-1].output[-500:]}


def validate(config: dict, sandbox_root: str, bases: str, candidate: dict, expected: list[str], timeout_s: float) -> dict:
    """The changed file alone: which expected tests fail now."""
    sandbox = _sandbox(config, sandbox_root)
    grading = Path(bases) / "grading"
    mutation = Mutation(**{**candidate["mutation"], "start": tuple(candidate["mutation"]["start"]),
                           "end": tuple(candidate["mutation"]["end"])})
    changed = changed_module((grading / candidate["path"]).read_text(), mutation)
    if changed is None:
        return {"verdict": "rejected", "reason": "mutation does not parse or changes nothing"}
    report: TestReport = run_tests_guarded(sandbox, grading, {candidate["path"]: changed.encode()}, (candidate["test_file"],),
                                           PROJECTS[candidate["project"]].pytest_args, timeout_s,
                                           installed_copies(candidate["project"]), _area(sandbox))
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
            "changed_source": changed, "wall_seconds": report.wall_seconds}


# --- the build -----------------------------------------------------------------------------------


def set_key(settings: RepoTaskSettings) -> str:
    """The cache key of a task set: what decides its candidates and verdicts (not how many are wanted)."""
    decided = {"projects": {name: project_version(name) for name in settings.projects}, "kinds": list(settings.kinds),
               "seed": settings.seed, "max_test_seconds": settings.max_test_seconds, "include": settings.include,
               "engine": ENGINE_VERSION}
    return hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()[:16]


def set_dir(settings: RepoTaskSettings) -> Path:
    return Path(settings.cache_dir).resolve() / "sets" / set_key(settings)


def _file_name(text: str) -> str:
    return text.replace("/", "__")


def _survey_path(bases: Path, test_file: str) -> Path:
    return bases / f"survey-{SURVEY_VERSION}" / f"{_file_name(test_file)}.json"


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
    rejected: Counter = None
    by_project_kind: Counter = None
    seconds: float = 0.0
    resumed: int = 0
    """Verdicts found in the cache (not rerun)."""

    def __post_init__(self):
        self.rejected = self.rejected or Counter()
        self.by_project_kind = self.by_project_kind or Counter()


def _prompt(candidate: Candidate, version: str, fail_to_pass: list[str]) -> str:
    name, m = candidate.project, candidate.mutation
    run = f"python -m pytest {candidate.test_file}"
    rules = ("Do not change the tests or the pytest configuration: they are restored before grading, and a change to them "
             "counts as tampering.")
    if m.kind == "feature":
        return (f"You are working in a checkout of {name} {version} at /sandbox. The function `{m.function}` in "
                f"`{candidate.path}` has no implementation yet: its signature and docstring say what it must do. Implement it "
                f"so that the tests in `{candidate.test_file}` pass (run them with `{run}`). {rules}")
    shown = "\n".join(f"  {i}" for i in fail_to_pass[:8]) + (f"\n  ... and {len(fail_to_pass) - 8} more" if len(fail_to_pass) > 8 else "")
    return (f"You are working in a checkout of {name} {version} at /sandbox. These tests of `{candidate.test_file}` fail:\n"
            f"{shown}\nFind the bug in the library code and fix it (run the tests with `{run}`). {rules}")


def build_repo_tasks(settings: RepoTaskSettings, sandbox: SandboxSection, sandbox_root: Path, workers: int,
                     on_progress: Callable[[BuildReport], None] = lambda report: None) -> BuildReport:
    """Build (or finish building) the task set: at least `num_tasks` validated tasks, or every candidate tried."""
    build = _Build(settings, sandbox, sandbox_root, on_progress)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        build.run(pool, workers)
    _write_index(settings, build.directory, build.ordered, build.verdicts, build.versions, build.bases)
    return build.report


class _Build:
    """One build of a task set: candidates taken in order, each test file surveyed once, candidates validated in
    worker processes; every verdict recorded as it comes (a killed build resumes from them)."""

    def __init__(self, settings: RepoTaskSettings, sandbox: SandboxSection, sandbox_root: Path,
                 on_progress: Callable[[BuildReport], None]):
        self.started = time.monotonic()
        self.settings, self.sandbox_root, self.on_progress = settings, sandbox_root, on_progress
        self.config = sandbox.model_dump()
        cache_dir = Path(settings.cache_dir).resolve()
        self.bases = {name: project_bases(cache_dir, name) for name in settings.projects}
        self.versions = {name: project_version(name) for name in settings.projects}
        self.directory = set_dir(settings)
        (self.directory / "verdicts").mkdir(parents=True, exist_ok=True)
        (self.directory / "layers").mkdir(exist_ok=True)
        _clean_stale_views(sandbox_root)
        self.stream = candidates(settings, self.bases)
        self.ordered: list[Candidate] = []
        self.report = BuildReport()
        self.verdicts: dict[str, dict] = {}
        self.surveys: dict[tuple[str, str], dict] = {}
        self.in_flight: dict[Future, tuple[str, object]] = {}
        self.waiting: dict[tuple[str, str], list[Candidate]] = {}
        """Candidates whose test file's survey is running, by (project, test file)."""

    def next_candidate(self) -> Candidate | None:
        """The next candidate in order (its cached verdict loaded), or None when every one was taken."""
        c = next(self.stream, None)
        if c is not None:
            self.ordered.append(c)
            if found := _read_json(self.directory / "verdicts" / f"{_file_name(c.id)}.json", "verdict"):
                self.verdicts[c.id] = found
                self.report.resumed += 1
        return c

    def survey_of(self, c: Candidate) -> dict | None:
        key = (c.project, c.test_file)
        if key not in self.surveys and (found := _read_json(_survey_path(self.bases[c.project], c.test_file), "cpu_seconds")):
            self.surveys[key] = found
        return self.surveys.get(key)

    def record(self, c: Candidate, verdict: dict) -> None:
        self.verdicts[c.id] = verdict
        if verdict["verdict"] == "infra":
            return  # kept in memory only: retried by the next build
        if verdict["verdict"] == "validated":
            _write_layer(self.directory / "layers" / _file_name(c.id), c.path, verdict["changed_source"])
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
                report.by_project_kind[(c.project, c.mutation.kind)] += 1
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

    def dispatch(self, pool: ProcessPoolExecutor, c: Candidate) -> None:
        """Survey the candidate's test file first if needed, reject it on its survey, or validate it."""
        s = self.survey_of(c)
        if s is None:
            key = (c.project, c.test_file)
            if key not in self.waiting:
                self.waiting[key] = []
                future = pool.submit(survey, self.config, str(self.sandbox_root), str(self.bases[c.project]), c.project,
                                     c.test_file, max(60.0, 3 * self.settings.max_test_seconds))
                self.in_flight[future] = ("survey", key)
            self.waiting[key].append(c)
        elif not s["complete"] or not s["passing"]:
            self.record(c, {"verdict": "rejected", "reason": "test file fails or errs on the original"})
        elif s["cpu_seconds"] > self.settings.max_test_seconds:
            self.record(c, {"verdict": "rejected", "reason": "test file needs more than max_test_seconds of CPU"})
        else:
            future = pool.submit(validate, self.config, str(self.sandbox_root), str(self.bases[c.project]),
                                 {**asdict(c), "mutation": asdict(c.mutation)}, s["passing"], 10 + 3 * s["wall_seconds"])
            self.in_flight[future] = ("validate", c)

    def take(self, pool: ProcessPoolExecutor, kind: str, item, result: dict) -> None:
        """A finished survey (its waiting candidates dispatched) or validation (its verdict recorded)."""
        if kind == "validate":
            self.record(item, result)
        elif result["infra_failure"]:
            for c in self.waiting.pop(item):
                self.record(c, {"verdict": "infra", "reason": "sandbox failure"})
        else:
            atomic_write_text(_survey_path(self.bases[item[0]], item[1]), json.dumps(result))
            self.surveys[item] = result
            for c in self.waiting.pop(item):
                self.dispatch(pool, c)

    def run(self, pool: ProcessPoolExecutor, workers: int) -> None:
        self.tally()
        exhausted = False
        while True:
            # Keep the workers busy with the next candidates in order, while more could still be needed.
            while len(self.in_flight) < 2 * workers and not exhausted and not self.enough():
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


def _write_layer(layer: Path, relative: str, text: str) -> None:
    """The task's changed file in a tree of its own, writable by any uid (the episode's top lower layer)."""
    if layer.is_dir():
        return
    staging = Path(tempfile.mkdtemp(prefix=".layer-", dir=layer.parent))
    try:
        path = staging / relative
        path.parent.mkdir(parents=True)
        path.write_text(text)
        _chmod_tree(staging, 0o666, 0o777)
        os.chmod(staging, 0o755)
        os.rename(staging, layer)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_index(settings: RepoTaskSettings, directory: Path, ordered: list[Candidate], verdicts: dict[str, dict],
                 versions: dict[str, str], bases: dict[str, Path]) -> None:
    """tasks.json: the validated tasks in candidate order (what a task pool loads)."""
    tasks = []
    for c in ordered:
        v = verdicts.get(c.id)
        if v is None or v["verdict"] == "infra":
            break
        if v["verdict"] != "validated":
            continue
        survey_record = json.loads(_survey_path(bases[c.project], c.test_file).read_text())
        tasks.append({"id": c.id, "project": c.project, "version": versions[c.project], "kind": c.mutation.kind,
                      "operator": c.mutation.operator, "path": c.path, "function": c.mutation.function,
                      "description": c.mutation.description, "test_file": c.test_file,
                      "fail_to_pass": v["fail_to_pass"], "pass_to_pass": v["pass_to_pass"],
                      "test_seconds": survey_record["cpu_seconds"],
                      "layer": f"layers/{_file_name(c.id)}", "prompt": _prompt(c, versions[c.project], v["fail_to_pass"])})
    atomic_write_text(directory / "tasks.json", json.dumps({"key": set_key(settings), "versions": versions, "tasks": tasks}))


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
    """The validated tasks of a built set (its first num_tasks)."""
    index = set_dir(settings) / "tasks.json"
    if not index.is_file():
        raise UserError(f"env.tasks: the repo task set is not built yet (no {index}): run `composer env build RECIPE`")
    try:
        tasks = json.loads(index.read_text())["tasks"]
    except (ValueError, KeyError) as e:
        raise UserError(f"env.tasks: {index} is not a task index ({e}); rebuild it with `composer env build RECIPE`") from None
    return tasks[: settings.num_tasks]


def repo_tests(record: dict, settings: RepoTaskSettings) -> RepoTests:
    """A built task's tests, as its workspaces run and grade them."""
    bases = Path(settings.cache_dir).resolve() / "projects" / f"{record['project']}-{record['version']}"
    return RepoTests(
        package=record["project"], test_files=(record["test_file"],), fail_to_pass=tuple(record["fail_to_pass"]),
        pass_to_pass=tuple(record["pass_to_pass"]), pytest_args=PROJECTS[record["project"]].pytest_args,
        layer=set_dir(settings) / record["layer"], episode_base=bases / "episode", grading_base=bases / "grading",
        hidden=installed_copies(record["project"]), timeout_s=max(60.0, 4 * record["test_seconds"]),
        pass_to_pass_policy=settings.pass_to_pass, scope=(Scope(record["path"], (record["function"],)),))



# --- checking a built set -------------------------------------------------------------------------


@dataclass
class RepoCheckReport:
    """`composer env check` on a repository task set: every task's original and changed module, tested again."""

    checked: int = 0
    originals_passing: int = 0
    """Tasks whose original passes every expected test."""
    changed_failing: int = 0
    """Tasks whose changed module fails every fail-to-pass test and passes every pass-to-pass test."""
    failures: list[tuple[str, str]] = None

    def __post_init__(self):
        self.failures = self.failures or []


def check_task(config: dict, sandbox_root: str, tests: RepoTests, path: str) -> tuple[bool, bool, str]:
    """(original passes, changed fails as recorded, why not) for one built task."""
    sandbox = _sandbox(config, sandbox_root)
    run = lambda changes: run_tests_guarded(sandbox, tests.grading_base, changes, tests.test_files, tests.pytest_args,
                                            tests.timeout_s, tests.hidden, _area(sandbox))
    expected = (*tests.fail_to_pass, *tests.pass_to_pass)
    original = run({})
    original_ok = original.complete and not original.flags and all(original.outcomes.get(i) == "passed" for i in expected)
    changed = run({path: (tests.layer / path).read_bytes()})
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
        futures = {pool.submit(check_task, config, str(sandbox_root), repo_tests(r, settings), r["path"]): r["id"] for r in records}
        for future in futures:
            original_ok, changed_ok, why = future.result()
            report.checked += 1
            report.originals_passing += original_ok
            report.changed_failing += changed_ok
            if why:
                report.failures.append((futures[future], why))
            on_task()
    return report
