"""The grading boundary of repository tasks: the grader's copy of a task's module, with the task's functions made
proxies into the episode's process.

The agent's code and the code that decides a grade never run in one process. The grader's pytest imports the
trusted package in which each function of the task's scope keeps its trusted signature and decorators (argument
checks and conversions stay the grader's) but its body is one call, `crossing.call(module, name, args, kwargs)`,
answered by the episode's version of the function in a sandboxed process of its own (`crossing.serve`, as another
uid, with the package and the episode's change and without the tests). What crosses is data
(`rollout/tasks/repository/codec.py`, `crossing.py`). Every task is graded this way (every kind's scope names functions);
`env build` keeps a task only when its original passes its expected tests this way and its change fails its
fail-to-pass ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

from composer.rollout.tasks.repository.grading_policy import Scope, definitions, import_path

CROSSING_SOURCES = (Path(__file__).with_name("codec.py"), Path(__file__).with_name("crossing.py"))


def crossing_text() -> str:
    """Both sides' program, stdlib only: the encoding of what crosses, then the calls and references."""
    return "\n".join(path.read_text() for path in CROSSING_SOURCES)


# The module name under which the grader's entry installs `crossing` (what the proxies' bodies import).
CROSSING_MODULE = "_composer_crossing"


def crosses(scope: tuple[Scope, ...]) -> bool:
    """Whether a task with this scope can be graded across the boundary: it names the functions it asks for (a set
    built before history tasks were scoped by functions has whole files: `task_set.repo_tests` refuses it)."""
    return bool(scope) and all(s.functions and s.path.endswith(".py") for s in scope)


def module_name(path: str, packages: tuple[str, ...]) -> str:
    """The dotted module of a source file `path` (relative to the project root), resolved against the one of the
    project's `packages` that holds it (ValueError when none does)."""
    relative = import_path(path, packages)
    if relative is None:
        raise ValueError(f"{path} is in none of the packages {', '.join(packages)}")
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _proxy_body(function: ast.FunctionDef | ast.AsyncFunctionDef, module: str, qualname: str) -> list[ast.stmt]:
    spec = function.args
    positional: list[ast.expr] = [ast.Name(a.arg, ast.Load()) for a in [*spec.posonlyargs, *spec.args]]
    if spec.vararg:
        positional.append(ast.Starred(ast.Name(spec.vararg.arg, ast.Load()), ast.Load()))
    keys: list[ast.expr | None] = [ast.Constant(a.arg) for a in spec.kwonlyargs]
    values: list[ast.expr] = [ast.Name(a.arg, ast.Load()) for a in spec.kwonlyargs]
    if spec.kwarg:
        keys.append(None)
        values.append(ast.Name(spec.kwarg.arg, ast.Load()))
    crossing = ast.Call(ast.Name("__import__", ast.Load()), [ast.Constant(CROSSING_MODULE)], [])
    call = ast.Call(
        ast.Attribute(crossing, "call", ast.Load()),
        [ast.Constant(module), ast.Constant(qualname), ast.Tuple(positional, ast.Load()), ast.Dict(keys, values)],
        [],
    )
    return [ast.Return(call)]


def proxied(trusted: str, functions: tuple[str, ...], module: str) -> str:
    """`trusted` (a module's source) with each of `functions` (qualified names) made a proxy: the same decorators and
    signature, a body that calls the episode's version across the boundary. KeyError names a function it lacks."""
    tree = ast.parse(trusted)
    found = {name: node for name, node, _ in definitions(tree)}
    lines = trusted.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    replacements = []
    for name in functions:
        node = found[name]
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise KeyError(name)
        proxy = ast.fix_missing_locations(
            type(node)(
                name=node.name,
                args=node.args,
                body=_proxy_body(node, module, name),
                decorator_list=node.decorator_list,
                returns=node.returns,
                type_comment=None,
                **({"type_params": node.type_params} if hasattr(node, "type_params") else {}),
            )
        )
        indent = " " * node.col_offset
        text = "".join(indent + line + "\n" for line in ast.unparse(proxy).splitlines())
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        replacements.append((first, node.end_lineno, text))
    for first, last, text in sorted(replacements, reverse=True):
        lines[first - 1 : last] = [text]
    return "".join(lines)
