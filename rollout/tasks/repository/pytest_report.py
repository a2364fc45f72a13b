"""The trusted pytest entry of repository tasks: run pytest and stream every test's outcome to the grader.

Run as `python -s -P -B -c <this file's text> ROOT KEY_FILE CHANNEL_FD [--crossing=CROSSING_PY:CALL_FD] PYTEST_ARGS...` (stdlib and pytest only;
not -I, which would drop PYTHONHASHSEED, and tests' set orders with it) with CHANNEL_FD a pipe whose other end the
grader reads while the run goes (`Sandbox.run_command(channel=True)`). Before any code of the repository runs it
reads the run's key from KEY_FILE and deletes the file, moves the channel to a descriptor of its own choosing
(close-on-exec, so no program the tests start inherits it), makes every module under ROOT load from its source
(never from bytecode: no __pycache__, no sourceless .pyc, no extension module; pytest's cache of rewritten test
modules is not read either), drops pytest's plugin autoloading and the PYTEST_* variables, and takes references to
what reports outcomes. Then pytest runs with this module's plugin, which sends one line per test, `MAC {"id",
"outcome"}`, and at the end `MAC {"end", "exitstatus", "tampered"}`, after which it closes the channel. Each MAC is
an HMAC of the line's JSON under the key, chained to the previous line's: the key lives only in the sender's
closure, so a line added, changed, dropped or moved breaks the chain, and the grader counts nothing after the end.

The tests run the program in this same process, so what is checked here is evidence the program must work to
forge, not a wall: `tampered` names what changed in pytest's reporting (watched module functions, the classes
that make and carry reports, every hook implementation, plugins registered by anything but pytest and the
repository's conftests, the reporting plugin's outcomes, import hooks, a trace function, the channel's descriptor);
the plugin's hooks are closures over the sender and its state, out of reach of attribute patching. The walls are
outside: the grader takes only the task's change and refuses code that reaches for any of this
(`rollout.tasks.repository.grading_policy`), and trusted sentinel tests in the run must pass and fail as written.
"""

import gc
import hmac
import json
import os
import random
import sys


def _source_only(root: str) -> None:
    """Modules under `root` load from their source only: a finder for `root`'s directories that knows no bytecode
    or extension suffix, whose loader compiles the source and never looks for a cached pyc."""
    from importlib.machinery import SOURCE_SUFFIXES, FileFinder, SourceFileLoader

    class SourceOnlyLoader(SourceFileLoader):
        def get_code(self, fullname):
            return compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)

    def hook(path: str):
        where = os.path.realpath(path or ".")
        if where == root or where.startswith(root + os.sep):
            return FileFinder(path, (SourceOnlyLoader, SOURCE_SUFFIXES))
        raise ImportError("not under the repository")

    sys.path_hooks.insert(0, hook)
    sys.path_importer_cache.clear()


def _behaviour(value) -> bool:
    """A class attribute that decides behaviour (a function, a property, any descriptor), not a data flag."""
    return callable(value) or hasattr(value, "__get__")


def _watched():
    """(owner, attribute name) pairs whose objects decide reported outcomes, and classes watched whole."""
    import _pytest.assertion.rewrite
    import _pytest.main
    import _pytest.python
    import _pytest.reports
    import _pytest.runner
    import pluggy

    pairs = [
        (_pytest.runner, n)
        for n in (
            "runtestprotocol",
            "call_and_report",
            "call_runtest_hook",
            "check_interactive_exception",
            "pytest_runtest_protocol",
            "pytest_runtest_call",
            "pytest_runtest_makereport",
        )
    ]
    pairs += [
        (_pytest.python, "pytest_pyfunc_call"),
        (_pytest.main, "pytest_runtestloop"),
        (_pytest.assertion.rewrite, "rewrite_asserts"),
        (_pytest.assertion.rewrite, "_read_pyc"),
        (os, "write"),
        (os, "fstat"),
        (json, "dumps"),
        (gc, "get_objects"),
        (sys, "settrace"),
    ]
    classes = [
        _pytest.reports.BaseReport,
        _pytest.reports.TestReport,
        _pytest.reports.CollectReport,
        _pytest.runner.CallInfo,
        _pytest.python.Function,
        pluggy.HookCaller,
        pluggy.HookImpl,
        pluggy.PluginManager,
        _pytest.assertion.rewrite.AssertionRewritingHook,
    ]
    return pairs, classes


def _sender(fd: int, key: bytes):
    """Writes records to the channel, each line `MAC JSON` with MAC = HMAC-SHA256(key, previous MAC + JSON): the
    key and the chain stay in this closure."""
    write, dumps, digest = os.write, json.dumps, hmac.digest
    chain = [b""]

    def send(record: dict) -> None:
        body = dumps(record).encode()
        mac = digest(key, chain[0] + body, "sha256").hex().encode()
        chain[0] = mac
        data = mac + b" " + body + b"\n"
        while data:
            data = data[write(fd, data) :]

    return send


def report_plugin(fd: int, send, root: str, crossing=None):
    """The reporting plugin and its `end`. Its hooks are closures over the sender and the run's state (the outcomes,
    what was seen tampered with, the watched objects): changing an attribute of the plugin changes nothing pytest
    calls, and their hook implementations are watched like the others'."""
    import _pytest.assertion.rewrite
    import _pytest.reports

    fstat, close, vars_, type_ = os.fstat, os.close, vars, type
    report_type, rewriter = _pytest.reports.TestReport, _pytest.assertion.rewrite.AssertionRewritingHook
    try:
        import _pytest.subtests  # pytest 9: unittest's subTest() and the subtests fixture report their own outcomes

        report_types = (report_type, _pytest.subtests.SubtestReport)
    except ImportError:
        report_types = (report_type,)
    channel = fstat(fd)
    channel_id = (channel.st_dev, channel.st_ino)
    outcomes: dict[str, str] = {}
    own_outcomes = outcomes
    tampered: list[str] = []
    ended, plugin_manager = [False], [None]
    plugins: set[int] = set()
    impls: list[tuple[str, object, object]] = []
    pairs, classes = _watched()
    watched = [(owner, name, owner.__dict__.get(name)) for owner, name in pairs]
    class_state = [(cls, {n: v for n, v in vars(cls).items() if _behaviour(v)}) for cls in classes]
    meta_path, path_hooks = list(sys.meta_path), list(sys.path_hooks)

    def note(what: str) -> None:
        if what not in tampered and len(tampered) < 40:
            tampered.append(what)

    def emit(record: dict) -> None:
        if ended[0]:
            return
        now = fstat(fd)
        if (now.st_dev, now.st_ino) != channel_id:
            note("the report channel's descriptor was replaced")
        send(record)

    def pytest_plugin_registered(plugin, plugin_name, manager) -> None:
        """Every plugin, as it is registered (the earlier ones replayed): pytest's own and the repository's
        conftest modules only; their hook implementations are remembered, to be found unchanged at the end."""
        plugin_manager[0] = manager
        if not trusted_plugin(plugin):
            note(f"a plugin registered during the run ({plugin_name})")
        plugins.add(id(plugin))
        for name, caller in vars_(manager.hook).items():
            for impl in caller.get_hookimpls() if hasattr(caller, "get_hookimpls") else ():
                if impl.plugin is plugin:
                    impls.append((name, impl, impl.function))

    def trusted_plugin(plugin) -> bool:
        """pytest's own plugins (its modules, its classes' instances, this one) and the repository's conftest
        modules (conftest files are never taken from an episode)."""
        if plugin is namespace:
            return True
        if type_(plugin) is type_(sys):
            path = getattr(plugin, "__file__", None)
            if plugin.__name__.startswith(("_pytest.", "pytest")):
                return True
            return isinstance(path, str) and os.path.basename(path) == "conftest.py" and os.path.realpath(path).startswith(root + os.sep)
        return type_(plugin).__module__.startswith(("_pytest.", "pluggy."))

    def pytest_runtest_logreport(report) -> None:
        if type_(report) not in report_types:
            note(f"a report of another type ({type_(report).__name__})")
        fields = vars_(report)
        when, outcome = fields.get("when"), fields.get("outcome")
        previous = outcomes.get(report.nodeid, "passed")
        if when == "call" and "wasxfail" in fields:
            outcome = "xfailed" if outcome == "skipped" else "failed"
        elif outcome == "failed":
            outcome = "failed" if when == "call" else "error"
        elif outcome != "skipped":
            outcome = "passed" if outcome == "passed" else "error"
        # The worst of setup, call and teardown.
        outcomes[report.nodeid] = outcome if previous == "passed" else previous

    def pytest_runtest_logfinish(nodeid, location) -> None:
        emit({"id": nodeid, "outcome": outcomes.get(nodeid, "error")})

    def pytest_collectreport(report) -> None:
        if vars_(report).get("outcome") == "failed":
            emit({"collect_error": report.nodeid})

    def changes() -> list[str]:
        """What changed, since the run began, in what decides reported outcomes."""
        changed = [f"{getattr(o, '__name__', o)}.{n}" for o, n, v in watched if o.__dict__.get(n) is not v]
        for cls, before in class_state:
            now = {n: v for n, v in vars_(cls).items() if _behaviour(v)}
            changed += [f"{cls.__name__}.{n}" for n in sorted(set(before) | set(now)) if now.get(n) is not before.get(n)]
        if any(f not in meta_path and type_(f) is not rewriter for f in sys.meta_path) or sys.path_hooks != path_hooks:
            changed.append("import hooks (sys.meta_path, sys.path_hooks)")
        if sys.gettrace() is not None or sys.getprofile() is not None:
            changed.append("a trace or profile function")
        if outcomes is not own_outcomes or type_(outcomes) is not dict:
            changed.append("the reporting plugin's outcomes")
        if plugin_manager[0] is not None:
            callers = {name: c for name, c in vars_(plugin_manager[0].hook).items() if hasattr(c, "get_hookimpls")}
            attached = {name: {id(i) for i in c.get_hookimpls()} for name, c in callers.items()}
            changed += sorted(
                {
                    f"the implementations of {name}"
                    for name, impl, function in impls
                    if impl.function is not function or id(impl) not in attached.get(name, ())
                }
            )
            changed += sorted(
                {
                    f"an implementation of {name} from no registered plugin"
                    for name, c in callers.items()
                    for impl in c.get_hookimpls()
                    if id(impl.plugin) not in plugins
                }
            )
        return changed

    def end(exitstatus: int, session: bool) -> None:
        """The end line, then the channel is closed: the grader counts nothing written after it."""
        if ended[0]:
            return
        record = {"end": True, "exitstatus": int(exitstatus), "session": session, "tampered": sorted(set(tampered + changes()))}
        if crossing is not None:
            record["refused"] = dict(crossing.refusals)
        emit(record)
        ended[0] = True
        close(fd)

    def pytest_sessionfinish(session, exitstatus) -> None:
        end(exitstatus, True)

    def audit(event, args):
        if event in ("gc.get_objects", "gc.get_referrers", "gc.get_referents"):
            note(event)

    sys.addaudithook(audit)
    namespace = type("ReportPlugin", (), {})()
    for hook in (pytest_plugin_registered, pytest_runtest_logreport, pytest_runtest_logfinish, pytest_collectreport, pytest_sessionfinish):
        setattr(namespace, hook.__name__, hook)
    return namespace, end


def main() -> None:
    root, key_path, channel, *args = sys.argv[1:]
    del sys.argv[1:]
    import fcntl

    fd = fcntl.fcntl(int(channel), fcntl.F_DUPFD_CLOEXEC, random.SystemRandom().randrange(64, 240))
    os.close(int(channel))
    crossing = None
    if args and args[0].startswith("--crossing="):
        # The task's functions are proxies into the episode's process: their calls go out on the channel, the
        # answers come in on the call descriptor given after the path.
        path, _, calls = args.pop(0).partition("=")[2].rpartition(":")
        crossing = type(sys)("_composer_crossing")
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), crossing.__dict__)
        answers = fcntl.fcntl(int(calls), fcntl.F_DUPFD_CLOEXEC, 240)
        os.close(int(calls))
        shared_tmp = args.pop(0).partition("=")[2] if args and args[0].startswith("--shared-tmp=") else None
        if shared_tmp:
            args.insert(0, f"--basetemp={shared_tmp}/basetemp")
        crossing.connect(fd, answers, shared_tmp)
        sys.modules["_composer_crossing"] = crossing
    with open(key_path, "rb") as f:
        send = _sender(fd, bytes.fromhex(f.read().decode().strip()))
    os.unlink(key_path)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        os.environ.pop(name, None)
    root = os.path.realpath(root)
    _source_only(root)
    os.chdir(root)
    sys.path.insert(0, root)
    import _pytest.assertion.rewrite
    import pytest

    # pytest's cache of rewritten test modules and conftests is bytecode too: never read.
    _pytest.assertion.rewrite._read_pyc = lambda *args, **kwargs: None
    plugin, end = report_plugin(fd, send, root, crossing)
    del send, fd
    try:
        code = int(pytest.main(args, plugins=[plugin]))
    except BaseException:
        code = 3
    # pytest can stop before a session starts (a conftest that fails to import): a complete run with no tests.
    end(code, False)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
