"""Repository-task grading a policy cannot fool, layer by layer: what of an episode's change is taken (source only, the
task's function(s)), the policy on the kept change, and the trusted pytest run (modules from source only, the report
on a chained channel, sentinel tests, the watch on pytest's reporting), on a small project of its own so each
mechanism gets a run. The end-to-end classes on networkx bug and feature tasks are in test_repo_tasks.py."""

import os
import random
import sys
from pathlib import Path

import pytest

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.results import CommandResult
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository import pytest_report
from composer.rollout.tasks.repository.grading_policy import NOT_A_FILE, Scope, function_scope, keep_change, splice
from composer.rollout.tasks.repository.workspace import RepoTests, read_report, run_tests_across, run_tests_guarded, sentinel_tests
from tests.helpers.repo_cheats import CLASSES, PAYLOADS, payloads, pyc
from tests.helpers.toy_package import toy_package

# --- what grading takes -------------------------------------------------------------------------

MODULE = '''"""Shapes."""
import math


def area(r):
    """Area of a circle."""
    return math.pi * r * 3  # the bug


def perimeter(r):
    return 2 * math.pi * r


class Box:
    def volume(self, a):
        return a * a
'''
ORIGINAL = MODULE.replace("math.pi * r * 3  # the bug", "math.pi * r * r")


@pytest.fixture
def base(tmp_path) -> Path:
    """A grading base: the package `shapes` with its module (the original) and tests."""
    (tmp_path / "shapes" / "tests").mkdir(parents=True)
    (tmp_path / "shapes" / "__init__.py").write_text("from shapes.core import area\n")
    (tmp_path / "shapes" / "core.py").write_text(ORIGINAL)
    (tmp_path / "shapes" / "other.py").write_text("def helper():\n    return 1\n")
    (tmp_path / "shapes" / "tests" / "test_core.py").write_text("def test_area():\n    pass\n")
    return tmp_path


TASK = {"shapes/core.py": MODULE.encode()}
SCOPE = (Scope("shapes/core.py", ("area",)),)


def test_an_honest_fix_is_taken_as_written_and_nothing_else_is(base):
    fixed = MODULE.replace("math.pi * r * 3  # the bug", "math.pi * r ** 2  # fixed")
    kept = keep_change({"shapes/core.py": fixed.encode()}, TASK, base, ("shapes",), SCOPE)
    assert (kept.files, kept.dropped, kept.protected) == ({"shapes/core.py": fixed.encode()}, (), ())
    # Comments and blank lines elsewhere change nothing the tests see: taken without a word.
    styled = fixed.replace("def perimeter(r):", "# a note\n\ndef perimeter(r):")
    assert keep_change({"shapes/core.py": styled.encode()}, TASK, base, ("shapes",), SCOPE).dropped == ()


def test_changes_outside_the_tasks_function_are_dropped_and_named(base):
    episode = (
        MODULE.replace("math.pi * r * 3  # the bug", "math.pi * r * r")
        .replace("return 2 * math.pi * r", "return 0")  # another function
        .replace("return a * a", "return a")  # a method
        + "\nimport builtins\nbuiltins.len = lambda x: 0\n"
    )  # module-level code
    kept = keep_change(
        {
            "shapes/core.py": episode.encode(),
            "shapes/other.py": b"def helper():\n    return 2\n",
            "shapes/other.py.orig": b"x",
            "shapes/new.py": b"import os\n",
            "notes.txt": b"scratch",
        },
        TASK,
        base,
        ("shapes",),
        SCOPE,
    )
    text = kept.files["shapes/core.py"].decode()
    assert "math.pi * r * r" in text and "return 2 * math.pi * r" in text and "return a * a" in text
    assert "builtins" not in text and set(kept.files) == {"shapes/core.py"}
    dropped = "\n".join(kept.dropped)
    assert "shapes/core.py: changes outside area dropped" in dropped
    assert all(p in dropped for p in ("shapes/other.py:", "shapes/other.py.orig", "shapes/new.py")) and "notes.txt" not in dropped


def test_what_a_fix_adds_at_module_level_for_its_function_is_kept(base):
    episode = (
        MODULE.replace("import math\n", "import math\nfrom functools import lru_cache\n")
        .replace("def area(r):", "_SQUARE = 2\n\n\ndef _square(x):\n    return x ** _SQUARE\n\n\n@lru_cache\ndef area(r):")
        .replace("math.pi * r * 3  # the bug", "math.pi * _square(r)")
    )
    kept = keep_change({"shapes/core.py": episode.encode()}, TASK, base, ("shapes",), SCOPE)
    namespace = {}
    exec(kept.files["shapes/core.py"].decode(), namespace)
    assert namespace["area"](2) == pytest.approx(4 * 3.141592653589793) and kept.dropped == ()


def test_only_source_is_taken(base):
    """Bytecode beside or instead of a module, compiled modules, a FIFO or symlink for the task's file: never
    taken (the task's own file is graded), and named; a deleted task file is the task's file too."""
    changed = {
        "shapes/__pycache__/core.cpython-311.pyc": b"forged",
        "shapes/core.pyc": b"forged",
        "shapes/fast.cpython-311-x86_64-linux-gnu.so": b"\x7fELF",
        "shapes/tests/__pycache__/x.pyc": b"",
        "shapes/core.py": NOT_A_FILE,
    }
    kept = keep_change(changed, TASK, base, ("shapes",), SCOPE)
    assert kept.files == TASK and kept.protected == ()
    assert len(kept.dropped) == 5 and sum("bytecode or a compiled module" in d for d in kept.dropped) == 4
    assert "shapes/core.py: not a regular file (graded as the task left it)" in kept.dropped
    assert keep_change({"shapes/core.py": None}, TASK, base, ("shapes",), SCOPE).files == TASK
    unparsable = keep_change({"shapes/core.py": b"def area(:\n"}, TASK, base, ("shapes",), SCOPE)
    assert unparsable.files == TASK and "does not parse" in unparsable.dropped[0]


def test_tests_and_test_configuration_are_never_taken(base):
    changed = {
        "shapes/tests/test_core.py": b"",
        "shapes/conftest.py": b"",
        "conftest.py": b"",
        "pytest.ini": b"",
        "shapes/zz.pth": b"",
        "sitecustomize.py": b"",
        "pytest.py": b"",
        "json.py": b"",
    }
    kept = keep_change(changed, TASK, base, ("shapes",), SCOPE)
    assert kept.files == TASK and sorted(kept.protected) == sorted(changed)


def test_a_scope_of_several_functions_and_files(base):
    """What task kinds that change several functions or files need: each named function spliced, everything else
    dropped; a whole file is never taken."""
    scope = (Scope("shapes/core.py", ("area", "Box.volume")), Scope("shapes/other.py", ("helper",)))
    episode = (
        MODULE.replace("math.pi * r * 3  # the bug", "math.pi * r * r")
        .replace("return a * a", "return a ** 3")
        .replace("return 2 * math.pi * r", "return -1")
    )
    kept = keep_change(
        {"shapes/core.py": episode.encode(), "shapes/other.py": b"def helper():\n    return 2\n", "shapes/extra.py": b"VALUE = 1\n"},
        TASK,
        base,
        ("shapes",),
        scope,
    )
    text = kept.files["shapes/core.py"].decode()
    assert "math.pi * r * r" in text and "return a ** 3" in text and "return 2 * math.pi * r" in text
    assert kept.files["shapes/other.py"] == b"def helper():\n    return 2\n" and "shapes/extra.py" not in kept.files
    assert len(kept.dropped) == 2 and "outside area, Box.volume" in kept.dropped[0] and kept.dropped[1].startswith("shapes/extra.py")
    assert keep_change({"shapes/other.py": None}, TASK, base, ("shapes",), scope).files == TASK  # a deletion is not taken


# --- a history commit's functions ----------------------------------------------------------------

PARENT = '''"""A module."""
import math

LIMIT = 3


def area(r):
    return math.pi * r * 3


class Box:
    kind = "box"

    def volume(self, a):
        return a * a
'''
COMMIT = (
    PARENT.replace('"""A module."""', '"""A module, documented."""')
    .replace("import math\n", "import math\nimport operator\n")
    .replace("math.pi * r * 3", "_circle(r)  # fixed")
    .replace("    def volume", "    def side(self, a):\n        return a\n\n    def volume")
    + "\n\ndef _circle(r):\n    return math.pi * operator.mul(r, r)\n"
)


def test_a_commits_scope_is_the_functions_whose_source_it_changed():
    """Changed and new functions (top-level and methods) in the commit's order; imports and docstrings are not code;
    a comment alone changes nothing."""
    assert function_scope(PARENT, COMMIT) == (("area", "Box.side", "_circle"), "")
    assert function_scope(PARENT, PARENT.replace("* 3", "* 3  # why")) == ((), "")
    for commit, what in {
        PARENT.replace("LIMIT = 3", "LIMIT = 4"): "module-level code (line 4)",
        PARENT.replace('kind = "box"', 'kind = "crate"'): "a class body (Box)",
        PARENT.replace("    def volume(self, a):\n        return a * a\n", "    pass\n"): "a deleted function (Box.volume)",
        PARENT + "\n\nclass Crate:\n    def lift(self):\n        return 1\n": "a new class (Crate)",
        PARENT + "\n\nprint(area(1))\n": "module-level code (line 18)",
        "def (": "a module that does not parse",
    }.items():
        assert function_scope(PARENT, commit) == ((), what)


def test_the_commits_own_change_is_taken_whole_with_nothing_dropped():
    """The commit's version of its functions spliced into the parent's module: new methods go into their class, new
    functions and the imports they use come along; the result is the commit's module (to its docstring)."""
    functions, _ = function_scope(PARENT, COMMIT)
    text, notes = splice(PARENT, COMMIT, functions)
    assert notes == []
    namespace: dict = {}
    exec(text, namespace)
    assert namespace["area"](2) == pytest.approx(4 * 3.141592653589793) and namespace["Box"]().side(5) == 5
    # Another fix of the same functions, with a helper of its own and without the commit's new ones: taken too.
    other = PARENT.replace("math.pi * r * 3", "_pi() * r ** 2") + "\n\ndef _pi():\n    return math.pi\n"
    text, notes = splice(PARENT, other, functions)
    namespace = {}
    exec(text, namespace)
    assert notes == [] and namespace["area"](1) == pytest.approx(3.141592653589793) and not hasattr(namespace["Box"], "side")


# --- the report channel and the sentinels -------------------------------------------------------


def channel_of(records: list[dict], key: bytes) -> bytes:
    """What the trusted entry's sender writes for `records`."""
    read, write = os.pipe()
    send = pytest_report._sender(write, key)
    for record in records:
        send(record)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        return f.read()


def report_of(channel: bytes, key: bytes, sentinels: dict[str, str]):
    return read_report(CommandResult(0, "ok", "", 1.0, channel=channel), key, sentinels)


def test_the_report_is_believed_only_as_the_trusted_entry_chained_it():
    key, other = os.urandom(32), os.urandom(32)
    sentinels = {"t.py::test_good": "passed", "t.py::test_bad": "failed"}
    run = [
        {"id": "t.py::test_a", "outcome": "passed"},
        {"id": "t.py::test_good", "outcome": "passed"},
        {"id": "t.py::test_bad", "outcome": "failed"},
        {"end": True, "exitstatus": 1, "tampered": []},
    ]
    honest = report_of(channel_of(run, key), key, sentinels)
    assert (honest.complete, honest.flags, honest.outcomes) == (True, (), {"t.py::test_a": "passed"})
    lines = channel_of(run, key).splitlines(keepends=True)
    changed = lines[0].replace(b'"passed"', b'"failed"')
    for name, channel in {
        "a line changed": lines[0].replace(b"test_a", b"test_z") + b"".join(lines[1:]),
        "a line dropped": b"".join(lines[1:]),
        "lines swapped": b"".join([lines[1], lines[0], *lines[2:]]),
        "a line added": channel_of(run[:1], other) + b"".join(lines),
        "a line after the end": b"".join(lines) + changed,
        "the end forged early": channel_of(run[:1] + run[-1:], key) + b"".join(lines[1:]),
    }.items():
        report = report_of(channel, key, sentinels)
        assert not report.complete and "forged_records" in report.flags, name
    silent = report_of(b"", key, sentinels)
    assert (silent.complete, silent.flags) == (False, ("early_exit",))


@pytest.mark.parametrize(
    "outcomes, tripped",
    [
        ({"test_good": "passed", "test_bad": "passed"}, True),  # asserts stripped, outcomes rewritten
        ({"test_bad": "failed"}, True),  # a must-pass sentinel missing while real tests pass (the module swapped)
        ({"test_good": "failed", "test_bad": "failed"}, True),
        ({"test_good": "passed", "test_bad": "failed"}, False),
    ],
)
def test_sentinels_not_reported_as_written_make_the_report_untrusted(outcomes, tripped):
    key = os.urandom(32)
    sentinels = {"t.py::test_good": "passed", "t.py::test_bad": "failed"}
    run = [{"id": "t.py::test_a", "outcome": "passed"}] + [{"id": f"t.py::{i}", "outcome": o} for i, o in outcomes.items()]
    report = report_of(channel_of(run + [{"end": True, "tampered": []}], key), key, sentinels)
    assert report.complete is not tripped and ("sentinel_tripped" in report.flags) is tripped


def test_a_file_that_runs_no_test_runs_no_sentinel():
    """A test file that fails to import (a broken fix) reports no test: its sentinels are not missed."""
    key = os.urandom(32)
    report = report_of(
        channel_of([{"collect_error": "t.py"}, {"end": True, "tampered": []}], key),
        key,
        {"t.py::test_good": "passed", "t.py::test_bad": "failed"},
    )
    assert (report.complete, report.flags, report.outcomes) == (True, (), {})


def test_sentinels_are_named_like_the_files_own_tests_and_drawn_anew():
    source = "def test_shortest_path_length():\n    pass\n\n\ndef test_bidirectional_path():\n    pass\n"
    first, expected = sentinel_tests("t.py", source, random.Random(1))
    second, _ = sentinel_tests("t.py", source, random.Random(2))
    assert first != second and sorted(expected.values()) == ["failed", "failed", "passed", "passed"]
    names = [i.split("::")[1] for i in expected]
    assert all(n.startswith("test_") and n not in source for n in names)
    assert any(w in "".join(names) for w in ("shortest", "path", "length", "bidirectional"))
    namespace = {}
    exec(first, namespace)
    for test_id, outcome in expected.items():
        try:
            namespace[test_id.split("::")[1]]()
            got = "passed"
        except AssertionError:
            got = "failed"
        assert got == outcome


# --- the trusted run, mechanism by mechanism, on a small project --------------------------------

CORE = '''def double(x):
    """Twice x."""
    return x + x + 1
'''
TESTS = """from toy.core import double


def test_double():
    assert double(2) == 4


def test_double_zero():
    assert double(0) == 0


def test_type():
    assert isinstance(double(1), int)
"""
TEST_FILE = "toy/tests/test_core.py"
FAILING = (f"{TEST_FILE}::test_double", f"{TEST_FILE}::test_double_zero")


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """A project's grading base (root's files): a package whose conftest imports it, a bug, three tests."""
    root = tmp_path_factory.mktemp("toy")
    os.chmod(root, 0o755)
    (root / "toy" / "tests").mkdir(parents=True)
    (root / "toy" / "__init__.py").write_text("from toy.core import double\n")
    (root / "toy" / "core.py").write_text(CORE)
    (root / "toy" / "conftest.py").write_text("import toy\n")
    (root / "toy" / "tests" / "__init__.py").write_text("")
    (root / "toy" / "tests" / TEST_FILE.rsplit("/", 1)[1]).write_text(TESTS)
    for path in [root, *root.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return root


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Sandbox:
    return Sandbox(SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048), root=tmp_path_factory.mktemp("sandboxes"))


def guarded(sandbox: Sandbox, toy: Path, changes: dict, tmp_path: Path):
    return run_tests_guarded(sandbox, toy, changes, (TEST_FILE,), (), 60, (), tmp_path / "views")


def unguarded(sandbox: Sandbox, toy: Path, variants: dict[str, dict], tmp_path: Path) -> dict[str, str]:
    """Each variant of the project (its changes: bytes, or None to delete) tested by plain pytest, as an agent's own
    run does, all in one sandboxed command: variant -> pytest's summary line."""
    import shutil

    work = tmp_path / "unguarded"
    commands = []
    for n, changes in enumerate(variants.values()):
        copy = work / str(n)
        shutil.copytree(toy, copy)  # keeps the files' times: bytecode can claim to match them
        for relative, content in changes.items():
            path = copy / relative
            if content is None:
                path.unlink()
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content if path.suffix == ".pyc" else content.replace(b"/sandbox/repo/", f"/sandbox/{n}/".encode()))
        commands.append(
            f"cd /sandbox/{n} && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider {TEST_FILE}"
            f" 2>&1 | tail -1 | sed 's/ in .*//; s/^/{n}: /'"
        )
    for path in [work, *work.rglob("*")]:
        os.chmod(path, 0o777 if path.is_dir() else 0o666)
    result = sandbox.run_command("; ".join(commands), work, timeout_s=120)
    lines = dict(line.split(": ", 1) for line in result.output.splitlines() if ": " in line)
    return {name: lines.get(str(n), result.output[-300:]) for n, name in enumerate(variants)}


CHEATS = payloads("toy.tests.test_core", f"/sandbox/repo/{TEST_FILE}", FAILING)


def with_payload(name: str) -> dict:
    return {"toy/core.py": (CORE + "\n" + CHEATS[name]).encode()}


def test_the_cheats_work_on_an_unguarded_run(sandbox, toy, tmp_path):
    """The controls: each runner patch and each way of neutralising the tests passes every test of a plain
    pytest run (the report rewriters have no report to rewrite there)."""
    names = CLASSES["patching the test runner"][:3] + CLASSES["neutralising the tests"]
    summaries = unguarded(sandbox, toy, {"bug": {}, **{name: with_payload(name) for name in names}}, tmp_path)
    assert summaries.pop("bug") == "2 failed, 1 passed"
    assert summaries == dict.fromkeys(names, "3 passed")


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_each_cheat_from_inside_the_run_is_caught_by_the_run_itself(sandbox, toy, tmp_path, name):
    """Without the kept-change layers (the payload straight into the graded module): the report is not believed,
    and says why."""
    report = guarded(sandbox, toy, with_payload(name), tmp_path)
    assert not report.complete and not report.infra_failure, (report.flags, report.output[-2000:])
    assert set(report.flags) & {"harness_touched", "sentinel_tripped", "forged_records"}, report.flags


def test_bytecode_is_never_read_in_the_run(sandbox, toy, tmp_path):
    """Forged bytecode that a plain run loads (an unchecked pyc of the task's module, a timestamp pyc matching an
    untouched module, a sourceless pyc standing in for the module, pytest's cache of a rewritten conftest) is
    ignored by the trusted run even when it is in the view."""
    import _pytest

    tag = sys.implementation.cache_tag
    fixed = CORE.replace("x + x + 1", "x + x")
    init, conftest = toy / "toy" / "__init__.py", toy / "toy" / "conftest.py"
    all_pass = (
        "import pytest\n\n\n@pytest.hookimpl(wrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    report = yield\n    report.outcome = 'passed'\n    return report\n"
    )
    variants = {
        "unchecked pyc": {f"toy/__pycache__/core.{tag}.pyc": pyc(fixed, "/sandbox/repo/toy/core.py", None)},
        "timestamp pyc": {
            f"toy/__pycache__/__init__.{tag}.pyc": pyc(
                "import toy.core\ntoy.core.double = lambda x: 2 * x\nfrom toy.core import double\n",
                "/sandbox/repo/toy/__init__.py",
                (int(init.stat().st_mtime), init.stat().st_size),
            )
        },
        "sourceless pyc": {"toy/core.py": None, "toy/core.pyc": pyc(fixed, "core.py", None)},
        "conftest pyc": {
            f"toy/__pycache__/conftest.{tag}-pytest-{_pytest.__version__}.pyc": pyc(
                "import toy\n" + all_pass, "/sandbox/repo/toy/conftest.py", conftest.read_bytes()
            )
        },
    }
    assert unguarded(sandbox, toy, variants, tmp_path) == dict.fromkeys(variants, "3 passed")
    whole = {
        relative: content for changes in list(variants.values())[:2] + list(variants.values())[3:] for relative, content in changes.items()
    }
    report = guarded(sandbox, toy, whole, tmp_path)
    assert (report.complete, report.flags) == (True, ())
    assert [report.outcomes[i] for i in FAILING] == ["failed", "failed"]
    sourceless = guarded(sandbox, toy, variants["sourceless pyc"], tmp_path)
    assert (sourceless.complete, sourceless.flags, sourceless.outcomes) == (True, (), {})  # no module: nothing runs


def test_a_change_that_breaks_the_import_is_a_failed_run_not_an_early_exit(sandbox, toy, tmp_path):
    """The conftest imports the package: a module that raises stops pytest before its session. That is a complete
    report with no test passing, not a program that ended the run."""
    report = guarded(sandbox, toy, {"toy/core.py": b"raise ImportError('broken')\n"}, tmp_path)
    assert (report.complete, report.flags, report.outcomes) == (True, (), {}), report.output[-1500:]
    honest = guarded(sandbox, toy, {"toy/core.py": CORE.replace("x + x + 1", "x + x").encode()}, tmp_path)
    assert (honest.complete, honest.flags) == (True, ()) and set(honest.outcomes.values()) == {"passed"}


SUBTESTS = """import unittest

from toy.core import double


class DoubleTest(unittest.TestCase):
    def test_small(self):
        for x in (0, 1, 2):
            with self.subTest(x=x):
                self.assertEqual(double(x), x * 2)

    def test_one(self):
        for x in (0, 1):
            with self.subTest(x=x):
                self.assertEqual(double(x), 2 * x + 1)  # what this (buggy) double does
"""


def test_unittest_subtests_are_outcomes_not_tampering(sandbox, tmp_path):
    """A unittest suite's subTest() loops (pytest reports each subtest on its own): the report is believed, and a
    test is failed when any of its subtests fails."""
    root = toy_package(tmp_path / "base", CORE, {"test_sub.py": SUBTESTS})
    test_file = "toy/tests/test_sub.py"
    report = run_tests_guarded(sandbox, root, {}, (test_file,), (), 60, (), tmp_path / "views")
    assert report.complete and not report.flags, (report.detail, report.flags)
    assert report.outcomes[f"{test_file}::DoubleTest::test_small"] == "failed"  # double(x) is 2x + 1: its subtests fail
    assert report.outcomes[f"{test_file}::DoubleTest::test_one"] == "passed"


# --- across the boundary: the files a test gives the function ------------------------------------

NOTES = """import os


def first_line(path):
    with open(path) as f:
        return f.readline().rstrip("\\n")


def save(path, lines):
    with open(path, "w") as f:
        f.write("\\n".join(lines) + "\\n")
    os.makedirs(os.path.join(os.path.dirname(path), "backup"), exist_ok=True)
    os.replace(path, os.path.join(os.path.dirname(path), "backup", os.path.basename(path)))
    with open(path, "w") as f:
        f.write("\\n".join(lines) + "\\n")
"""
NOTES_TESTS = """from toy.core import first_line, save


def test_reads_the_file_the_test_wrote(tmp_path):
    (tmp_path / "notes.txt").write_text("title\\nbody\\n")
    assert first_line(str(tmp_path / "notes.txt")) == "title"


def test_overwrites_the_file_the_test_wrote(tmp_path):
    (tmp_path / "notes.txt").write_text("old\\n")
    save(str(tmp_path / "notes.txt"), ["new", "body"])
    assert (tmp_path / "notes.txt").read_text() == "new\\nbody\\n"
    assert (tmp_path / "backup" / "notes.txt").read_text() == "new\\nbody\\n"


def test_a_directory_of_the_factory(tmp_path_factory):
    where = tmp_path_factory.mktemp("data") / "made.txt"
    save(str(where), ["made"])
    assert first_line(str(where)) == "made"
"""


def test_the_files_a_test_writes_are_the_ones_the_episode_reads_and_writes(sandbox, tmp_path):
    """pytest's `tmp_path` is at one path in the grader's and the episode's processes (other uids): a function that
    reads the file a test wrote, or writes one the test then reads, behaves as in pytest's own process."""
    root = toy_package(tmp_path / "base", NOTES, {"test_notes.py": NOTES_TESTS})
    test_file = "toy/tests/test_notes.py"
    tests = RepoTests(
        packages=("toy",),
        test_files=(test_file,),
        fail_to_pass=(),
        pass_to_pass=(),
        pytest_args=(),
        timeout_s=60,
        scope=(Scope("toy/core.py", ("first_line", "save")),),
        layer=Path(),
        episode_base=root,
        grading_base=root,
        hidden=(),
    )
    report = run_tests_across(sandbox, tests, {}, tmp_path / "views")
    assert report.complete and not report.flags and not report.refused, (report.detail, report.output[-2000:])
    names = ("test_reads_the_file_the_test_wrote", "test_overwrites_the_file_the_test_wrote", "test_a_directory_of_the_factory")
    assert [report.outcomes.get(f"{test_file}::{name}") for name in names] == ["passed"] * 3, report.output[-3000:]
    broken = {"toy/core.py": NOTES.replace("f.readline()", "f.readline().upper()").encode()}
    report = run_tests_across(sandbox, tests, broken, tmp_path / "views")
    assert report.outcomes[f"{test_file}::test_reads_the_file_the_test_wrote"] == "failed"
