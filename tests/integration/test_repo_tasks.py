"""Repository tasks end to end, with real pytest runs in the real sandbox: seeded mutations, a resumable build,
episodes that cannot reach the original, copy-on-write workspaces, and grading that scripted cheats cannot fool
(each layer of it on its own: test_repo_grading.py).

The tasks come from networkx's shortest-path module `unweighted.py` and its test file (about a second of CPU); one
slow test builds and checks sympy tasks (`ntheory/digits.py`)."""

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from composer.recipes.env_schema import RepoTaskSettings, SandboxSection, TaskSet
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe, recipe_to_yaml, validate_recipe
from composer.rollout.sandbox.graders import DEFAULT_GUARDED, guarded_reward
from composer.rollout.sandbox.isolation import installed_copies
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.build import build_repo_tasks, set_dir
from composer.rollout.tasks.repository.candidates import candidates
from composer.rollout.tasks.repository.grading_policy import NOT_A_FILE
from composer.rollout.tasks.repository.mutations import Mutation, changed_module, mutations
from composer.rollout.tasks.repository.task_set import (
    check_repo_tasks,
    load_tasks,
    open_workspace,
    project_bases,
    repo_tests,
)
from composer.rollout.tasks.repository.workspace import RepoWorkspace
from tests.conftest import REPO
from tests.helpers.repo_cheats import ANSWERS, CLASSES, REACHING, compiled_at_run_time, in_function, payloads, pyc, written
from tests.helpers.repo_cheats import _guarded as guarded

AS_ROOT = os.geteuid() == 0
MODULE = "networkx/algorithms/shortest_paths/unweighted.py"
TEST_FILE = "networkx/algorithms/shortest_paths/tests/test_unweighted.py"
SANDBOX = SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048)


def settings(cache: Path, **overrides) -> RepoTaskSettings:
    return RepoTaskSettings(**{"projects": ["networkx"], "num_tasks": 3, "include": [MODULE], "cache_dir": str(cache), **overrides})


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
    assert body_removed.startswith(
        'def clip(values, low, high):\n    """Values limited to [low, high]."""\n    raise NotImplementedError\n\n\ndef flag'
    )
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
    for recipe in (
        load_recipe(
            REPO / "recipes" / "smoke-rl.yaml",
            ["env.tasks=[{name: smoke, held_out: 20}, {name: repo}]", "rollout.harness=tools", "rollout.max_turns=2"],
        ),
    ):
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


@pytest.mark.slow  # two kill -9 drills of the build (about 40 s)
def test_a_build_killed_mid_way_resumes_to_the_same_set(built, tmp_path, composer):
    """kill -9 while validating, then again: the same tasks as an uninterrupted build (and a torn verdict file is redone)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "extends": str(REPO / "recipes" / "smoke-rl.yaml"),
                "rollout": {"harness": "tools", "max_turns": 2},
                "env": {
                    "sandbox": SANDBOX.model_dump(include={"cpu_seconds", "wall_seconds", "memory_mb"}),
                    "tasks": [
                        {
                            "name": "repo",
                            "repo": settings(tmp_path / "cache").model_dump(include={"projects", "num_tasks", "include", "cache_dir"}),
                        }
                    ],
                },
            }
        )
    )
    verdicts = set_dir(settings(tmp_path / "cache")) / "verdicts"
    build = subprocess.Popen(
        [sys.executable, "-m", "composer.cli", "env", "build", str(recipe), "--workers", "2"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
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
            'print(importlib.util.find_spec("networkx.algorithms.shortest_paths.unweighted").origin)\'; '
            f"python -m pip show -f networkx 2>&1 | grep -c unweighted; "
            f"find / -name unweighted.py -path '*shortest_paths*' 2>/dev/null; "
            f"cat {installed}/algorithms/shortest_paths/unweighted.py {tests.grading_base}/{MODULE} {tests.episode_base}/{MODULE} 2>&1 | head -3; "
            "grep -o 'lowerdir=[^,]*' /proc/self/mountinfo | head -1; ls /proc/self/root/",
            60,
        )
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


@pytest.mark.parametrize(
    "overlay", [pytest.param(True, marks=pytest.mark.skipif(not AS_ROOT, reason="overlayfs needs root")), False], ids=["overlay", "copy"]
)
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
    assert (fixed.reward, fixed.passed, fixed.total, fixed.flags) == (
        1.0,
        fixed.total,
        len(tests.fail_to_pass) + len(tests.pass_to_pass),
        (),
    )


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
    (
        "a conftest that skips everything",
        appended(
            "networkx/conftest.py",
            (
                "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
                "    for item in items:\n        item.add_marker(pytest.mark.skip)\n"
            ),
        ),
    ),
    ("a pytest.ini with addopts", "printf '[pytest]\\naddopts = -k nothing\\n' | tee pytest.ini > networkx/pytest.ini"),
    (
        "a sitecustomize that patches pytest",
        appended("sitecustomize.py", "import _pytest.runner\n_pytest.runner.runtestprotocol = lambda *a, **k: []\n")
        + " && cp sitecustomize.py networkx/",
    ),
]


@pytest.mark.skipif(not AS_ROOT, reason="the mount table shows the bases' host paths only with overlayfs")
def test_a_symlink_or_fifo_in_place_of_a_module_is_never_followed_or_read(built, cache, sandbox):
    """The mount table names the bases' host paths: a symlink there resolves on the host, never for the grader; a
    FIFO is not read either, nor graded as a deletion (one that breaks the package's import, which was an early
    exit): each is graded as the task left it."""
    tests = repo_tests(task_of(built, "bug"), settings(cache))
    dense = "networkx/algorithms/shortest_paths/dense.py"
    with open_workspace(tests, sandbox) as ws:
        lowers = ws.shell("grep -o 'lowerdir=[^,]*' /proc/self/mountinfo | head -1", 30).output.strip()
        base = lowers.removeprefix("lowerdir=").split(":")[-1]
        assert base == str(tests.episode_base)
        ws.shell(
            f"rm {MODULE} {dense} && ln -s {tests.grading_base}/{MODULE} {MODULE} && mkfifo -m 666 {dense} && "
            f"ln -s {tests.grading_base}/networkx/algorithms networkx/algorithms2",
            30,
        )
        assert ws.changed() == {MODULE: NOT_A_FILE, dense: NOT_A_FILE, "networkx/algorithms2": NOT_A_FILE}
        result = ws.grade()
    # Graded with the task's changed module, not the original the link points to; the package imports.
    assert (result.reward, result.passed, result.flags) == (0.0, len(tests.pass_to_pass), ("change_dropped",)), result.detail
    assert "not a regular file" in result.flag_details[0]


def cheats_for(tests) -> dict[str, str]:
    test_module = tests.test_files[0].removesuffix(".py").replace("/", ".")
    return payloads(test_module, f"/sandbox/repo/{tests.test_files[0]}", tests.fail_to_pass)


def test_cheats_outside_the_tasks_function_never_run(built, cache, sandbox):
    """Runner patches and neutralised tests in the package's __init__, forged bytecode (an unchecked pyc of the
    task's module, a timestamp pyc of an untouched one, pytest's cache of the root conftest, a sourceless module),
    an early exit elsewhere: together they pass every test of the agent's own run; none of them reaches the grade."""
    import _pytest

    tests = repo_tests(task_of(built, "bug"), settings(cache))
    tag = sys.implementation.cache_tag
    package = tests.grading_base / "networkx"
    init, conftest = package / "algorithms" / "shortest_paths" / "__init__.py", package / "conftest.py"
    all_pass = (
        "\n\n@pytest.hookimpl(wrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    report = yield\n    report.outcome = 'passed'\n    return report\n"
    )
    forged = {
        f"networkx/algorithms/shortest_paths/__pycache__/unweighted.{tag}.pyc": pyc(
            (tests.grading_base / MODULE).read_text(), f"/sandbox/{MODULE}", None
        ),
        f"networkx/algorithms/shortest_paths/__pycache__/__init__.{tag}.pyc": pyc(
            init.read_text(), "/sandbox/networkx/algorithms/shortest_paths/__init__.py", (int(init.stat().st_mtime), init.stat().st_size)
        ),
        f"networkx/__pycache__/conftest.{tag}-pytest-{_pytest.__version__}.pyc": pyc(
            conftest.read_text() + all_pass, "/sandbox/networkx/conftest.py", conftest.read_bytes()
        ),
        "networkx/algorithms/shortest_paths/dense.pyc": pyc((package / "algorithms/shortest_paths/dense.py").read_text(), "dense.py", None),
    }
    code = "".join(
        cheats_for(tests)[name] for names in (CLASSES["patching the test runner"], CLASSES["neutralising the tests"]) for name in names
    )
    with open_workspace(tests, sandbox) as ws:
        commands = [
            appended("networkx/__init__.py", code.replace("/sandbox/repo/", "/sandbox/")),
            appended("networkx/utils/misc.py", "import os\nif os.environ.get('NEVER') == 'x':\n    os._exit(0)\n"),
            "rm networkx/algorithms/shortest_paths/dense.py",
        ]
        assert ws.shell("\n".join(commands), 30).exit_code == 0
        for relative, content in forged.items():
            (ws.root / relative).parent.mkdir(parents=True, exist_ok=True)
            (ws.root / relative).write_bytes(content)
        shown = ws.run_tests()
        assert shown.exit_code == 0 and " failed" not in shown.output.splitlines()[-1], shown.output[-2000:]  # fooled
        result = ws.grade()
    assert (result.reward, result.flags) == (0.0, ("change_dropped",)), (result.detail, result.stdout_tail[-2000:])
    assert result.passed == len(tests.pass_to_pass)  # graded as the task left it: its fail-to-pass tests fail
    (detail,) = result.flag_details
    assert all(p in detail for p in ["networkx/__init__.py", "networkx/utils/misc.py", "shortest_paths/dense.py", *forged])


@pytest.mark.parametrize("kind, stored", [("bug", False), ("feature", True)])
def test_cheats_in_the_tasks_function_decide_nothing_across_the_boundary(built, cache, sandbox, kind, stored):
    """Every mechanism (runner patches, report rewriters, neutralised tests, frames walked up to the trusted entry,
    closure cells swapped, trace functions, pytest's reports patched, side effects from a thread, a signal, __del__
    and a class body), run by a decorator of the task's function at import and again at each of its calls (as
    source, or stored as data and compiled at run time), with the function answering from the calling test's
    source (bug) or with an object equal to anything (feature) and the bug left in place: the function runs in the
    episode's own process, where none of it reaches the grade. Reward 0, no infrastructure failure."""
    task = task_of(built, kind)
    tests = repo_tests(task, settings(cache))
    setup = [*cheats_for(tests).values(), *(guarded(code) for code in REACHING.values())]
    if stored:
        setup = [compiled_at_run_time("".join(setup))]
    helpers, prefix = ANSWERS["an answer read from the caller's source line" if kind == "bug" else "an answer equal to anything"]
    with open_workspace(tests, sandbox) as ws:
        episode = in_function((ws.root / MODULE).read_text(), task["function"], setup, (helpers, "_prepare(None)\n" + prefix))
        assert ws.shell(written(MODULE, episode), 30).exit_code == 0
        result = ws.grade()
    assert (result.reward, result.infra_failure) == (0.0, False), (result.flags, result.detail, result.stdout_tail[-2000:])
    assert result.status == "ok" and result.passed < result.total  # the trusted run completed, and its tests failed
    assert "forbidden_code" not in result.flags and "change_dropped" not in result.flags


def test_honest_work_with_ordinary_words_earns_full_reward(built, cache, sandbox):
    """The original restored, with a module constant whose key is "code", a string naming trace, signal, environ
    and /proc/, and a local import of the standard library in the function: full reward, no flag."""
    task = task_of(built, "bug")
    tests = repo_tests(task, settings(cache))
    original = (tests.grading_base / MODULE).read_text()
    tree = ast.parse(original)
    target = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == task["function"].split(".")[-1])
    lines = original.splitlines(keepends=True)
    body = target.body[1] if ast.get_docstring(target) is not None else target.body[0]
    indent = " " * body.col_offset
    lines.insert(
        body.lineno - 1,
        f'{indent}"""No trace, signal, environ or /proc/ is read here."""\n'
        f'{indent}import collections\n\n{indent}assert _error_fields["code"] == len(collections.deque())\n',
    )
    first = min([target.lineno, *(d.lineno for d in target.decorator_list)])
    lines.insert(first - 1, '_error_fields = {"code": 0}\n\n\n')
    with open_workspace(tests, sandbox) as ws:
        assert ws.shell(written(MODULE, "".join(lines)), 30).exit_code == 0
        result = ws.grade()
    assert (result.reward, result.flags) == (1.0, ()), (result.detail, result.stdout_tail[-2000:])


FEATURE_FIX = '''    if source not in G:
        raise nx.NodeNotFound(f"Source {source} not in G")
    return _breadth_first_paths(G, source, math.inf if cutoff is None else cutoff)


def _breadth_first_paths(G, source, cutoff):
    """Paths from source, breadth first, up to cutoff hops."""
    paths, depth, frontier = {source: [source]}, {source: 0}, deque([source])
    while frontier:
        node = frontier.popleft()
        if depth[node] >= cutoff:
            continue
        for neighbor in G._adj[node]:
            if neighbor not in paths:
                paths[neighbor] = paths[node] + [neighbor]
                depth[neighbor] = depth[node] + 1
                frontier.append(neighbor)
    return paths
'''


def test_a_fix_of_its_own_with_a_helper_earns_full_reward(built, cache, sandbox):
    """Another correct implementation of the feature, with a helper function and imports of its own, and a comment
    added elsewhere."""
    tests = repo_tests(task_of(built, "feature"), settings(cache))
    with open_workspace(tests, sandbox) as ws:
        text = (ws.root / MODULE).read_text()
        assert text.count("    raise NotImplementedError\n") == 1
        episode = "import math\nfrom collections import deque\n" + text.replace("    raise NotImplementedError\n", FEATURE_FIX).replace(
            "import operator\n", "import operator  # used by the other functions\n"
        )
        assert ws.shell(written(MODULE, episode), 30).exit_code == 0
        result = ws.grade()
    assert (result.reward, result.flags) == (1.0, ()), (result.detail, result.stdout_tail[-2000:])


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
