"""Trusted grading: test cases as (call, expected) pairs or the tests' own statements, judged outside the sandbox.

The sandbox only runs the program's entry point on inputs and sends back plain data (`plain_data`); the
verdict is computed here, in the grading process, which never runs the program's code. A case is either
  Call       the entry point's inputs, the expected output and how to compare (==, is, truth, a tolerance, JSON values);
  Statement  a statement of the test's own code, run here with `candidate` standing for the entry point:
             each call goes to the sandbox and comes back as plain data (the test code never meets an
             object of the program's). Used where the test computes inputs at run time (loops, random,
             inputs built from earlier outputs) or compares in its own way (tolerances, helpers).
`rewrite_assertions` turns assertion tests (HumanEval's `check`) into Calls where it can, Statements
with the reason otherwise.

Flags: what a graded run did that honest programs do not (see FLAGS). Every grader, including the
pytest-suite grader of repository tasks, reports flags by these names on `SandboxResult.flags`; the
recipe's `env.guards` decides what a flagged episode earns (`guarded_reward`).
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from rollout import plain_data

FLAGS = {
    "harness_touched": "the program read the harness or test data, another process's /proc, or patched harness functions",
    "early_exit": "the program ended the harness (sys.exit, os._exit, a signal) before every case was asked",
    "forged_records": "the result channel held records the grader did not ask for, or malformed ones",
    "non_plain": "a return value was not plain data (custom classes, e.g. one whose __eq__ is always true)",
    "writes_outside": "the program tried to write outside its work directory and /tmp",
    "stray_processes": "processes the program started were still running when the run ended",
    "timeout": "the program hit the CPU or wall-clock limit",
    "output_limit": "the program's output or result stream went past its limit",
    "host_timeout": "the run timed out because the host starved it, not because of the program (an infrastructure failure)",
    "canary_passed": "a canary task (tests contradicting its statement) scored above 0",
    "tests_modified": "a repository task's episode changed its tests, conftest.py, pytest configuration, sitecustomize "
                      "or .pth files (ignored: graded with trusted copies)",
}
# Flags that make an episode "flagged" unless the recipe says otherwise.
DEFAULT_GUARDED = ("harness_touched", "early_exit", "forged_records", "non_plain", "writes_outside",
                   "stray_processes", "canary_passed", "tests_modified")

Compare = Literal["==", "is", "is not", "truthy", "falsy", "close", "within", "isinstance", "json"]
# isinstance(output, T) for these T, named (a name is plain data, a type is not).
_TYPES = {t.__name__: t for t in (bool, int, float, str, list, tuple, dict, set, frozenset, type(None))}


@dataclass(frozen=True)
class Call:
    """Call the entry point on `args`/`kwargs` (plain data); passes when the output compares to `expected`."""

    args: tuple = ()
    kwargs: tuple[tuple[str, object], ...] = ()
    expected: object = None
    compare: Compare = "=="
    tolerance: float = 0.0
    """For "close": |output - expected| < tolerance; for "within": <= tolerance."""
    seed: int | None = None
    """Reseed `random` (and numpy) before the call; None keeps the state the program left."""


@dataclass(frozen=True)
class Statement:
    """A statement of the tests, run in the grader with `candidate` calling the entry point in the sandbox."""

    code: str
    reason: str
    """Why it is not a Call."""


@dataclass(frozen=True)
class CaseTests:
    entry_point: str
    cases: tuple[Call | Statement, ...]
    setup: str = ""
    """Trusted code (test helpers, the prompt's helpers) run in the grader before the Statements."""
    seed: int = 0
    """Seeds `random` in the sandbox before the program loads."""


def outputs_match(got, expected) -> bool:
    """Equal JSON values, floats within a relative 1e-6 (and NaN equal to NaN)."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return got is expected
    if isinstance(expected, float) or isinstance(got, float):
        if not isinstance(got, (int, float)) or not isinstance(expected, (int, float)):
            return False
        if math.isnan(expected) or math.isnan(got):
            return math.isnan(expected) and math.isnan(got)
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(outputs_match, got, expected))
    if isinstance(expected, dict):
        return isinstance(got, dict) and got.keys() == expected.keys() and all(outputs_match(got[k], expected[k]) for k in expected)
    return type(got) is type(expected) and got == expected


def judge_call(call: Call, got) -> bool:
    """`got` is a decoded plain value (built-in types only), so comparing it runs no program code."""
    if call.compare == "==":
        return bool(got == call.expected)
    if call.compare == "is":
        return got is call.expected
    if call.compare == "is not":
        return got is not call.expected
    if call.compare == "isinstance":
        return isinstance(got, _TYPES[call.expected])
    if call.compare == "truthy":
        return bool(got)
    if call.compare == "falsy":
        return not got
    if call.compare in ("close", "within"):
        try:
            distance = abs(got - call.expected)
            return bool(distance < call.tolerance if call.compare == "close" else distance <= call.tolerance)
        except TypeError:
            return False
    try:
        return outputs_match(json.loads(json.dumps(got)), call.expected)
    except (TypeError, ValueError):
        return False


# --- assertion tests -> cases ------------------------------------------------------------------


def _is_candidate_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "candidate"
            and not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords))


def _uses_candidate(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "candidate" for n in ast.walk(node))


def _tolerance_test(test: ast.expr) -> tuple[ast.Call, ast.expr, ast.expr] | None:
    """(call, expected, tolerance) of `abs(candidate(...) - E) < T` or `<= T` (or math.fabs, either order of the difference)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Lt, ast.LtE))):
        return None
    outer = test.left
    is_abs = isinstance(outer, ast.Call) and len(outer.args) == 1 and not outer.keywords and (
        (isinstance(outer.func, ast.Name) and outer.func.id == "abs")
        or (isinstance(outer.func, ast.Attribute) and outer.func.attr == "fabs" and isinstance(outer.func.value, ast.Name) and outer.func.value.id == "math"))
    if not is_abs or not (isinstance(outer.args[0], ast.BinOp) and isinstance(outer.args[0].op, ast.Sub)):
        return None
    left, right = outer.args[0].left, outer.args[0].right
    call, expected = (left, right) if _is_candidate_call(left) else (right, left)
    if not _is_candidate_call(call) or _uses_candidate(expected) or _uses_candidate(test.comparators[0]):
        return None
    return call, expected, test.comparators[0]


def _plain(value) -> bool:
    try:
        plain_data.encode(value)
    except (plain_data.NotPlain, TypeError, ValueError):
        return False
    return True


def _as_call(statement: ast.stmt, namespace: dict) -> Call | str:
    """The Call a statement asserts, or the reason it is not one."""
    if not isinstance(statement, ast.Assert):
        return f"{type(statement).__name__.lower()} statement (inputs computed at run time)"
    test = statement.test
    close = None
    if _is_candidate_call(test):
        call, expected, compare = test, None, "truthy"
    elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _is_candidate_call(test.operand):
        call, expected, compare = test.operand, None, "falsy"
    elif (close := _tolerance_test(test)) is not None:
        call, expected, compare = close[0], close[1], "close" if isinstance(test.ops[0], ast.Lt) else "within"
    elif (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance" and len(test.args) == 2
          and not test.keywords and _is_candidate_call(test.args[0]) and isinstance(test.args[1], ast.Name) and test.args[1].id in _TYPES):
        call, expected, compare = test.args[0], ast.copy_location(ast.Constant(test.args[1].id), test), "isinstance"
    elif isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.Is, ast.IsNot)):
        left, right = test.left, test.comparators[0]
        call, other = (left, right) if _is_candidate_call(left) else (right, left)
        if not _is_candidate_call(call) or _uses_candidate(other):
            return "compares something other than one call's output"
        compare = {ast.Eq: "==", ast.Is: "is", ast.IsNot: "is not"}[type(test.ops[0])]
        expected = other
    else:
        return "an assertion other than ==, is, a tolerance, a type or truth of one call (helpers)"
    if any(_uses_candidate(a) for a in [*call.args, *call.keywords]):
        return "inputs computed from another call's output"
    try:
        evaluate = lambda node: eval(compile(ast.Expression(node), "tests.py", "eval"), namespace)  # noqa: E731
        args = tuple(evaluate(a) for a in call.args)
        kwargs = tuple((k.arg, evaluate(k.value)) for k in call.keywords)
        expected_value = evaluate(expected) if expected is not None else None
        tolerance = float(evaluate(close[2])) if close is not None else 0.0
    except Exception as e:
        return f"inputs cannot be computed before the run ({type(e).__name__})"
    if compare in ("is", "is not") and not any(expected_value is v for v in (True, False, None)):
        return "an identity test of a value other than True, False, None"
    if not all(map(_plain, (args, dict(kwargs), expected_value))):
        return "inputs or expected output are not plain data"
    if close is not None and not isinstance(expected_value, (int, float)):
        return "a tolerance around something other than a number"
    return Call(args=args, kwargs=kwargs, expected=expected_value, compare=compare, tolerance=tolerance)


@lru_cache(maxsize=4096)
def rewrite_assertions(entry_point: str, setup: str, statements: tuple[str, ...], seed: int = 0) -> CaseTests:
    """Each statement as a Call when it asserts one comparison of one call on inputs the tests fix in
    advance, else as a Statement run in the grader. `setup` is trusted test code (run here to evaluate
    inputs and expected outputs)."""
    namespace: dict = {}
    try:
        exec(compile(setup, "tests.py", "exec"), namespace)
    except Exception:
        namespace = None
    cases = []
    for text in statements:
        statement = ast.parse(text).body
        found = _as_call(statement[0], namespace) if len(statement) == 1 and namespace is not None else "setup failed"
        cases.append(found if isinstance(found, Call) else Statement(text, found))
    return CaseTests(entry_point=entry_point, cases=tuple(cases), setup=setup, seed=seed)


@dataclass
class Protection:
    """How a task's cases are judged: all as Calls, or some by their own statements (and why)."""

    calls: int = 0
    statements: list[str] = field(default_factory=list)

    @property
    def all_calls(self) -> bool:
        return not self.statements


def protection(tests: CaseTests) -> Protection:
    report = Protection()
    for case in tests.cases:
        if isinstance(case, Call):
            report.calls += 1
        else:
            report.statements.append(case.reason)
    return report


def guarded_reward(reward: float, flags: tuple[str, ...], guarded: tuple[str, ...], flagged_reward: float | None) -> float:
    """The reward of an episode after the guards: `flagged_reward` when any of its flags is guarded
    (None keeps the tests' score)."""
    if flagged_reward is not None and any(f in guarded for f in flags):
        return flagged_reward
    return reward
