"""The layering docs/architecture.md states, read from the code's own imports (every import, lazy ones included):
`cli -> rl -> {trainer, data, rollout, sync} -> cluster -> runtime -> recipes`, trainer and rollout apart,
and no two modules importing each other, directly or around a circle; inside rollout, the floors of its rooms."""

import ast
from pathlib import Path

from tests.conftest import REPO

LAYER = {"cli": 5, "rl": 4, "trainer": 3, "data": 3, "rollout": 3, "sync": 3, "cluster": 2, "runtime": 1, "recipes": 0}
APART = {("trainer", "rollout"), ("rollout", "trainer"), ("sync", "trainer"), ("sync", "rollout"), ("trainer", "sync"), ("rollout", "sync")}

ROLLOUT_BELOW = {
    "agent": {"tasks", "sandbox", "engines"},
    "sandbox_host": {"tasks", "sandbox"},
    "tasks": {"sandbox"},
    "sandbox": set(),
    "engines": set(),
}
"""Inside rollout, what each room may import: the agent over tasks (the repository room included) over the sandbox;
the sandbox hosts' server program (`rollout.sandbox_host`) above the tasks and the sandbox it serves; the engines
apart (only the agent, which drives them, imports them)."""


def _modules() -> dict[str, Path]:
    """composer.<package>.<module> -> its file (the folders at the top of the repository install under `composer`)."""
    found = {}
    for package in LAYER:
        for path in sorted((REPO / package).rglob("*.py")) if (REPO / package).is_dir() else ():
            name = ".".join(("composer", *path.relative_to(REPO).with_suffix("").parts)).removesuffix(".__init__")
            found[name] = path
    return found


def _package(module: str) -> str:
    return module.split(".")[1]


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from a.b import c` names a.b.c when that is a module, else a.b)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
    return {m for m in out if m in modules}


def test_no_module_imports_a_package_above_its_own_or_across_the_wall():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        mine = _package(name)
        for target in _imports(path, modules):
            theirs = _package(target)
            if theirs != mine and (LAYER[theirs] >= LAYER[mine] or (mine, theirs) in APART):
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_no_circle_of_imports():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    # A package's __init__ is not an edge of its submodules (importing a.b runs a/__init__ first anyway).
    state, circles = {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                circles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


def _rollout_room(module: str) -> str:
    """composer.rollout.<room>[...] -> room (`sandbox_host` is a module of its own, a room of one)."""
    return module.split(".")[2]


def test_inside_rollout_no_import_runs_up_a_floor_or_into_the_engines():
    modules = {name: path for name, path in _modules().items() if _package(name) == "rollout" and name != "composer.rollout"}
    assert {_rollout_room(name) for name in modules} <= set(ROLLOUT_BELOW)  # a new room is given its floor here
    wrong = []
    for name, path in modules.items():
        mine = _rollout_room(name)
        for target in _imports(path, modules):
            theirs = _rollout_room(target)
            if theirs != mine and theirs not in ROLLOUT_BELOW[mine]:
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_no_product_module_passes_800_lines():
    """A module past 800 lines is split into a room of cohesive modules (CONTRIBUTING.md)."""
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > 800}
    assert long == {}
