"""Seeded changes of a project's source that its own tests can see: *bug* kinds (comparison, boundary (off by
one), operator, negated condition, removed branch, constant) in the functions a test file names, and *feature*
(a function's body removed, its signature and docstring kept); a *multi* task is several bugs at once."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    """One change of a module's text: replace [start, end) (1-based lines, 0-based UTF-8 columns) by `text`."""

    kind: str
    """`bug` or `feature`."""
    operator: str
    function: str
    """Qualified name of the function changed."""
    line: int
    description: str
    start: tuple[int, int]
    end: tuple[int, int]
    text: str

    def apply(self, source: str) -> str:
        lines = source.encode().splitlines(keepends=True) + [b""]  # an end may be the start of the line after the last
        (l1, c1), (l2, c2) = self.start, self.end
        before = b"".join(lines[: l1 - 1]) + lines[l1 - 1][:c1]
        after = lines[l2 - 1][c2:] + b"".join(lines[l2:])
        return (before + self.text.encode() + after).decode()


_COMPARE_SWAPS = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BINOP_SWAPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
}
_SYMBOLS = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.And: "and",
    ast.Or: "or",
}


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Module- and class-level functions with their qualified names."""

    def walk(body: list[ast.stmt], prefix: str):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{prefix}{node.name}.")

    yield from walk(tree.body, "")


def _docstring_node(function: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.stmt | None:
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


def _expression(node: ast.expr, replacement: ast.expr, kind: str, operator: str, function: str, what: str) -> Mutation:
    return Mutation(
        kind,
        operator,
        function,
        node.lineno,
        f"{operator}: {what} in {function} (line {node.lineno})",
        (node.lineno, node.col_offset),
        (node.end_lineno, node.end_col_offset),
        ast.unparse(replacement),
    )


def _plus(node: ast.expr, delta: int) -> ast.expr:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return ast.Constant(node.value + delta)
    return ast.BinOp(node, ast.Add() if delta > 0 else ast.Sub(), ast.Constant(1))


def _bug_sites(function_name: str, function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> Iterator[Mutation]:
    docstring = _docstring_node(function)
    yield from _branch_removals(function_name, function.body, lines)
    # The body only: decorators and default values run when the module is imported, not when the function is called.
    for node in (n for statement in function.body if statement is not docstring for n in ast.walk(statement)):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _COMPARE_SWAPS:
                    new = _COMPARE_SWAPS[type(op)]()
                    yield _expression(
                        node,
                        ast.Compare(node.left, [*node.ops[:i], new, *node.ops[i + 1 :]], node.comparators),
                        "bug",
                        "compare",
                        function_name,
                        f"`{_SYMBOLS[type(op)]}` -> `{_SYMBOLS[type(new)]}`",
                    )
            for operand in (node.left, *node.comparators):
                if isinstance(operand, ast.Constant) and type(operand.value) is int:
                    for delta in (1, -1):
                        yield _expression(
                            operand,
                            ast.Constant(operand.value + delta),
                            "bug",
                            "boundary",
                            function_name,
                            f"`{operand.value}` -> `{operand.value + delta}` in a comparison",
                        )
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range" and node.args:
            bound = node.args[-1] if len(node.args) <= 2 else node.args[1]
            for delta in (1, -1):
                yield _expression(
                    bound,
                    _plus(bound, delta),
                    "bug",
                    "boundary",
                    function_name,
                    f"range bound `{ast.unparse(bound)}` {'+' if delta > 0 else '-'} 1",
                )
        elif isinstance(node, ast.Slice):
            for bound in (node.lower, node.upper):
                if bound is not None:
                    yield _expression(bound, _plus(bound, 1), "bug", "boundary", function_name, f"slice bound `{ast.unparse(bound)}` + 1")
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
            new = _BINOP_SWAPS[type(node.op)]()
            yield _expression(
                node,
                ast.BinOp(node.left, new, node.right),
                "bug",
                "operator",
                function_name,
                f"`{_SYMBOLS[type(node.op)]}` -> `{_SYMBOLS[type(new)]}`",
            )
        elif isinstance(node, ast.BoolOp):
            new = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            yield _expression(
                node,
                ast.BoolOp(new, node.values),
                "bug",
                "operator",
                function_name,
                f"`{_SYMBOLS[type(node.op)]}` -> `{_SYMBOLS[type(new)]}`",
            )
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield _expression(node, node.operand, "bug", "negate", function_name, "`not` removed")
        elif isinstance(node, (ast.If, ast.While)) and not isinstance(node.test, (ast.UnaryOp, ast.Compare)):
            yield _expression(
                node.test,
                ast.UnaryOp(ast.Not(), node.test),
                "bug",
                "negate",
                function_name,
                f"condition `{ast.unparse(node.test)[:60]}` negated",
            )
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and type(node.value.value) is bool:
            yield _expression(
                node.value,
                ast.Constant(not node.value.value),
                "bug",
                "constant",
                function_name,
                f"`return {node.value.value}` -> `return {not node.value.value}`",
            )
        for block in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if isinstance(block, list):
                yield from _branch_removals(function_name, block, lines)


def _own_lines(node: ast.stmt, lines: list[str]) -> bool:
    """The statement starts its first line and ends its last (nothing else shares them)."""
    first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
    return not first[: node.col_offset].strip() and not last[node.end_col_offset :].split("#")[0].strip()


def _branch_removals(function_name: str, block: list[ast.stmt], lines: list[str]) -> Iterator[Mutation]:
    for statement in block:
        if not isinstance(statement, ast.If) or len(block) < 2 or not _own_lines(statement, lines):
            continue
        if not statement.orelse:
            yield Mutation(
                "bug",
                "branch",
                function_name,
                statement.lineno,
                f"branch: `if {ast.unparse(statement.test)[:60]}:` removed in {function_name} (line {statement.lineno})",
                (statement.lineno, 0),
                (statement.end_lineno + 1, 0),
                "",
            )
        elif not (len(statement.orelse) == 1 and isinstance(statement.orelse[0], ast.If)):
            else_line = statement.body[-1].end_lineno + 1
            while else_line < statement.orelse[0].lineno and lines[else_line - 1].strip() != "else:":
                else_line += 1
            if lines[else_line - 1].strip() == "else:" and _own_lines(statement.orelse[-1], lines):
                yield Mutation(
                    "bug",
                    "branch",
                    function_name,
                    else_line,
                    f"branch: the `else` of `if {ast.unparse(statement.test)[:60]}:` removed in {function_name} (line {else_line})",
                    (else_line, 0),
                    (statement.orelse[-1].end_lineno + 1, 0),
                    "",
                )


def _feature_site(function_name: str, function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> Mutation | None:
    docstring = _docstring_node(function)
    if docstring is None or len(function.body) < 4 or function.end_lineno - function.lineno > 80:
        return None
    first = function.body[1]
    if lines[first.lineno - 1][: first.col_offset].strip() or not _own_lines(function.body[-1], lines):
        return None
    indent = " " * first.col_offset
    return Mutation(
        "feature",
        "body",
        function_name,
        function.lineno,
        f"body: {function_name} (line {function.lineno}) left with its signature and docstring only",
        (first.lineno, 0),
        (function.end_lineno + 1, 0),
        f"{indent}raise NotImplementedError\n",
    )


def mutations(source: str, kind: str, named_in: str) -> list[Mutation]:
    """The mutations of `kind` of a module's functions whose name (or class) appears in `named_in` (its test file).
    Whether one parses and changes the module's syntax tree is checked when it is validated (`changed_module`)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []
    for name, function in _functions(tree):
        if not any(part in named_in for part in name.split(".") if not part.startswith("__")):
            continue
        if kind == "bug":
            found += _bug_sites(name, function, lines)
        elif (site := _feature_site(name, function, lines)) is not None:
            found.append(site)
    return found


def changed_module(source: str, mutation: Mutation, *more: Mutation) -> str | None:
    """The module with `mutation` (and `more`, in other functions) applied, the last in the file first so that the
    others' positions hold; None when that does not parse or changes nothing the interpreter sees."""
    changed = source
    for m in sorted((mutation, *more), key=lambda m: m.start, reverse=True):
        changed = m.apply(changed)
    try:
        return changed if ast.dump(ast.parse(changed)) != ast.dump(ast.parse(source)) else None
    except (SyntaxError, ValueError):
        return None
