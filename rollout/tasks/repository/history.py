"""History tasks: commits of a project's git log that changed its source and its tests together.

The task of a commit is its own tree with the commit's source change taken out: the parent's version of every source
file the commit modified, the commit's tests kept (SWE-bench and its successors do the same with a pull request's
change and its tests). The build runs the commit's test files on the commit's tree (its expected tests passed both
times) and again with the parent's source: fail-to-pass are the expected tests that fail then, pass-to-pass the rest.
The problem statement is the commit message.

A history task is graded like the others, across the grading boundary by functions: its scope is, in each source file,
the functions whose source the commit changed (new ones included: `grading_policy.function_scope`). A commit that
changes anything else in a file (module-level code other than imports, a class body outside its methods, a deleted
function, a new class) cannot be graded that way: its candidate carries the reason (`HistoryCommit.outside`) and
`env build` rejects it. A file whose syntax tree the commit left as it was (comments, formatting) is not handed back.

A commit is a candidate when, along its first-parent line, it modified `.py` files of the project's packages (only
modified: a commit that adds, deletes or renames a source file has no parent version of it to hand back) and added
or modified test files under the project's test paths.
"""

from __future__ import annotations

import ast
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from composer.rollout.tasks.repository.grading_policy import function_scope, import_path, is_protected
from composer.rollout.tasks.repository.projects import ProjectSpec


@dataclass(frozen=True)
class HistoryCommit:
    commit: str
    parent: str
    message: str
    sources: tuple[str, ...]
    """Source files the commit modified (the task hands back their parent versions)."""
    test_files: tuple[str, ...]
    """Test files the commit added or modified (the task keeps them)."""
    functions: tuple[tuple[str, ...], ...] = ()
    """Per source file, the functions the commit changed or added (the task's scope)."""
    outside: str = ""
    """What the commit changes outside functions ("what (path: where)"), "" when nothing: a candidate it refuses."""


def _git(checkout: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=True).stdout


def is_test_file(relative: str, test_paths: tuple[str, ...]) -> bool:
    path = PurePosixPath(relative)
    in_tests = any(path.is_relative_to(t) for t in test_paths)
    return in_tests and path.suffix == ".py" and (path.name.startswith("test_") or path.stem.endswith("_test"))


def _changes(checkout: Path, parent: str, commit: str) -> list[tuple[str, str]]:
    """(status letter, path) of every file the commit changed (renames as a delete and an add)."""
    fields = _git(checkout, "diff", "--no-renames", "--name-status", "-z", parent, commit).split("\0")
    return [(fields[i][0], fields[i + 1]) for i in range(0, len(fields) - 1, 2)]


def commit_of(spec: ProjectSpec, commit: str, parent: str) -> HistoryCommit | None:
    """The commit as a history task's origin, or None when it does not change source and tests together."""
    sources, tests = [], []
    for status, path in _changes(spec.checkout, parent, commit):
        inside = import_path(path, spec.packages)  # relative to its package's directory: `mylib/core.py`
        if is_test_file(path, spec.test_paths):
            if status in "AM":
                tests.append(path)
        elif inside is not None and path.endswith(".py") and not is_protected(str(inside)):
            if status != "M":
                return None
            sources.append(path)
    if not sources or not tests:
        return None
    message = _git(spec.checkout, "log", "-1", "--format=%B", commit).strip()
    kept, functions, outside = [], [], ""
    for path in sorted(sources):
        before, after = _git(spec.checkout, "show", f"{parent}:{path}"), _git(spec.checkout, "show", f"{commit}:{path}")
        changed, what = function_scope(before, after)
        if not changed and not what:
            if _same_tree(before, after):
                continue  # comments or formatting only: the commit's version is the parent's
            what = "imports alone"
        kept.append(path)
        functions.append(changed)
        if what and not outside:
            kind, _, where = what.partition(" (")
            outside = f"{kind} ({path}" + (f": {where}" if where else ")")
    if not kept:
        return None
    return HistoryCommit(commit, parent, message, tuple(kept), tuple(sorted(tests)), tuple(functions), outside)


def _same_tree(before: str, after: str) -> bool:
    try:
        return ast.dump(ast.parse(before)) == ast.dump(ast.parse(after))
    except (SyntaxError, ValueError):
        return False


def history_commits(spec: ProjectSpec, limit: int, seed: int) -> Iterator[HistoryCommit]:
    """The candidate commits among the last `limit` of the first-parent log up to the pinned commit, in a
    seeded order (each one's diff read only when the stream reaches it)."""
    lines = _git(spec.checkout, "log", "--first-parent", f"-n{limit}", "--format=%H %P", spec.commit).splitlines()
    pairs = [(fields[0], fields[1]) for fields in (line.split() for line in lines) if len(fields) >= 2]
    random.Random(f"{seed}/{spec.name}/history").shuffle(pairs)
    for commit, parent in pairs:
        found = commit_of(spec, commit, parent)
        if found is not None:
            yield found


def parent_text(spec: ProjectSpec, history: HistoryCommit, path: str) -> str:
    return _git(spec.checkout, "show", f"{history.parent}:{path}")
