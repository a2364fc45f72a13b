"""What of an episode's change reaches a repository task's grade.

Every task names the functions it asks for (`Scope`), and grading takes only those: the episode's version of each is
spliced into the task's module, with the imports, functions, classes and names it adds at module level that they use
(`splice`); that module runs in the episode's own process, across the grading boundary from the tests
(`rollout.tasks.repository.boundary`). Of the rest:
  * only source: bytecode and compiled modules (`__pycache__`, .pyc, .so) are never taken, nor symlinks, FIFOs or
    other non-regular files (the task's own file is graded there);
  * every other change (other functions, other files, new files) is dropped, and named (`change_dropped`) when it
    would have changed what the tests see (a comment, a blank line or an import would not);
  * changes to tests and to the files pytest or Python load by themselves are never taken (`tests_modified`).
A history task's functions are those its commit changed (`function_scope`).
"""

from __future__ import annotations

import ast
import copy
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

# Names pytest or Python load on their own from a directory: never taken from an episode.
PROTECTED_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        "pyproject.toml",
        "setup.cfg",
        "tox.ini",
        "setup.py",
        "sitecustomize.py",
        "usercustomize.py",
        "__main__.py",
    }
)
# Top-level modules an episode could shadow for the test run (beyond the standard library's).
SHADOWED = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "hypothesis", "_hypothesis_pytestplugin"})
COMPILED_SUFFIXES = frozenset({".pyc", ".pyo", ".so", ".pyd", ".dylib"})


class _NotAFile:
    """A symlink, a path through one, or something other than a regular file (a FIFO, a device): never read by
    the grader (which runs as root on the host) and never graded."""

    def __repr__(self) -> str:
        return "NOT_A_FILE"


NOT_A_FILE = _NotAFile()


@dataclass(frozen=True)
class Scope:
    """A file a repository task is about, and the functions in it the task asks to change."""

    path: str
    functions: tuple[str, ...] = ()
    """Qualified names (`f`, `Class.method`) as `definitions` yields them. (Sets built before every kind named its
    functions had () here for a history task's whole file: `task_set.repo_tests` refuses them.)"""


@dataclass(frozen=True)
class KeptChange:
    """What grading takes from an episode (`keep_change`), and what it left out or refused."""

    files: dict[str, bytes | None] = field(default_factory=dict)
    """Path -> the bytes grading writes over the grading base (None: deleted): the task's own files, with the kept
    change in them."""
    dropped: tuple[str, ...] = ()
    """Changes left out that would have changed what the tests see (flagged `change_dropped`)."""
    protected: tuple[str, ...] = ()
    """Tests and test-run configuration the episode changed (ignored; flagged `tests_modified`)."""


def is_protected(relative: str) -> bool:
    """Whether a path of the workspace belongs to the test run rather than the program: tests, pytest's
    configuration, files Python loads by itself, top-level modules that would shadow pytest or the stdlib."""
    parts = PurePosixPath(relative).parts
    name = parts[-1]
    if name in PROTECTED_NAMES or name.endswith(".pth"):
        return True
    if any(p in ("tests", "testing") for p in parts[:-1]) or name.startswith("test_") or name.endswith("_test.py"):
        return True
    top = parts[0].removesuffix(".py")
    return top in SHADOWED or top in sys.stdlib_module_names


def is_compiled(relative: str) -> bool:
    """Bytecode or a compiled module: what Python would load instead of (or without) a source file."""
    path = PurePosixPath(relative)
    return "__pycache__" in path.parts or path.suffix in COMPILED_SUFFIXES or ".cpython-" in path.name


def package_of(path: str, packages: tuple[str, ...]) -> str | None:
    """Which of a project's packages (directories relative to its root: `mylib`, `src/mylib`) holds `path`."""
    return next((p for p in packages if PurePosixPath(path).is_relative_to(p)), None)


def import_path(path: str, packages: tuple[str, ...]) -> PurePosixPath | None:
    """`path` as Python finds it: relative to the directory of the package that holds it (`src/mylib/x.py` ->
    `mylib/x.py`), None when no package does."""
    package = package_of(path, packages)
    return None if package is None else PurePosixPath(path).relative_to(PurePosixPath(package).parent)


def package_sources(packages: tuple[str, ...]) -> tuple[str, ...]:
    """The directories holding the packages, each once (`src`; "" for the project root): what goes on sys.path."""
    return tuple(dict.fromkeys("" if (parent := str(PurePosixPath(p).parent)) == "." else parent for p in packages))


def keep_change(
    changed: dict[str, bytes | None | _NotAFile],
    task_files: dict[str, bytes | None],
    grading_base: Path,
    packages: tuple[str, ...],
    scope: tuple[Scope, ...],
) -> KeptChange:
    """The part of an episode's `changed` files (path -> new bytes, None when gone) that grading takes: the task's
    own files `task_files` (over the trusted `grading_base`) with the episode's version of the `scope`'s functions."""
    files = dict(task_files)
    dropped, protected = [], []
    by_path = {s.path: s for s in scope}

    def trusted(path: str) -> bytes | None:
        """The task's state of a file (its own file, else the grading base's)."""
        if path in task_files:
            return task_files[path]
        base = grading_base / path
        return base.read_bytes() if base.is_file() and not base.is_symlink() else None

    for path, content in sorted(changed.items(), key=lambda item: item[0]):
        if is_compiled(path):
            dropped.append(f"{path}: bytecode or a compiled module (only source is graded)")
            continue
        if is_protected(path):
            protected.append(path)
            continue
        in_package = package_of(path, packages) is not None
        entry = by_path.get(path)
        if entry is None or not entry.functions:
            if in_package and _changes_behaviour(content, trusted(path), path):
                dropped.append(f"{path}: outside the task's {_describe(scope)}")
            continue
        if content is NOT_A_FILE:
            dropped.append(f"{path}: not a regular file (graded as the task left it)")
            continue
        base_text = trusted(path)
        if content is None or base_text is None:
            dropped.append(f"{path}: deleted (graded as the task left it)")
            continue
        text, notes = splice(base_text.decode(errors="replace"), content.decode(errors="replace"), entry.functions)
        files[path] = text.encode()
        dropped += [f"{path}: {note}" for note in notes]
    return KeptChange(files, tuple(dropped), tuple(protected))


def _describe(scope: tuple[Scope, ...]) -> str:
    return "function(s) " + "; ".join(f"{s.path}:{','.join(s.functions)}" for s in scope)


def _changes_behaviour(content: bytes | None | _NotAFile, trusted: bytes | None, path: str) -> bool:
    """Whether taking `content` instead of `trusted` could change what the tests see (source: its syntax tree)."""
    if not isinstance(content, bytes) or not isinstance(trusted, bytes):
        return True
    if not path.endswith(".py"):
        return True
    try:
        return ast.dump(ast.parse(content)) != ast.dump(ast.parse(trusted))
    except (SyntaxError, ValueError):
        return True


# --- splicing the task's functions ----------------------------------------------------------------

Definition = ast.FunctionDef | ast.AsyncFunctionDef


def definitions(tree: ast.Module) -> Iterator[tuple[str, Definition, ast.stmt]]:
    """Module- and class-level functions: (qualified name, node, the module-level statement holding it)."""

    def walk(body: list[ast.stmt], prefix: str, top: ast.stmt | None):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + node.name, node, top or node
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{prefix}{node.name}.", top or node)

    yield from walk(tree.body, "", None)


def _first_line(node: ast.stmt) -> int:
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])


def _segment(lines: list[str], node: ast.stmt) -> list[str]:
    return lines[_first_line(node) - 1 : node.end_lineno]


def _bound_names(tree: ast.Module) -> set[str]:
    """Names the module binds at its top level (in compound statements too, not inside functions or classes)."""
    names = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        pending.extend(ast.iter_child_nodes(node))
    return names


def _added(episode: ast.Module, trusted: ast.Module, taken: list[ast.stmt], wanted: set[str]) -> list[ast.stmt]:
    """What the episode adds at module level that grading keeps with the taken functions: imports, functions,
    classes and assignments of names the trusted module does not bind, that those functions use (or what they use
    uses), and the new functions `wanted` (a history commit's)."""
    imports = {ast.dump(n) for n in trusted.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    bound = _bound_names(trusted)
    candidates = {}
    for node in episode.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if ast.dump(node) not in imports and not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                candidates[id(node)] = (node, {(a.asname or a.name).split(".")[0] for a in node.names})
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name not in bound:
            candidates[id(node)] = (node, {node.name})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id not in bound for t in targets):
                candidates[id(node)] = (node, {t.id for t in targets})
    used = {n.id for node in taken for n in ast.walk(node) if isinstance(n, ast.Name)} | wanted
    kept: set[int] = set()
    while True:
        more = {key for key, (node, names) in candidates.items() if key not in kept and names & used}
        if not more:
            break
        kept |= more
        used |= {n.id for key in more for n in ast.walk(candidates[key][0]) if isinstance(n, ast.Name)}
    return [node for node in episode.body if id(node) in kept]


def _outside(tree: ast.Module, taken: set[str], added: list[ast.stmt]) -> list[tuple[str, str]]:
    """The module's statements other than imports, docstrings, the taken functions and the added statements (what
    the splice leaves alone), as (syntax-tree dump, where it is): a class holding taken methods as its shell, its
    other members, and its end."""
    removed = {id(n) for n in added}

    def shape(body: list[ast.stmt], prefix: str) -> list[tuple[str, str]]:
        out = []
        where = f"a class body ({prefix[:-1]}, " if prefix else "module-level code ("
        first = True
        for node in body:
            if id(node) in removed or isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            docstring = first and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            first = False
            if docstring:
                continue  # not code (the splice keeps the task's own)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and prefix + node.name in taken:
                continue
            name = prefix + getattr(node, "name", "")
            if isinstance(node, ast.ClassDef) and any(t.startswith(f"{name}.") for t in taken):
                shell = copy.copy(node)
                shell.body = []
                out += [
                    (ast.dump(shell), f"a class body ({name})"),
                    *shape(node.body, f"{name}."),
                    (f"end {name}", f"a class body ({name})"),
                ]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((ast.dump(node), f"moved definitions ({name})"))
            elif isinstance(node, ast.ClassDef):
                out.append((ast.dump(node), f"a class body ({name})"))
            else:
                out.append((ast.dump(node), f"{where}line {node.lineno})"))
        return out

    return shape(tree.body, "")


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    """Module- and class-level classes by qualified name."""
    found = {}
    pending: list[tuple[str, list[ast.stmt]]] = [("", tree.body)]
    while pending:
        prefix, body = pending.pop()
        for node in body:
            if isinstance(node, ast.ClassDef):
                found[prefix + node.name] = node
                pending.append((f"{prefix}{node.name}.", node.body))
    return found


def splice(trusted: str, episode: str, functions: tuple[str, ...]) -> tuple[str, list[str]]:
    """The trusted module with the episode's version of `functions` (those it lacks added: a history commit's new
    functions, top-level or in an existing class) and what it adds at module level for them (`_added`); and what it
    left out that would change the module."""
    try:
        mine = ast.parse(episode)
    except (SyntaxError, ValueError) as e:
        return trusted, [f"does not parse ({type(e).__name__}: line {getattr(e, 'lineno', '?')}): graded as the task left it"]
    theirs = ast.parse(trusted)
    mine_defs = {name: (node, top) for name, node, top in definitions(mine)}
    their_defs = {name: (node, top) for name, node, top in definitions(theirs)}
    their_classes = _classes(theirs)
    lines, episode_lines = trusted.splitlines(keepends=True), episode.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    if episode_lines and not episode_lines[-1].endswith("\n"):
        episode_lines[-1] += "\n"
    notes, taken, new_top, replacements = [], set(), set(), []
    for name in functions:
        if name not in mine_defs:
            continue  # gone from the episode's file: the task's own version stays (the file's comparison names it)
        node = mine_defs[name][0]
        owner = name.rpartition(".")[0]
        if name in their_defs:
            their_node = their_defs[name][0]
            if node.col_offset == their_node.col_offset:
                taken.add(name)
                replacements.append((_first_line(their_node), their_node.end_lineno, _segment(episode_lines, node)))
        elif not owner:
            taken.add(name)
            new_top.add(name)  # kept with what the episode adds at module level
        elif owner in their_classes and node.col_offset == their_classes[owner].body[0].col_offset:
            taken.add(name)
            end = their_classes[owner].end_lineno
            replacements.append((end + 1, end, ["\n", *_segment(episode_lines, node)]))
    added = _added(mine, theirs, [mine_defs[n][0] for n in taken], new_top)
    if added:
        tops = [their_defs[n][1] for n in taken if n in their_defs]
        at = _first_line(min(tops, key=lambda top: top.lineno)) if tops else len(lines) + 1
        block = [line for node in added for line in [*_segment(episode_lines, node), "\n", "\n"]]
        replacements.append((at, at - 1, block if tops else ["\n", "\n", *block]))
    for start, end, new in sorted(replacements, key=lambda r: (r[0], r[1]), reverse=True):
        lines[start - 1 : end] = new
    if [d for d, _ in _outside(mine, taken, added)] != [d for d, _ in _outside(theirs, taken, [])]:
        kept = ", ".join(sorted(taken)) or "nothing"
        notes.append(
            f"changes outside {', '.join(functions)} dropped (kept: {kept}" + (" and what it adds at module level)" if added else ")")
        )
    return ("".join(lines) if taken else trusted), notes


def function_scope(parent: str, commit: str) -> tuple[tuple[str, ...], str]:
    """What a commit changed in a module: the functions (`definitions`' qualified names) whose source differs between
    the parent's text and the commit's, new ones included, in the commit's order; and what else it changed, "" when
    nothing (imports aside): then grading the commit's version of those functions is grading the commit. What else
    is "what (where)": a deleted function, a new class, a class body, module-level code, moved definitions."""
    try:
        old, new = ast.parse(parent), ast.parse(commit)
    except (SyntaxError, ValueError):
        return (), "a module that does not parse"
    before = {name: ast.dump(node) for name, node, _ in definitions(old)}
    after = {name: ast.dump(node) for name, node, _ in definitions(new)}
    if gone := [name for name in before if name not in after]:
        return (), f"a deleted function ({gone[0]})"
    if born := [name for name in _classes(new) if name not in _classes(old)]:
        return (), f"a new class ({born[0]})"
    changed = tuple(name for name in after if before.get(name) != after[name])
    shapes = _outside(old, set(changed), []), _outside(new, set(changed), [])
    for mine, theirs in zip([*shapes[0], None], [*shapes[1], None]):
        if mine != theirs and (mine is None or theirs is None or mine[0] != theirs[0]):
            return (), (theirs or mine or ("", "module-level code"))[1]
    return changed, ""
