"""Trusted grading: test cases as (call, expected) pairs or the tests' own statements, judged outside the sandbox.

The sandbox only runs the program's entry point on inputs and sends back plain data (`plain_data`); the
verdict is computed here, in the grading process, which never runs the program's code. A case is either
  Call       the entry point's inputs, the expected output and how to compare (==, is, truth, a tolerance, JSON values);
  Statement  a statement of the test's own code, run here with `candidate` standing for the entry point:
             each call goes to the sandbox and comes back as plain data (the test code never meets an
             object of the program's). Used where the test computes inputs at run time (loops, random,
             inputs built from earlier outputs) or compares in its own way (tolerances, helpers). A statement
             runs no longer than the run's wall-clock limit and judges outputs of at most
             STATEMENT_OUTPUT_BYTES.
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
import signal
import sys
import time
from functools import cache, lru_cache

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox import plain_data
from composer.rollout.sandbox.isolation import starved_seconds
from composer.rollout.sandbox.results import (
    AssertionTests,
    Call,
    CallTests,
    CaseResult,
    CaseTests,
    GeneratedCalls,
    RewardMode,
    SandboxResult,
    ScriptRun,
    Statement,
    Tests,
    reward_for,
)
from composer.rollout.sandbox.session import Session

FLAGS = {
    "harness_touched": "the program read the harness or test data, another process's /proc, or patched harness functions",
    "early_exit": "the program ended the harness (sys.exit, os._exit, a signal) before every case was asked",
    "forged_records": "the result channel held records the grader did not ask for, or malformed ones",
    "non_plain": "a return value was not plain data (custom classes, e.g. one whose __eq__ is always true)",
    "writes_outside": "the program tried to write outside its work directory and /tmp",
    "stray_processes": "processes the program started were still running when the run ended",
    "timeout": "the program hit the CPU or wall-clock limit",
    "output_limit": "the program's output or result stream went past its limit",
    "write_limit": "the run or the workspace wrote up to its cap of bytes or files (later writes were refused)",
    "memory_limit": "the run's memory of every kind (processes, memfds, tmpfs, shared memory) reached its cgroup limit: "
    "the kernel killed a process",
    "host_timeout": "the run timed out because the host starved it, not because of the program (an infrastructure failure)",
    "canary_passed": "a canary task (tests contradicting its statement) scored above 0",
    "tests_modified": "a repository task's episode changed its tests, conftest.py, pytest configuration, sitecustomize "
    "or .pth files (ignored: graded with trusted copies)",
    "change_dropped": "a repository task's episode changed what its grade does not take (code outside the task's "
    "functions, bytecode, non-regular files): left out, it never ran",
    "forbidden_code": "no longer raised (a repository task's change reaching for the test run, from when history tasks "
    "ran it in pytest's process); accepted in `guarded` so older recipes load",
    "sentinel_tripped": "trusted sentinel tests in a repository task's test run were not reported as written (tests "
    "neutralised, outcomes rewritten)",
}
# Flags that make an episode "flagged" unless the recipe says otherwise.
DEFAULT_GUARDED = (
    "harness_touched",
    "early_exit",
    "forged_records",
    "non_plain",
    "writes_outside",
    "stray_processes",
    "canary_passed",
    "tests_modified",
    "sentinel_tripped",
)

# An output a test statement judges in the grader is at most this long (encoded): what a statement does with it runs
# here, and a loop in C over it cannot be stopped.
STATEMENT_OUTPUT_BYTES = 1 << 20

# isinstance(output, T) for these T, named (a name is plain data, a type is not).
_TYPES = {t.__name__: t for t in (bool, int, float, str, list, tuple, dict, set, frozenset, type(None))}


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
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "candidate"
        and not any(isinstance(a, ast.Starred) for a in node.args)
        and all(k.arg for k in node.keywords)
    )


def _uses_candidate(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "candidate" for n in ast.walk(node))


def _tolerance_test(test: ast.expr) -> tuple[ast.Call, ast.expr, ast.expr] | None:
    """(call, expected, tolerance) of `abs(candidate(...) - E) < T` or `<= T` (or math.fabs, either order of the difference)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Lt, ast.LtE))):
        return None
    outer = test.left
    is_abs = (
        isinstance(outer, ast.Call)
        and len(outer.args) == 1
        and not outer.keywords
        and (
            (isinstance(outer.func, ast.Name) and outer.func.id == "abs")
            or (
                isinstance(outer.func, ast.Attribute)
                and outer.func.attr == "fabs"
                and isinstance(outer.func.value, ast.Name)
                and outer.func.value.id == "math"
            )
        )
    )
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
    elif (
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Name)
        and test.func.id == "isinstance"
        and len(test.args) == 2
        and not test.keywords
        and _is_candidate_call(test.args[0])
        and isinstance(test.args[1], ast.Name)
        and test.args[1].id in _TYPES
    ):
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


def guarded_reward(reward: float, flags: tuple[str, ...], guarded: tuple[str, ...], flagged_reward: float | None) -> float:
    """The reward of an episode after the guards: `flagged_reward` when any of its flags is guarded
    (None keeps the tests' score)."""
    if flagged_reward is not None and any(f in guarded for f in flags):
        return flagged_reward
    return reward


def case_tests(tests: AssertionTests | CallTests | CaseTests) -> CaseTests:
    """The cases the grader asks for `tests`."""
    if isinstance(tests, CaseTests):
        return tests
    if isinstance(tests, AssertionTests):
        return rewrite_assertions(tests.entry_point, tests.setup, tests.cases)
    return _call_cases(tests)


@cache
def _call_cases(tests: CallTests) -> CaseTests:
    cases = tuple(
        Call(kwargs=tuple(json.loads(i).items()), expected=json.loads(e), compare="json", seed=tests.seed + n)
        for n, (i, e) in enumerate(zip(tests.inputs, tests.expected))
    )
    return CaseTests(entry_point=tests.entry_point, cases=cases, seed=tests.seed)


# --- results -----------------------------------------------------------------------------------


# --- grading a program run (trusted: no program code runs here) ---------------------------------


class _CandidateFailed(BaseException):
    """The entry point raised, or gave no usable output (a BaseException: test code cannot catch it)."""


def grade_program(
    session: Session, config: SandboxSection, program: str, tests: Tests, reward: RewardMode, uid: int | None
) -> SandboxResult:
    """Ask the live run for the program's outputs on the tests' inputs and judge them here."""
    script = isinstance(tests, ScriptRun)
    cases_of = None if script or isinstance(tests, GeneratedCalls) else case_tests(tests)
    entry = None if script else tests.entry_point
    seed = tests.seed if isinstance(tests, (CaseTests, GeneratedCalls, CallTests)) else 0
    loaded = session.request({"op": "load", "program": program, "entry": entry, "script": script, "seed": seed})
    results: list[CaseResult] = []
    total = 0
    ran_all = False
    if loaded is not None and loaded.get("exit"):
        session.flag("early_exit", f"SystemExit while loading: {loaded.get('error', '')[:200]}")
    if script:
        ran_all = loaded is not None and loaded.get("op") == "exited"
        exit_status = loaded.get("status", 1) if ran_all else 1
    elif isinstance(tests, GeneratedCalls):
        total = tests.count
        results = _generated(session, tests, loaded)
        ran_all = session.live
    else:
        total = len(cases_of.cases)
        results = _cases(session, cases_of, loaded)
        ran_all = session.live or (loaded is not None and "error" in loaded and not session.stop)
    exit_code = session.finish()
    wall = time.monotonic() - session.started
    return _verdict(session, config, results, total, reward, exit_code, ran_all, wall, uid, exit_status if script else None)


def _generated(session: Session, tests: GeneratedCalls, loaded: dict | None) -> list[CaseResult]:
    if loaded is None or "error" in loaded:
        error = loaded.get("error", "the program did not load") if loaded else "the run ended while loading"
        return [CaseResult(False, f"program failed to load: {error}")] * tests.count
    reply = session.request({"op": "inputs", "id": 0, "generator": tests.generator, "count": tests.count, "seed": tests.seed})
    drawn = reply.get("inputs") if reply else None
    if not isinstance(drawn, list) or len(drawn) != tests.count:
        return [CaseResult(False, "input generator failed")] * tests.count
    results = []
    for n, text in enumerate(drawn):
        try:
            kwargs = json.loads(text)
            if not isinstance(kwargs, dict):
                raise ValueError("not keyword arguments")
        except (TypeError, ValueError):
            results.append(CaseResult(False, "input generator failed"))
            continue
        ok, value, error = _call(session, n + 1, (), tuple(kwargs.items()), tests.seed + n)
        try:
            output = json.dumps(value) if ok else None
        except (TypeError, ValueError) as e:
            ok, error, output = False, f"output is not JSON: {e}", None
        results.append(CaseResult(ok, error, input=text, output=output))
    return results


def _call(
    session: Session, call_id: int, args: tuple, kwargs: tuple, seed: int | None, max_bytes: int | None = None
) -> tuple[bool, object, str | None]:
    """(answered, decoded output, error) for one call of the entry point in the sandbox; an output whose encoding
    is longer than `max_bytes` is refused undecoded."""
    try:
        message = {
            "op": "call",
            "id": call_id,
            "args": plain_data.encode(list(args)),
            "kwargs": plain_data.encode(dict(kwargs)),
            "seed": seed,
        }
    except plain_data.NotPlain as e:
        return False, None, f"the test's inputs are not plain data ({e})"
    reply = session.request(message)
    if reply is None:
        return False, None, "the run ended before answering"
    if reply.get("exit"):
        session.flag("early_exit", f"SystemExit in the entry point: {str(reply.get('error'))[:200]}")
    if "non_plain" in reply:
        session.flag("non_plain", f"returned {str(reply['non_plain'])[:100]}")
    if "value" not in reply:
        return False, None, str(reply.get("error", "no output"))[:2000]
    if max_bytes is not None and isinstance(reply["value"], str) and len(reply["value"]) > max_bytes:
        session.flag("output_limit", f"an output of {len(reply['value'])} bytes for a test statement (at most {max_bytes})")
        return False, None, f"an output of {len(reply['value'])} bytes is more than a test statement judges ({max_bytes})"
    try:
        if not isinstance(reply["value"], str):
            raise ValueError("not text")
        return True, plain_data.decode(reply["value"]), None
    except (ValueError, TypeError):
        session.flag("forged_records", "an output that is not plain data")
        return False, None, "an output that is not plain data"


def _cases(session: Session, tests: CaseTests, loaded: dict | None) -> list[CaseResult]:
    if loaded is None or "error" in loaded:
        error = loaded.get("error", "") if loaded else "the run ended while loading"
        return [CaseResult(False, f"program failed to load: {error}")] * len(tests.cases)
    namespace = None
    counter = iter(range(1, 1 << 62))

    def candidate(*args, **kwargs):
        ok, value, error = _call(session, next(counter), args, tuple(kwargs.items()), None, STATEMENT_OUTPUT_BYTES)
        if not ok:
            raise _CandidateFailed(error)
        return value

    results = []
    for case in tests.cases:
        if isinstance(case, Call):
            ok, value, error = _call(session, next(counter), case.args, case.kwargs, case.seed)
            if ok and not judge_call(case, value):
                ok, error = False, "wrong output"
            results.append(CaseResult(ok, error, output=None if value is None else repr(value)[:200]))
            continue
        if namespace is None:
            namespace = {}
            try:
                exec(_compiled(tests.setup), namespace)
            except Exception as e:
                namespace = {"__setup_error__": repr(e)}
        if "__setup_error__" in namespace:
            results.append(CaseResult(False, f"test setup failed: {namespace['__setup_error__']}"))
            continue
        # The tests may call the function by its own name too (HumanEval/33 compares it with itself).
        namespace["candidate"] = namespace[tests.entry_point] = candidate
        try:
            _run_statement(_compiled(case.code), namespace, session.deadline)
            results.append(CaseResult(True))
        except _CandidateFailed as e:
            results.append(CaseResult(False, str(e)))
        except _StatementTimeout:
            session.stop, session.live = "timeout", False
            results.append(CaseResult(False, "the test statement ran past the run's wall-clock limit"))
        except Exception as e:
            results.append(CaseResult(False, f"{type(e).__name__}: {e}"[:2000]))
    return results


class _StatementTimeout(BaseException):
    """A test statement ran in the grader past the run's deadline (a BaseException: test code cannot catch it)."""


def _run_statement(code, namespace: dict, deadline: float) -> None:
    """Run a test statement here, stopped at `deadline`: a statement looping over an output (`for _ in
    range(candidate())`) loops no longer than the run may. A trace function on the test's own frames only, so the
    grader's code (the calls into the sandbox) runs untraced; C-level loops are bounded by the outputs' size."""

    def line(frame, event, arg):
        if time.monotonic() > deadline:
            raise _StatementTimeout
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename == "tests.py" else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        exec(code, namespace)
    finally:
        sys.settrace(previous)


def _verdict(
    session: Session,
    config: SandboxSection,
    cases: list[CaseResult],
    total: int,
    reward: RewardMode,
    exit_code: int | None,
    ran_all: bool,
    wall: float,
    uid: int | None,
    script_status: int | None,
) -> SandboxResult:
    stop = session.stop
    passed = sum(c.ok for c in cases)
    memory = any(c.error and "MemoryError" in c.error for c in cases) or "MemoryError" in session.stderr.text()
    # SIGXCPU, or SIGKILL past the hard limit: the CPU limit ended it (not the program itself).
    limit_kill = (
        session.stop == "cpu"
        or exit_code == -signal.SIGXCPU
        or (exit_code == -signal.SIGKILL and session.cpu_seconds >= config.cpu_seconds)
    )
    infra = False
    if session.setup_error or stop == "setup":
        status, detail, infra = "infra", f"sandbox setup failed: {session.setup_error}", True
    elif stop == "timeout":
        status, detail = "timeout", "wall-clock limit"
        if uid is not None and starved_seconds(uid) > 0.5 * config.wall_seconds:
            session.flag("host_timeout", "the run waited for a CPU most of its wall-clock limit")
            status, detail, infra = "infra", "the host starved the run (waiting for a CPU) until its wall-clock limit", True
    elif limit_kill and not ran_all:
        status, detail = "timeout", "CPU-time limit"
    elif stop == "output":
        status, detail = "crash", f"output exceeded {config.max_file_mb} MB"
    elif stop == "results":
        status, detail = "crash", "result stream too large"
    elif memory or session.memory_hit:
        status, detail = "memory", f"memory limit of {config.memory_mb} MB"
    elif script_status is not None:
        status, detail = (
            ("ok", "") if ran_all and script_status == 0 else ("crash", f"exit status {script_status if ran_all else exit_code}")
        )
    elif not ran_all:
        status, detail = "crash", f"exit status {exit_code}, tests did not finish"
        session.flag("early_exit", f"the harness ended (exit status {exit_code}) before every case was asked")
    else:
        status, detail = "ok", ""
    if status == "timeout":
        session.flag("timeout", detail)
    if stop in ("output", "results"):
        session.flag("output_limit", detail)
    flags = tuple(sorted(session.flags))
    return SandboxResult(
        reward=0.0 if infra else reward_for(passed, total, reward),
        passed=passed,
        total=total,
        status=status,
        detail=detail,
        stdout_tail=session.stdout.text(),
        stderr_tail=session.stderr.text(),
        wall_seconds=wall,
        uid=uid,
        cases=tuple(cases),
        flags=flags,
        flag_details=tuple(f"{f}: {session.flags[f]}" for f in flags),
        infra_failure=infra,
    )


@cache
def _compiled(code: str):
    return compile(code, "tests.py", "exec")
