"""A repository task set's candidates, in order: seeded mutations of the functions a test file names (bug, multi),
removed bodies (feature) and commits of the project's log (history), interleaved over (project, kind)
(`rollout.tasks.repository.build` says how they become tasks)."""

from __future__ import annotations

import fnmatch
import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from composer.recipes.env_schema import RepoTaskSettings
from composer.rollout.tasks.repository.grading_policy import Scope
from composer.rollout.tasks.repository.history import history_commits, is_test_file, parent_text
from composer.rollout.tasks.repository.mutations import Mutation, mutations
from composer.rollout.tasks.repository.projects import ProjectSpec, resolve_projects


@dataclass(frozen=True)
class Edit:
    """One file of a task's change: a seeded change of the base's file (`mutations`, all in other functions),
    or its new text (a history task: the parent's version)."""

    path: str
    mutations: tuple[Mutation, ...] = ()
    text: str | None = None
    functions: tuple[str, ...] = ()
    """A history task's functions in this file (the others' are their mutations' functions)."""

    @property
    def scope(self) -> Scope:
        """What grading takes of this file: its functions."""
        return Scope(self.path, self.functions or tuple(m.function for m in self.mutations))


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
    refused: str = ""
    """Why it cannot be a task, known before any test runs ("" when it may be): `env build` rejects it with this."""

    @property
    def mutations(self) -> tuple[Mutation, ...]:
        return tuple(m for e in self.edits for m in e.mutations)

    @property
    def operator(self) -> str:
        return "commit" if self.kind == "history" else "+".join(m.operator for m in self.mutations)

    @property
    def function(self) -> str:
        return ", ".join(f for e in self.edits for f in e.scope.functions)

    @property
    def description(self) -> str:
        if self.kind == "history":
            return f"commit {self.base[:12]}: {self.statement.splitlines()[0] if self.statement else ''}"
        return "; ".join(m.description for m in self.mutations)


def _test_file_for(module: str, spec: ProjectSpec, root: Path) -> str | None:
    """A module's test file: `<module dir>/tests/test_<module>.py` (ready-made), else the first `test_<module>.py`
    under the project's test paths (a private module `_parser.py` is tested by `test_parser.py` as often as by
    `test__parser.py`)."""
    stem = PurePosixPath(module).stem
    if not spec.test_paths:
        test = PurePosixPath(module).parent / "tests" / f"test_{stem}.py"
        return str(test) if (root / test).is_file() else None
    for name in dict.fromkeys([f"test_{stem}.py", f"test_{stem.lstrip('_')}.py"]):
        for test_path in spec.test_paths:
            found = sorted(str(p.relative_to(root)) for p in (root / test_path).rglob(name))
            if found:
                return found[0]
    return None


SITES_PER_MODULE = {"bug": 4, "feature": 2, "multi": 2}
"""Candidates taken from one module per pass over a project's modules: tasks spread over the whole project."""


def _modules(spec: ProjectSpec, kind: str, seed: int, root: Path, include: list[str]) -> list[tuple[str, str]]:
    """(module, its test file) of the project's packages, in a seeded order."""
    modules = []
    for module in sorted(m for package in spec.packages for m in (root / package).rglob("*.py")):
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
        edits = tuple(Edit(path, text=parent_text(spec, commit, path), functions=f) for path, f in zip(paths, commit.functions))
        yield Candidate(
            f"repo/{spec.name}/history/{commit.commit[:12]}",
            spec.name,
            "history",
            edits,
            commit.test_files,
            base=commit.commit,
            statement=commit.message,
            refused=f"history commit changes code outside functions: {commit.outside}" if commit.outside else "",
        )


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
