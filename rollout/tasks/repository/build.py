"""Repository tasks: a real Python project with its own test suite, in which a change was made that the agent must
undo (*bug*: a seeded semantic mutation of a function; *multi*: several at once, in different functions or files;
*history*: a commit of the project's log with its source change taken out, `rollout.tasks.repository.history`) or
complete (*feature*: a function's body removed, its signature and docstring kept).

Projects (`rollout.tasks.repository.projects`): the ready-made ones ship their test suites inside their installed
packages (no checkout, no network) and are pure Python, so a mutation changes behaviour the tests can see, the
tests need no compiler, and many files run in about a second:
  networkx   about 265 test files; deterministic (seeded random graphs), no hidden state between tests;
  sympy      about 610 test files; deterministic once its `slow` tests are left out (`-m "not slow"`) and files
             using hypothesis (random examples) are skipped.
numpy, numba and matplotlib also ship tests but are mostly compiled code (a mutation of their Python layer rarely
reaches the tests, and their suites are slow); mpmath's 31 files are few. A user's own project (a directory or a git
checkout at a pinned commit) runs its tests in a virtual environment of its own, made once per digest.

How a task set is built (`build_repo_tasks`, `composer env build`):
  1. each project's files are copied twice (`rollout.tasks.repository.workspace`: episode and grading bases; a
     history task's base is its commit's tree) and its environment made;
  2. candidates: for each module `pkg/.../mod.py` with a test file (`pkg/.../tests/test_mod.py`, or `test_mod.py`
     under a user project's test paths), every mutation site of its functions named in that test file (bug kinds:
     comparison, boundary (off by one), operator, negated condition, removed branch, constant), every function
     with a docstring and a body of 3+ statements (feature), seeded combinations of sites (multi), and the commits
     that changed source and tests together (history); shuffled by the seed, interleaved over (project, kind);
  3. each test file used is surveyed per base: run twice on the original (in the sandbox, through the guarded runner
     the grader uses); its *expected* tests are those that passed both times; a file that needs more CPU time than
     `max_test_seconds` (CPU, not wall time: the same on a busy host) or has no passing test is not used;
  4. a candidate is validated: its changed files alone, its test files run again; fail-to-pass = expected tests
     that now fail (at least one), pass-to-pass = those still passing; then across the grading boundary, as episodes
     are graded: the original must pass every expected test there and the change fail exactly its fail-to-pass ones
     (a history commit whose change is not all in functions is rejected before any test runs).
Everything is cached under `cache_dir`, keyed by the settings that decide the set and the projects' digests; each
survey and each candidate's verdict is its own atomically written file, so a killed build resumes where it
stopped, and the set (the first `num_tasks` validated candidates in candidate order) is the same for any number of
workers. The unchanged original stays out of reach of episodes: every installed copy of a ready-made project
(`sandbox.installed_copies`) is hidden in the sandbox, a user's project is not installed in its environment, and the
workspace's copy is first on sys.path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

from composer.recipes.env_schema import RepoTaskSettings, SandboxSection
from composer.recipes.errors import UserError
from composer.recipes.schema import SSHSection
from composer.rollout.sandbox.hosts import LOCALHOST, SandboxFleet
from composer.rollout.tasks.repository.candidates import Candidate, candidates
from composer.rollout.tasks.repository.projects import (
    ProjectSpec,
    _chmod_tree,
    environment_dir,
    project_environment,
    resolve_projects,
)
from composer.rollout.tasks.repository.projects import project_bases as _bases_of
from composer.rollout.tasks.repository.surveys import Runners, TestSetup, changed_files
from composer.rollout.tasks.workspace import views_area
from composer.runtime.run_dir import atomic_write_text

log = logging.getLogger("composer.repo_tasks")

# Bump when candidates, validation or records change: it is part of every set's cache key.
ENGINE_VERSION = 8
# Bump when a survey's record or the runner that makes it changes.
SURVEY_VERSION = 1


# --- the build -----------------------------------------------------------------------------------


def set_key(settings: RepoTaskSettings, specs: dict[str, ProjectSpec] | None = None) -> str:
    """The cache key of a task set: what decides its candidates and verdicts (not how many are wanted)."""
    specs = specs or resolve_projects(settings)
    decided = {
        "projects": {name: f"{spec.digest}/{spec.tests_key}" for name, spec in specs.items()},
        "kinds": list(settings.kinds),
        "seed": settings.seed,
        "max_test_seconds": settings.max_test_seconds,
        "include": settings.include,
        "engine": ENGINE_VERSION,
    }
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
    """Candidates rejected, by "project: reason"."""
    by_project_kind: Counter = field(default_factory=Counter)
    """Validated tasks per (project, kind)."""
    tried_by_project_kind: Counter = field(default_factory=Counter)
    """Candidates decided per (project, kind)."""
    rejected_by_project_kind: Counter = field(default_factory=Counter)
    """Rejections per (project, kind, reason)."""
    seconds: float = 0.0
    resumed: int = 0
    """Verdicts found in the cache (not rerun)."""
    host_runs: dict = field(default_factory=dict)
    """Surveys and validations run on each sandbox host."""


RULES = "Do not change the tests or the pytest configuration: they are restored before grading, and a change to them counts as tampering."


def _shown(ids: list[str]) -> str:
    return "\n".join(f"  {i}" for i in ids[:8]) + (f"\n  ... and {len(ids) - 8} more" if len(ids) > 8 else "")


def _prompt(c: Candidate, version: str, fail_to_pass: list[str]) -> str:
    """What the agent is shown (README: per kind): the problem, how to run the tests, and which of them fail."""
    where = f"You are working in a checkout of {c.project} {c.base[:12] if c.base else version} at /sandbox."
    tests = " ".join(c.test_files)
    run = f"python -m pytest {tests}"
    if c.kind == "feature":
        (m,) = c.mutations
        return (
            f"{where} The function `{m.function}` in `{c.edits[0].path}` has no implementation yet: its signature and "
            f"docstring say what it must do. Implement it so that the tests in `{tests}` pass (run them with `{run}`). {RULES}"
        )
    if c.kind == "history":
        functions = "\n".join(f"  {e.path}: {', '.join(e.functions)}" for e in c.edits)
        return (
            f"{where} Resolve this issue:\n\n{c.statement}\n\nThese tests fail until it is resolved:\n{_shown(fail_to_pass)}\n"
            f"Make the change in these functions (only they are graded, with the helpers and imports they use; a function "
            f"listed that does not exist yet is one to add):\n{functions}\nRun the tests with `{run}`. {RULES}"
        )
    several = " (there is more than one bug, in different functions)" if c.kind == "multi" else ""
    return (
        f"{where} These tests of `{tests}` fail:\n{_shown(fail_to_pass)}\nFind the bug{'s' if several else ''} in the "
        f"library code{several} and fix {'them' if several else 'it'} (run the tests with `{run}`). {RULES}"
    )


def build_repo_tasks(
    settings: RepoTaskSettings,
    sandbox: SandboxSection,
    sandbox_root: Path,
    workers: int,
    on_progress: Callable[[BuildReport], None] = lambda report: None,
    ssh: SSHSection | None = None,
) -> BuildReport:
    """Build (or finish building) the task set: at least `num_tasks` validated tasks, or every candidate tried; the
    surveys and validations spread over `workers` processes here (when localhost is among the sandbox's hosts) and
    the sandbox's remote hosts (reached with `ssh`, or started by SLURM: those up when the build starts)."""
    build = _Build(settings, sandbox, sandbox_root, on_progress)
    remote = [name for name in sandbox.hosts if name != LOCALHOST]
    fleet = SandboxFleet(sandbox, ssh or SSHSection(), root=sandbox_root) if remote or sandbox.slurm else None
    try:
        runners = Runners(sandbox, sandbox_root, workers, fleet)
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
    return TestSetup(spec.name, spec.pytest_args, spec.hidden, environment.run_environment() if environment else None, spec.packages)


class _Build:
    """One build of a task set: each project's environment made (once per digest), candidates taken in order, each
    test file surveyed once per base, candidates validated in worker processes; every verdict recorded as it comes
    (a killed build resumes from them)."""

    def __init__(self, settings: RepoTaskSettings, sandbox: SandboxSection, sandbox_root: Path, on_progress: Callable[[BuildReport], None]):
        self.started = time.monotonic()
        self.settings, self.sandbox_root, self.on_progress = settings, sandbox_root, on_progress
        self.config = sandbox.model_dump()
        self.cache_dir = Path(settings.cache_dir).resolve()
        self.specs = resolve_projects(settings)
        self.bases = {name: _bases_of(self.cache_dir, spec) for name, spec in self.specs.items()}
        sandbox_root.mkdir(parents=True, exist_ok=True)
        self.setups = {
            name: _setup_of(spec, project_environment(self.cache_dir, spec, sandbox, sandbox_root)) for name, spec in self.specs.items()
        }
        self.directory = set_dir(settings, self.specs)
        (self.directory / "verdicts").mkdir(parents=True, exist_ok=True)
        (self.directory / "layers").mkdir(exist_ok=True)
        views_area(sandbox_root)  # reclaims what killed builds left
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
        if key not in self.surveys and (
            found := _read_json(_survey_path(self.bases_of(c), self.specs[c.project], test_file), "cpu_seconds")
        ):
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
        report.tried_by_project_kind, report.rejected_by_project_kind = Counter(), Counter()
        for c in self.ordered:
            if c.id not in self.verdicts or report.validated >= self.settings.num_tasks:
                continue
            v = self.verdicts[c.id]
            report.tried += 1
            report.tried_by_project_kind[(c.project, c.kind)] += 1
            if v["verdict"] == "validated":
                report.validated += 1
                report.by_project_kind[(c.project, c.kind)] += 1
            else:
                report.rejected[v["reason"]] += 1
                report.rejected_by_project_kind[(c.project, c.kind, v["reason"])] += 1
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

    def dispatch(self, pool: Runners, c: Candidate) -> None:
        """Survey the candidate's test files first where needed, reject it on a survey, or validate it."""
        if c.refused:
            self.record(c, {"verdict": "rejected", "reason": c.refused.partition(" (")[0], "detail": c.refused})
            return
        missing = [t for t in c.test_files if self.survey_of(c, t) is None]
        if missing:
            for test_file in missing:
                key = (c.project, c.base, test_file)
                if key not in self.waiting:
                    self.waiting[key] = []
                    future = pool.submit(
                        "survey", self.bases_of(c), self.setups[c.project], test_file, max(60.0, 3 * self.settings.max_test_seconds)
                    )
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
            future = pool.submit(
                "validate",
                self.bases_of(c),
                self.setups[c.project],
                changed,
                c.test_files,
                expected,
                10 + 3 * sum(s["wall_seconds"] for s in surveys),
                tuple(e.scope for e in c.edits),
            )
            self.in_flight[future] = ("validate", c)

    def take(self, pool: Runners, kind: str, item, result: dict) -> None:
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

    def run(self, pool: Runners) -> None:
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
                raise UserError(
                    f"env.tasks: project {name}: its tests fail on the original ({len(mine)} test file(s) "
                    f"surveyed at {spec.version}, none passes; e.g. {worst['test_file']}: {worst['status']}, "
                    f"{worst['detail'].strip().splitlines()[-1] if worst['detail'].strip() else 'no test passed'})"
                )


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


def build_counts(report: BuildReport) -> list[dict]:
    """Per project and kind: candidates tried, validated, and rejected by reason (the set's index keeps them)."""
    return [
        {
            "project": project,
            "kind": kind,
            "tried": tried,
            "validated": report.by_project_kind[(project, kind)],
            "rejected": {
                reason: count for (p, k, reason), count in report.rejected_by_project_kind.most_common() if (p, k) == (project, kind)
            },
        }
        for (project, kind), tried in sorted(report.tried_by_project_kind.items())
    ]


def _holds_more(index: Path, ids: list[str]) -> bool:
    """The set's index already lists `ids` first and more tasks after them (candidates and verdicts are the same for
    any num_tasks: the index of a larger build serves a smaller one as its first tasks)."""
    found = _read_json(index, "tasks")
    listed = [t.get("id") for t in found["tasks"] if isinstance(t, dict)] if found and isinstance(found["tasks"], list) else []
    return len(listed) > len(ids) and listed[: len(ids)] == ids


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
        tasks.append(
            {
                "id": c.id,
                "project": c.project,
                "version": spec.version,
                "kind": c.kind,
                "operator": c.operator,
                "path": c.edits[0].path,
                "paths": [e.path for e in c.edits],
                "function": c.function,
                "scope": [[e.path, list(e.scope.functions)] for e in c.edits],
                "description": c.description,
                "test_file": c.test_files[0],
                "test_files": list(c.test_files),
                "base": c.base,
                "fail_to_pass": v["fail_to_pass"],
                "pass_to_pass": v["pass_to_pass"],
                "test_seconds": seconds,
                "layer": f"layers/{_file_name(c.id)}",
                "prompt": _prompt(c, spec.version, v["fail_to_pass"]),
            }
        )
    if _holds_more(build.directory / "tasks.json", [t["id"] for t in tasks]):
        return  # an earlier build of the same set went further: a smaller num_tasks never shrinks the index
    projects = {
        name: {
            "packages": list(spec.packages),
            "pytest_args": list(spec.pytest_args),
            "ready_made": spec.settings is None,
            "digest": spec.digest,
            "environment": str(environment_dir(build.cache_dir, spec)) if spec.settings is not None else None,
        }
        for name, spec in build.specs.items()
    }
    atomic_write_text(
        build.directory / "tasks.json",
        json.dumps(
            {
                "key": build.directory.name,
                "projects": projects,
                "versions": {n: s.version for n, s in build.specs.items()},
                "build": build_counts(build.report),
                "tasks": tasks,
            }
        ),
    )
