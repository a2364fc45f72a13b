"""The harness inside the sandbox: load the model's program, run the hidden tests, stream one result per case.

It runs as the sandbox's unprivileged uid, from a read-only copy in each run's harness directory, and
imports nothing from the project. Results go to a dedicated pipe (its fd number is argv[2]), never to
stdout, so what the program prints is never read as a result. The program shares this process with the
tests, so a program determined to forge results could still find that pipe: the hidden expected outputs
of call tests therefore never enter the sandbox at all (the parent compares them), and the parent
re-hashes every harness file after the run.

Test kinds (tests.json):
  assertions  {"entry_point", "setup", "cases": [code]}: `candidate` is the program's entry point; a case
              passes when its code runs without raising; `setup` runs first, in the same namespace.
  calls       {"entry_point", "inputs": [json kwargs], "seed"}: call the entry point on each input and
              report its output (JSON); the parent judges it.
  generate    {"entry_point", "generator", "count", "seed"}: draw `count` inputs from the program's
              generator with a seeded Random, call the entry point on each, report input and output.
  script      {}: run the program as `__main__`, no cases; its output is what the caller reads.

Protocol on the result pipe: JSON lines, one per case ({"ok", "error", "input", "output"}), then
{"done": true}. A run that dies early has reported the cases it finished.
"""

import json
import os
import random
import sys
import traceback


def _describe(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()[-2000:]


class _Reporter:
    def __init__(self, fd: int):
        self._out = os.fdopen(fd, "w", buffering=1)
        self._owner = os.getpid()

    def leave_if_forked(self) -> None:
        # A program that forks returns into this harness twice; only the original process may report.
        if os.getpid() != self._owner:
            os._exit(0)

    def case(self, ok: bool, error: str | None = None, **extra) -> None:
        self._out.write(json.dumps({"ok": ok, "error": error, **extra}) + "\n")

    def done(self) -> None:
        self._out.write(json.dumps({"done": True}) + "\n")
        self._out.flush()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _run_assertions(tests: dict, candidate, namespace: dict, report: _Reporter) -> None:
    namespace["candidate"] = candidate
    try:
        exec(compile(tests["setup"], "tests.py", "exec"), namespace)
    except BaseException as e:
        report.leave_if_forked()
        for _ in tests["cases"]:
            report.case(False, f"test setup failed: {_describe(e)}")
        return
    report.leave_if_forked()
    for code in tests["cases"]:
        try:
            exec(compile(code, "tests.py", "exec"), namespace)
        except BaseException as e:
            report.leave_if_forked()
            report.case(False, _describe(e))
        else:
            report.leave_if_forked()
            report.case(True)


def _call(candidate, seed: int, input_json: str, report: _Reporter) -> None:
    _seed_everything(seed)
    try:
        output = json.dumps(candidate(**json.loads(input_json)))
    except BaseException as e:
        report.leave_if_forked()
        report.case(False, _describe(e), input=input_json)
        return
    report.leave_if_forked()
    report.case(True, input=input_json, output=output)


def _run_calls(tests: dict, candidate, report: _Reporter) -> None:
    for i, input_json in enumerate(tests["inputs"]):
        _call(candidate, tests["seed"] + i, input_json, report)


def _run_generate(tests: dict, candidate, namespace: dict, report: _Reporter) -> None:
    generator = namespace.get(tests["generator"])
    rng = random.Random(tests["seed"])
    for i in range(tests["count"]):
        try:
            input_json = json.dumps(generator(rng))
        except BaseException as e:
            report.leave_if_forked()
            report.case(False, f"input generator failed: {_describe(e)}")
            continue
        report.leave_if_forked()
        _call(candidate, tests["seed"] + i, input_json, report)


def _run_script(program: str, report: _Reporter) -> None:
    """Like `python program.py`: a traceback goes to stderr and the exit status is 1."""
    status = 0
    try:
        exec(compile(program, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        status = e.code
    except BaseException as e:
        traceback.print_exception(e.with_traceback(e.__traceback__.tb_next))  # from the program's own frames
        status = 1
    report.leave_if_forked()
    report.done()
    sys.exit(status)


def _num_cases(tests: dict) -> int:
    if tests["kind"] == "script":
        return 0
    if tests["kind"] == "assertions":
        return len(tests["cases"])
    return len(tests["inputs"]) if tests["kind"] == "calls" else tests["count"]


def main() -> None:
    harness, result_fd = sys.argv[1], int(sys.argv[2])
    with open(os.path.join(harness, "tests.json")) as f:
        tests = json.load(f)
    with open(os.path.join(harness, "program.py")) as f:
        program = f.read()
    report = _Reporter(result_fd)
    _seed_everything(tests.get("seed", 0))
    if tests["kind"] == "script":
        return _run_script(program, report)
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        exec(compile(program, "program.py", "exec"), namespace)
        candidate = namespace[tests["entry_point"]]
    except BaseException as e:
        report.leave_if_forked()
        error = f"{tests['entry_point']} is not defined" if isinstance(e, KeyError) else _describe(e)
        for _ in range(_num_cases(tests)):
            report.case(False, f"program failed to load: {error}")
        report.done()
        return
    report.leave_if_forked()
    if tests["kind"] == "assertions":
        _run_assertions(tests, candidate, namespace, report)
    elif tests["kind"] == "calls":
        _run_calls(tests, candidate, report)
    else:
        _run_generate(tests, candidate, namespace, report)
    report.done()


if __name__ == "__main__":
    main()
