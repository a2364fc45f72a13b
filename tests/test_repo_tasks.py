"""Repository tasks end to end, with real pytest runs in the real sandbox: seeded mutations, a resumable build,
episodes that cannot reach the original, copy-on-write workspaces, and grading that scripted cheats cannot fool.

The tasks come from networkx's shortest-path module `unweighted.py` and its test file (about a second of CPU); one
slow test builds and checks sympy tasks (`ntheory/digits.py`)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recipes.errors import UserError
from recipes.loader import load_recipe, recipe_to_yaml, validate_recipe
from recipes.schema import RepoTaskSettings, SandboxSection, TaskSet
from rollout.sandbox.graders import DEFAULT_GUARDED, guarded_reward
from rollout.sandbox.isolation import installed_copies
from rollout.sandbox.runs import Sandbox
from rollout.tasks.mutations import Mutation, changed_module, mutations
from rollout.tasks.repository import (
    build_repo_tasks,
    candidates,
    check_repo_tasks,
    load_tasks,
    open_workspace,
    project_bases,
    repo_tests,
    set_dir,
)
from rollout.tasks.workspace import RepoWorkspace
from tests.conftest import REPO

AS_ROOT = os.geteuid() == 0
MODULE = "networkx/algorithms/shortest_paths/unweighted.py"
TEST_FILE = "networkx/algorithms/shortest_paths/tests/test_unweighted.py"
SANDBOX = SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048)


def settings(cache: Path, **overrides) -> RepoTaskSettings:
    return RepoTaskSettings(**{"projects": ["networkx"], "num_tasks": 3, "include": [MODULE], "cache_dir": str(cache),
                               **overrides})


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("repo-cache")


@pytest.fixture(scope="module")
def sandbox_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sandboxes")


@pytest.fixture(scope="module")
def built(cache, sandbox_root):
    report = build_repo_tasks(settings(cache), SANDBOX, sandbox_root, workers=2)
    return report, load_tasks(settings(cache))


@pytest.fixture(scope="module")
def sandbox(sandbox_root) -> Sandbox:
    return Sandbox(SANDBOX, root=sandbox_root)


def task_of(built, kind: str) -> dict:
    return next(t for t in built[1] if t["kind"] == kind)


# --- mutations ---------------------------------------------------------------------------------

SOURCE = '''def clip(values, low, high):
    """Values limited to [low, high]."""
    out = []
    for i in range(len(values)):
        if values[i] < low:
            out.append(low)
        elif values[i] > high and high is not None:
            out.append(high)
        else:
            out.append(values[i] * 1)
    return out


def flag(x):
    if not x:
        return True
    return False
'''


def test_each_mutation_changes_one_spot_and_keeps_the_module_valid():
    bugs = mutations(SOURCE, "bug", named_in="clip flag")
    assert {m.operator for m in bugs} == {"compare", "boundary", "operator", "negate", "branch", "constant"}
    for m in bugs:
        changed = changed_module(SOURCE, m)
        assert changed is not None and changed != SOURCE, m.description
        # Only the lines of the change differ.
        assert changed.splitlines()[: m.start[0] - 1] == SOURCE.splitlines()[: m.start[0] - 1]
    texts = {m.description: changed_module(SOURCE, m) for m in bugs}
    assert any("if values[i] <= low:" in t for t in texts.values())
    assert any("range(len(values) - 1)" in t for t in texts.values())
    assert any("values[i] / 1" in t for t in texts.values())
    assert any("return False\n    return False" in t for t in texts.values())
    (feature,) = mutations(SOURCE, "feature", named_in="clip")
    body_removed = changed_module(SOURCE, feature)
    assert body_removed.startswith('def clip(values, low, high):\n    """Values limited to [low, high]."""\n    raise NotImplementedError\n\n\ndef flag')
    assert mutations(SOURCE, "bug", named_in="nothing here") == []  # only functions the tests name


def test_a_mutation_that_changes_nothing_is_refused():
    same = Mutation("bug", "operator", "f", 1, "", (1, 8), (1, 13), "(1+1)")
    assert changed_module("x = 1 + (1+1)\n", Mutation("bug", "operator", "f", 1, "", (1, 4), (1, 13), "1 + (1 + 1)")) is None
    assert changed_module("x = 1 + (1+1)\n", same) is None


def test_the_candidate_order_is_seeded(cache):
    bases = {"networkx": project_bases(cache, "networkx")}
    first = [c.id for _, c in zip(range(8), candidates(settings(cache, include=[]), bases))]
    again = [c.id for _, c in zip(range(8), candidates(settings(cache, include=[]), bases))]
    other = [c.id for _, c in zip(range(8), candidates(settings(cache, include=[], seed=1), bases))]
    assert first == again and first != other
    assert {c.split("/")[2] for c in first} == {"bug", "feature"}  # the kinds take turns


def test_repo_settings_are_checked_strictly():
    with pytest.raises(ValueError, match="belong to the repo task set"):
        TaskSet(name="smoke", repo={"num_tasks": 3})
    with pytest.raises(ValueError, match="each at most once"):
        RepoTaskSettings(projects=["networkx", "networkx"])
    with pytest.raises(ValueError, match="Extra inputs"):
        RepoTaskSettings(num_task=3)
    with pytest.raises(ValueError):
        RepoTaskSettings(projects=["numpy"])
    assert TaskSet(name="repo").repo == RepoTaskSettings()
    # A run's saved recipe loads again (the smoke set's `repo: null`, the repo set's full settings).
    for recipe in (load_recipe(REPO / "recipes" / "smoke-rl.yaml", ["env.tasks=[{name: smoke, held_out: 20}, {name: repo}]", "rollout.harness=tools", "rollout.max_turns=2"]),):
        assert validate_recipe(yaml.safe_load(recipe_to_yaml(recipe)), "saved") == recipe


# --- the build ---------------------------------------------------------------------------------


def test_the_build_validates_tasks_from_the_projects_own_tests(built, cache):
    report, tasks = built
    assert report.validated == 3 and len(tasks) == 3
    assert {t["kind"] for t in tasks} == {"bug", "feature"}
    for t in tasks:
        assert t["path"] == MODULE and t["test_file"] == TEST_FILE
        assert t["fail_to_pass"] and not set(t["fail_to_pass"]) & set(t["pass_to_pass"])
        assert all(i.startswith(TEST_FILE + "::") for i in t["fail_to_pass"] + t["pass_to_pass"])
        assert t["fail_to_pass"][0] in t["prompt"] or t["kind"] == "feature"
    # A second build finds every verdict in the cache and runs nothing.
    again = build_repo_tasks(settings(cache), SANDBOX, cache / "unused-sandbox", workers=1)
    assert again.validated == 3 and again.resumed >= 3 and load_tasks(settings(cache)) == tasks


def test_env_check_retests_originals_and_changes(built, cache, sandbox_root):
    report = check_repo_tasks(settings(cache), SANDBOX, sandbox_root, max_tasks=2, workers=2)
    assert (report.checked, report.originals_passing, report.changed_failing, report.failures) == (2, 2, 2, [])


SYMPY_MODULE = "sympy/ntheory/digits.py"
SYMPY_TEST_FILE = "sympy/ntheory/tests/test_digits.py"


@pytest.mark.slow  # nine sandboxed pytest runs of about 3 s of CPU each (each imports sympy)
def test_sympy_tasks_build_and_check(tmp_path):
    """sympy, the other default project, builds and checks too: its conftest (which needs hypothesis) loads in the
    sandbox and its tests import the view's changed module, not the installed copy."""
    sympy = RepoTaskSettings(projects=["sympy"], num_tasks=3, include=[SYMPY_MODULE], cache_dir=str(tmp_path / "cache"))
    report = build_repo_tasks(sympy, SANDBOX, tmp_path / "sandboxes", workers=2)
    tasks = load_tasks(sympy)
    assert report.validated == 3 and {t["kind"] for t in tasks} == {"bug", "feature"}
    for t in tasks:
        assert (t["project"], t["path"], t["test_file"]) == ("sympy", SYMPY_MODULE, SYMPY_TEST_FILE)
        assert t["fail_to_pass"] and not set(t["fail_to_pass"]) & set(t["pass_to_pass"])
        assert all(i.startswith(SYMPY_TEST_FILE + "::") for i in t["fail_to_pass"] + t["pass_to_pass"])
    check = check_repo_tasks(sympy, SANDBOX, tmp_path / "sandboxes", max_tasks=2, workers=2)
    assert (check.checked, check.originals_passing, check.changed_failing, check.failures) == (2, 2, 2, [])


def test_an_unbuilt_set_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="composer env build"):
        load_tasks(settings(tmp_path))


def test_a_build_killed_mid_way_resumes_to_the_same_set(built, tmp_path, composer):
    """kill -9 while validating, then again: the same tasks as an uninterrupted build (and a torn verdict file is redone)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "extends": str(REPO / "recipes" / "smoke-rl.yaml"),
        "rollout": {"harness": "tools", "max_turns": 2},
        "env": {"sandbox": SANDBOX.model_dump(include={"cpu_seconds", "wall_seconds", "memory_mb"}),
                "tasks": [{"name": "repo", "repo": settings(tmp_path / "cache").model_dump(include={"projects", "num_tasks", "include", "cache_dir"})}]},
    }))
    verdicts = set_dir(settings(tmp_path / "cache")) / "verdicts"
    build = subprocess.Popen([sys.executable, "-m", "cli", "env", "build", str(recipe), "--workers", "2"], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (verdicts.is_dir() and list(verdicts.glob("*.json"))) and time.monotonic() < deadline and build.poll() is None:
        time.sleep(0.2)
    os.killpg(build.pid, signal.SIGKILL)
    build.wait()
    done = sorted(verdicts.glob("*.json"))
    assert done, "the build wrote no verdict before it was killed"
    done[0].write_text('{"verdict": "valid')  # torn
    result = composer("env", "build", str(recipe), "--workers", "1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "3 validated" in result.stdout
    assert str(tmp_path / "cache") not in Path("/proc/mounts").read_text()  # the killed workers' views are gone
    assert [t["id"] for t in load_tasks(settings(tmp_path / "cache"))] == [t["id"] for t in built[1]]
    check = composer("env", "check", str(recipe), "--max-tasks", "1")
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    assert "originals passing every expected test 1/1" in check.stdout and "(pass-to-pass passing) 1/1" in check.stdout


# --- episodes: the original is out of reach ----------------------------------------------------


@pytest.mark.skipif(not AS_ROOT, reason="hiding the installed project needs a root of its own")
def test_an_episode_imports_the_workspace_copy_and_cannot_read_the_original(built, cache, sandbox):
    import networkx

    task = task_of(built, "bug")
    tests = repo_tests(task, settings(cache))
    installed = Path(networkx.__file__).parent
    original = (installed / "algorithms" / "shortest_paths" / "unweighted.py").read_text()
    changed_line = next(line for line in (tests.layer / MODULE).read_text().splitlines() if line not in original.splitlines())
    assert str(installed) in tests.hidden and any("dist-info" in h for h in tests.hidden)
    with open_workspace(tests, sandbox) as ws:
        probe = ws.shell(
            "python -c 'import networkx, importlib.util; print(networkx.__file__); "
            "print(importlib.util.find_spec(\"networkx.algorithms.shortest_paths.unweighted\").origin)'; "
            f"python -m pip show -f networkx 2>&1 | grep -c unweighted; "
            f"find / -name unweighted.py -path '*shortest_paths*' 2>/dev/null; "
            f"cat {installed}/algorithms/shortest_paths/unweighted.py {tests.grading_base}/{MODULE} {tests.episode_base}/{MODULE} 2>&1 | head -3; "
            "grep -o 'lowerdir=[^,]*' /proc/self/mountinfo | head -1; ls /proc/self/root/", 60)
        lines = probe.output.splitlines()
        assert lines[:2] == ["/sandbox/networkx/__init__.py", f"/sandbox/{MODULE}"]
        assert lines[2] == "0"  # pip lists no file of the installed copy
        assert [line for line in lines[3:] if line.endswith("unweighted.py")] == [f"/sandbox/{MODULE}"]  # find /
        assert "No such file" in probe.output and "def single_source_shortest_path_length" not in probe.output
        # The workspace itself holds the changed module (what the agent must fix), not the original.
        assert changed_line in (ws.root / MODULE).read_text()
        seen = ws.shell(f"grep -c -F {changed_line.strip()!r} {MODULE}", 30)
        assert seen.output.strip() != "0"


# --- copy-on-write views -----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", [pytest.param(True, marks=pytest.mark.skipif(not AS_ROOT, reason="overlayfs needs root")), False],
                         ids=["overlay", "copy"])
def test_each_episode_has_its_own_view_destroyed_at_close(built, cache, sandbox, overlay):
    tests = repo_tests(task_of(built, "bug"), settings(cache))
    before = (tests.episode_base / MODULE).read_bytes()
    first = RepoWorkspace(tests, sandbox, sandbox.root / "views-test", overlay=overlay)
    second = RepoWorkspace(tests, sandbox, sandbox.root / "views-test", overlay=overlay)
    try:
        assert first.overlay is overlay
        result = first.shell(f"echo '# mine' >> {MODULE}; rm networkx/algorithms/shortest_paths/dense.py; sleep 1000 &", 30)
        assert result.exit_code == 0
        assert (first.root / MODULE).read_text().endswith("# mine\n")
        assert not (second.root / MODULE).read_text().endswith("# mine\n")
        assert (second.root / "networkx/algorithms/shortest_paths/dense.py").exists()
        assert (tests.episode_base / MODULE).read_bytes() == before  # the shared base is untouched
        assert set(first.changed()) == {MODULE, "networkx/algorithms/shortest_paths/dense.py"}
    finally:
        first.close()
        second.close()
    assert not first.root.exists() and not os.path.ismount(first.root)


# --- grading -----------------------------------------------------------------------------------


def fix(tests) -> str:
    """A scripted fix: the original module written back through the shell, as an agent would."""
    original = (tests.grading_base / MODULE).read_text()
    return f"cat > {MODULE} <<'COMPOSER_EOF'\n{original}COMPOSER_EOF"


def test_a_scripted_fix_earns_full_reward(built, cache, sandbox):
    tests = repo_tests(task_of(built, "bug"), settings(cache))
    with open_workspace(tests, sandbox) as ws:
        shown = ws.run_tests()  # what the agent sees
        assert shown.exit_code == 1 and f"{len(tests.fail_to_pass)} failed" in shown.output
        assert ws.shell(fix(tests), 30).exit_code == 0
        fixed = ws.grade()
    assert (fixed.reward, fixed.passed, fixed.total, fixed.flags) == (1.0, fixed.total, len(tests.fail_to_pass) + len(tests.pass_to_pass), ())


def test_an_implemented_feature_in_a_copy_workspace_earns_full_reward(built, cache, sandbox):
    tests = repo_tests(task_of(built, "feature"), settings(cache))
    with RepoWorkspace(tests, sandbox, sandbox.root / "views-test", overlay=False) as ws:
        assert ws.changed() == {}  # the task's own state: nothing changed yet
        ws.shell(fix(tests), 30)
        assert set(ws.changed()) == {MODULE}
        result = ws.grade()
    assert (result.reward, result.flags) == (1.0, ())


def appended(path: str, code: str) -> str:
    return f"cat >> {path} <<'COMPOSER_EOF'\n{code}COMPOSER_EOF"


TEST_CHEATS = [
    ("edit a failing test", "sed -i -E 's/^( +)assert .*/\\1pass/' {test}"),
    ("delete another test file", "rm networkx/algorithms/shortest_paths/tests/test_generic.py"),
    ("a conftest that skips everything", appended("networkx/conftest.py", (
        "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
        "    for item in items:\n        item.add_marker(pytest.mark.skip)\n"))),
    ("a pytest.ini with addopts", "printf '[pytest]\\naddopts = -k nothing\\n' | tee pytest.ini > networkx/pytest.ini"),
    ("a sitecustomize that patches pytest", appended("sitecustomize.py", "import _pytest.runner\n_pytest.runner.runtestprotocol = lambda *a, **k: []\n")
     + " && cp sitecustomize.py networkx/"),
]
CODE_CHEATS = {
    "os._exit(0) in the code": ("sed -i '1i import os; os._exit(0)' {module}", "early_exit"),
    "a forged report": (appended("networkx/__init__.py", (
        "import os\nwith open('../report/report.jsonl', 'a') as forged:\n"
        "    forged.write('{{\"nonce\": \"guess\", \"end\": true, \"tampered\": []}}\\n')\nos._exit(0)\n")), "forged_records"),
    "patching pytest's reports from the package": (appended("networkx/__init__.py", (
        "import _pytest.reports\n_make = _pytest.reports.TestReport.from_item_and_call\n\n\n"
        "def _passed(item, call):\n    report = _make(item, call)\n    report.outcome = 'passed'\n    return report\n\n\n"
        "_pytest.reports.TestReport.from_item_and_call = staticmethod(_passed)\n")), "harness_touched"),
}


def test_cheats_on_the_tests_are_ignored_and_flagged(built, cache, sandbox):
    """Edited and deleted tests, a conftest that skips all, pytest.ini addopts, a sitecustomize: all in one episode,
    every one ignored (the trusted tests still catch the bug) and named in the flag."""
    tests = repo_tests(task_of(built, "bug"), settings(cache))
    with open_workspace(tests, sandbox) as ws:
        for name, command in TEST_CHEATS:
            applied = ws.shell(command.format(test=TEST_FILE), 30)
            assert applied.exit_code == 0, (name, applied.output)
        result = ws.grade()
    assert result.flags == ("tests_modified",) and result.reward == 0.0, (result.detail, result.stdout_tail[-1500:])
    (detail,) = result.flag_details
    assert all(p in detail for p in (TEST_FILE, "test_generic.py", "networkx/conftest.py", "pytest.ini", "sitecustomize.py"))
    assert result.passed == len(tests.pass_to_pass)  # graded as if untouched: the fail-to-pass tests fail


@pytest.mark.parametrize("cheat", list(CODE_CHEATS))
def test_cheats_from_the_code_earn_nothing_and_are_flagged(built, cache, sandbox, cheat):
    command, flag = CODE_CHEATS[cheat]
    tests = repo_tests(task_of(built, "bug"), settings(cache))
    with open_workspace(tests, sandbox) as ws:
        applied = ws.shell(command.format(module=MODULE), 30)
        assert applied.exit_code == 0, applied.output
        result = ws.grade()
    assert flag in result.flags, (result.flags, result.detail, result.stdout_tail[-1500:])
    assert (result.reward, result.passed) == (0.0, 0)  # a report it ended, forged or patched counts nothing


@pytest.mark.skipif(not AS_ROOT, reason="the mount table shows the bases' host paths only with overlayfs")
def test_a_symlink_to_the_original_is_never_followed(built, cache, sandbox):
    """The mount table names the bases' host paths: a symlink there resolves on the host, never for the grader."""
    tests = repo_tests(task_of(built, "bug"), settings(cache))
    with open_workspace(tests, sandbox) as ws:
        lowers = ws.shell("grep -o 'lowerdir=[^,]*' /proc/self/mountinfo | head -1", 30).output.strip()
        base = lowers.removeprefix("lowerdir=").split(":")[-1]
        assert base == str(tests.episode_base)
        ws.shell(f"rm {MODULE} && ln -s {tests.grading_base}/{MODULE} {MODULE} && "
                 f"ln -s {tests.grading_base}/networkx/algorithms networkx/algorithms2", 30)
        assert ws.changed() == {}
        result = ws.grade()
    assert result.reward == 0.0  # graded with the task's changed module, not the original the link points to


def test_a_fix_with_an_edited_test_is_flagged(built, cache, sandbox):
    tests = repo_tests(task_of(built, "bug"), settings(cache))
    with open_workspace(tests, sandbox) as ws:
        ws.shell(fix(tests) + f"\necho '# looked at it' >> {TEST_FILE}", 30)
        result = ws.grade()
    assert result.reward == 1.0 and result.flags == ("tests_modified",)  # the tests' score, and the flag that zeroes it
    assert guarded_reward(result.reward, result.flags, DEFAULT_GUARDED, 0.0) == 0.0


def test_installed_copies_cover_every_site_packages(tmp_path):
    hidden = installed_copies("sympy")
    assert any(h.endswith("site-packages/sympy") for h in hidden)
    assert any(h.endswith("site-packages/isympy.py") for h in hidden)  # a top-level module of the distribution
    assert all(os.path.exists(h) for h in hidden)
    assert installed_copies("no-such-distribution") == ()
