"""The trusted pytest entry of repository tasks: run pytest and report every test's outcome with a secret.

Run as `python -s -P -B -c <this file's text> ROOT REPORT NONCE_FILE PYTEST_ARGS...` (stdlib and pytest only; not
-I, which would drop PYTHONHASHSEED, and tests' set orders with it), in a directory the run cannot write to. Before
any code of the repository runs it reads the run's nonce from NONCE_FILE and deletes the file, opens REPORT, drops
pytest's plugin autoloading and the PYTEST_* variables, and takes references to what reports outcomes. Then pytest
runs with this module's plugin, which writes one JSON line per test, {"nonce", "id", "outcome"}, and at the
session's end {"nonce", "end", "exitstatus", "tampered"}. The grader believes only lines with the nonce and a
report with its end line: a program that exits early, forges lines without the nonce, or patches pytest's
reporting (noticed here, `tampered`) earns nothing. The tests run the program in this same process, so this is
evidence the program must work to forge, not a wall: the grade also needs every expected test id to pass.
"""

import gc
import json
import os
import sys


def _watched():
    """(owner, attribute name) pairs whose objects decide reported outcomes."""
    import _pytest.python
    import _pytest.reports
    import _pytest.runner
    import pluggy

    pairs = [(_pytest.runner, n) for n in ("runtestprotocol", "call_and_report", "call_runtest_hook", "check_interactive_exception")]
    pairs += [(_pytest.runner.CallInfo, "from_call"), (_pytest.reports.TestReport, "from_item_and_call"),
              (_pytest.python, "pytest_pyfunc_call"), (_pytest.python.Function, "runtest"),
              (pluggy.HookCaller, "__call__"), (os, "write"), (json, "dumps"), (gc, "get_objects")]
    return pairs


class ReportPlugin:
    def __init__(self, fd: int, nonce: str, guarded_paths: tuple[str, ...]):
        self._fd, self._nonce = fd, nonce
        self._write, self._dumps = os.write, json.dumps
        self._outcomes: dict[str, str] = {}
        self._tampered: list[str] = []
        self._watched = [(owner, name, owner.__dict__.get(name)) for owner, name in _watched()]
        self._watched += [(ReportPlugin, name, value) for name, value in vars(ReportPlugin).items() if callable(value)]
        tampered, guarded = self._tampered, guarded_paths

        def audit(event, args):
            if event in ("gc.get_objects", "gc.get_referrers", "gc.get_referents"):
                tampered.append(event) if event not in tampered else None
            elif event == "open" and isinstance(args[0], str) and os.path.abspath(args[0]) in guarded:
                tampered.append(f"open {args[0]}") if len(tampered) < 20 else None

        sys.addaudithook(audit)

    def _send(self, record: dict) -> None:
        data = (self._dumps({"nonce": self._nonce, **record}) + "\n").encode()
        while data:
            data = data[self._write(self._fd, data):]

    def pytest_runtest_logreport(self, report) -> None:
        previous = self._outcomes.get(report.nodeid, "passed")
        if report.when == "call" and hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "failed"
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.skipped:
            outcome = "skipped"
        else:
            outcome = "passed"
        # The worst of setup, call and teardown.
        self._outcomes[report.nodeid] = outcome if previous == "passed" else previous

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        self._send({"id": nodeid, "outcome": self._outcomes.get(nodeid, "error")})

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self._send({"collect_error": report.nodeid})

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        changed = [f"{getattr(o, '__name__', o)}.{n}" for o, n, v in self._watched if o.__dict__.get(n) is not v]
        self._send({"end": True, "exitstatus": int(exitstatus), "tampered": sorted(set(self._tampered + changed))})


def main() -> None:
    root, report_path, nonce_path, *args = sys.argv[1:]
    with open(nonce_path) as f:
        nonce = f.read().strip()
    os.unlink(nonce_path)
    fd = os.open(report_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        os.environ.pop(name, None)
    os.chdir(root)
    sys.path.insert(0, root)
    import pytest

    plugin = ReportPlugin(fd, nonce, (os.path.abspath(report_path), os.path.abspath(nonce_path)))
    code = pytest.main(args, plugins=[plugin])
    sys.stdout.flush()
    os._exit(int(code))


if __name__ == "__main__":
    main()
