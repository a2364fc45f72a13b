"""Repository tasks from a user's own project, declared in the recipe: a git repository made by the test
(tests/helpers/user_project.py: a pure-Python package with its tests, and commits that each fix a bug and add a test).

`env build` makes the project's environment once (the install command run in the sandbox with this machine's package
index), then history tasks (fail-to-pass: exactly each commit's new test) and multi tasks (several seeded bugs at
once); the commit's own change earns 1.0, no change 0, and today's grading cheats 0 on both kinds. Bad input is one
clear line each, and leaves no environment behind."""

from __future__ import annotations

import json
import os
from itertools import groupby
from pathlib import Path

import pytest
import yaml

from composer.recipes.env_schema import EnvSection, ProjectSettings, RepoTaskSettings, SandboxSection, TaskSet
from composer.recipes.errors import UserError
from composer.rl.sft_data import ConversationRenderer
from composer.rl.sft_references import reference_episodes
from composer.rollout.agent.environment import CodingEnvironment
from composer.rollout.agent.harness import ToolBox, ToolCall, parse_tool_calls
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.build import build_repo_tasks, set_dir
from composer.rollout.tasks.repository.projects import environment_dir, project_environment, resolve_project
from composer.rollout.tasks.repository.task_set import load_tasks, open_workspace, repo_tests
from tests.conftest import REPO
from tests.helpers.repo_cheats import REACHING, compiled_at_run_time, in_function, payloads
from tests.helpers.repo_cheats import _guarded as guarded
from tests.helpers.sft_demos import tiny_tokenizer
from tests.helpers.user_project import FIXES, make_project

SANDBOX = SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048)
INSTALL = "pip install pytest"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> tuple[Path, dict]:
    repo = tmp_path_factory.mktemp("user-project") / "tally"
    return repo, make_project(repo)


def tally(repo: Path, **more) -> dict:
    return {"name": "tally", "path": str(repo), "commit": "main", "package": "src/tally", "install": INSTALL, **more}


def settings(repo: Path, cache: Path, kinds: list[str], num_tasks: int, **more) -> RepoTaskSettings:
    return RepoTaskSettings(projects=[tally(repo, **more)], kinds=kinds, num_tasks=num_tasks, cache_dir=str(cache))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("user-cache")


@pytest.fixture(scope="module")
def sandbox_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("user-sandboxes")


@pytest.fixture(scope="module")
def history(project, cache, sandbox_root):
    repo, _ = project
    chosen = settings(repo, cache, ["history"], len(FIXES) + 1)  # every candidate tried
    report = build_repo_tasks(chosen, SANDBOX, sandbox_root, workers=2)
    return chosen, report, load_tasks(chosen)


@pytest.fixture(scope="module")
def multi(project, cache, sandbox_root, history):
    repo, _ = project
    chosen = settings(repo, cache, ["multi"], 1)
    report = build_repo_tasks(chosen, SANDBOX, sandbox_root, workers=2)
    return chosen, report, load_tasks(chosen)


@pytest.fixture(scope="module")
def bug_and_feature(project, cache, sandbox_root, multi):
    repo, _ = project
    chosen = settings(repo, cache, ["bug", "feature"], 2)  # the test files were surveyed for `multi`: validations only
    report = build_repo_tasks(chosen, SANDBOX, sandbox_root, workers=2)
    return chosen, report, load_tasks(chosen)


@pytest.fixture(scope="module")
def sandbox(sandbox_root) -> Sandbox:
    return Sandbox(SANDBOX, root=sandbox_root)


def test_history_tasks_are_the_commits_that_fixed_a_bug_with_a_test(project, history):
    _, made = project
    chosen, report, tasks = history
    assert report.validated == len(FIXES) and report.by_project_kind == {("tally", "history"): len(FIXES)}
    # the last commit also sets a module-level constant: not gradable by functions, rejected with the reason
    assert report.rejected == {"history commit changes code outside functions: module-level code": 1}
    verdict = json.loads((set_dir(chosen) / "verdicts" / f"repo__tally__history__{made['outside'][:12]}.json").read_text())
    assert verdict["detail"] == "history commit changes code outside functions: module-level code (src/tally/stats.py: line 3)"
    by_commit = {t["base"]: t for t in tasks}
    assert set(by_commit) == {f["commit"] for f in made["fixes"]}  # the docs-only and source-only commits are not tasks
    for fix in made["fixes"]:
        task = by_commit[fix["commit"]]
        assert task["fail_to_pass"] == [fix["test_id"]]  # exactly the commit's new test
        assert fix["test_id"] not in task["pass_to_pass"] and len(task["pass_to_pass"]) >= 4
        assert task["paths"] == [fix["source"]] and task["kind"] == "history"
        assert task["scope"] == [[fix["source"], [fix["function"]]]]  # the function the commit changed
        assert fix["message"] in task["prompt"] and fix["test_id"] in task["prompt"]
        assert f"{fix['source']}: {fix['function']}" in task["prompt"]
    older = {**tasks[0], "scope": [[tasks[0]["path"], []]]}  # an index of the previous version: a whole file in scope
    with pytest.raises(UserError, match=r"built by an older composer \(its scope is whole files.*composer env build"):
        repo_tests(older, chosen)


def test_the_set_index_counts_candidates_per_kind_and_reason(project, history, multi):
    for chosen, report, _ in (history, multi):
        index = json.loads((set_dir(chosen) / "tasks.json").read_text())
        (row,) = index["build"]
        assert (row["project"], row["kind"]) == ("tally", chosen.kinds[0])
        assert row["validated"] == report.validated and row["tried"] == report.tried
        assert sum(row["rejected"].values()) == report.tried - report.validated
        assert row["rejected"] == {r: n for (_, _, r), n in report.rejected_by_project_kind.items()}


def test_env_build_prints_candidates_validated_and_rejected_per_kind(project, history, cache, tmp_path, composer):
    repo, _ = project
    done = composer("env", "build", str(build_recipe(tmp_path, tally(repo), ["history"], cache)))
    assert done.returncode == 0, done.stderr[-2000:]
    out = " ".join(done.stdout.split())
    assert "project ┃ kind ┃ tried ┃ validated ┃ rejected" in out and "tally │ history │ 1 │ 1 │ 0" in out, out
    shown = composer("env", "show", str(build_recipe(tmp_path, tally(repo), ["history"], cache)))
    assert shown.returncode == 0, shown.stderr[-2000:]
    (task,) = load_tasks(settings(repo, cache, ["history"], 1))
    assert "tally" in shown.stdout and "history" in shown.stdout and f"commit {task['base'][:12]}" in shown.stdout, shown.stdout
    assert len(load_tasks(settings(repo, cache, ["history"], len(FIXES)))) == len(FIXES)  # the 1-task build kept the set whole


def test_the_environment_is_made_once_per_digest(project, history, cache, sandbox_root):
    repo, _ = project
    chosen, _, _ = history
    spec = resolve_project(chosen.projects[0], chosen.kinds)
    assert spec == resolve_project(ProjectSettings(**tally(repo)), chosen.kinds)  # same inputs, same digest
    environment = environment_dir(cache, spec)
    manifest = json.loads((environment / "manifest.json").read_text())
    assert any(line.startswith("pytest==") for line in manifest["frozen"])
    assert not any(line.lower().startswith("tally") for line in manifest["frozen"])  # the project itself is not installed
    made_at = (environment / "manifest.json").stat().st_mtime_ns
    other_kind = settings(repo, cache, ["history"], 1, exclude_markers=["slow"])  # other test runs, the same environment
    assert resolve_project(other_kind.projects[0], other_kind.kinds).digest == spec.digest
    build_repo_tasks(other_kind, SANDBOX, sandbox_root, workers=1)
    assert (environment / "manifest.json").stat().st_mtime_ns == made_at
    assert resolve_project(ProjectSettings(**tally(repo, install="pip install pytest iniconfig")), []).digest != spec.digest
    if os.geteuid() == 0:
        assert all(os.stat(p).st_uid == 0 for p in [environment / "venv", *(environment / "venv").rglob("*.py")][:200])


@pytest.mark.slow
@pytest.mark.parametrize("install", [None, "pip install -e . pytest", "pip install .[test]", "pip install . & group dev"])
def test_a_setuptools_project_installs_as_users_install_it(tmp_path, sandbox_root, install):
    # a flat layout: setuptools leaves `tally.egg-info` in the project's root, first on pip's path; the project's
    # own copy must still be found and removed. `& group dev`: pytest comes from a dependency group that includes another
    repo = tmp_path / "flat"
    make_project(repo, source_dir=".")
    install, _, group = (install or "").partition(" & group ")
    entry = {k: v for k, v in tally(repo, package="tally").items() if k != "install"} | ({"install": install} if install else {})
    entry |= {"dependency_groups": [group]} if group else {}
    spec = resolve_project(ProjectSettings(**entry), ["bug"])
    environment = project_environment(tmp_path, spec, SANDBOX, sandbox_root)
    assert any(line.startswith("pytest==") for line in environment.frozen)  # the default install provides pytest
    assert not any(line.lower().startswith("tally") for line in environment.frozen)  # grading uses the episode's copy
    assert not list(environment.venv.rglob("tally*")) and not list(environment.venv.rglob("__editable__*tally*"))


def written(path: str, text: str) -> str:
    return f"cat > {path} <<'COMPOSER_EOF'\n{text}COMPOSER_EOF"


def task_for(history, fix: dict) -> dict:
    return next(t for t in history[2] if t["base"] == fix["commit"])


MEDIAN_OF_MY_OWN = """

def _middle(ordered):
    \"\"\"The middle one or two values of a sorted list.\"\"\"
    half = len(ordered) // 2
    return ordered[half - 1 : half + 1] if len(ordered) % 2 == 0 else ordered[half : half + 1]


def median(values):
    \"\"\"The middle value; for an even count, the mean of the two middle values (no trace or signal here).\"\"\"
    import statistics

    return statistics.fmean(_middle(sorted(values)))
"""


def test_the_commits_own_change_earns_full_reward_and_no_change_nothing(project, history, sandbox):
    """Every history task's own commit: 1.0, no flag; no change: 0. A fix of its own (median through a helper and a
    local import of the standard library) earns 1.0 too."""
    _, made = project
    chosen = history[0]
    for number, fix in enumerate(made["fixes"]):
        tests = repo_tests(task_for(history, fix), chosen)
        with open_workspace(tests, sandbox) as ws:
            if number == 0:
                untouched = ws.grade()
                assert (untouched.reward, untouched.flags) == (0.0, ())
                shown = ws.run_tests()  # the project's environment runs the tests the agent sees
                assert shown.exit_code == 1 and "1 failed" in shown.output, shown.output[-1500:]
            assert ws.shell(written(fix["source"], fix["fixed"]), 30).exit_code == 0
            fixed = ws.grade()
            if fix["function"] == "median":
                text = (ws.root / fix["source"]).read_text()
                start, end = text.index("\n\ndef median("), text.index("\n\ndef variance(")
                assert ws.shell(written(fix["source"], text[:start] + MEDIAN_OF_MY_OWN + text[end:]), 30).exit_code == 0
                mine = ws.grade()
                assert (mine.reward, mine.flags) == (1.0, ()), (mine.detail, mine.stdout_tail[-1500:])
        assert (fixed.reward, fixed.flags, fixed.passed) == (1.0, (), fixed.total), (fixed.detail, fixed.stdout_tail[-1500:])


def test_multi_tasks_hold_several_bugs_in_different_functions(multi, sandbox):
    chosen, report, (task,) = multi
    assert report.validated == 1 and task["kind"] == "multi"
    functions = task["function"].split(", ")
    assert 2 <= len(functions) == len(set(functions)) <= 3
    tests = repo_tests(task, chosen)
    with open_workspace(tests, sandbox) as ws:
        assert ws.grade().reward == 0.0
        for path in task["paths"]:  # every bug fixed: the original files back
            ws.shell(written(path, (tests.grading_base / path).read_text()), 30)
        fixed = ws.grade()
    assert (fixed.reward, fixed.flags) == (1.0, ())


@pytest.mark.parametrize("kind", ["history", "multi"])
def test_history_and_multi_tasks_are_graded_across_the_boundary(history, multi, sandbox, kind):
    """Every mechanism that reaches for the grade (frames walked, closure cells, trace functions, pytest's reports
    patched, a descriptor written, threads, signals, __del__, payloads compiled at run time), run by the decorator of
    each of the task's functions and at each call, with the change left in place: reward 0, no infrastructure failure.
    The originals back (a history task's: its commit), each function with a helper of its own, a local import of the
    standard library and a string naming trace, signal, environ and /proc/: 1.0."""
    chosen, _, tasks = history if kind == "history" else multi
    task = tasks[0]
    tests = repo_tests(task, chosen)
    test_module = tests.test_files[0].removesuffix(".py").replace("/", ".")
    aimed = payloads(test_module, f"/sandbox/repo/{tests.test_files[0]}", tests.fail_to_pass)  # runner patches, descriptors
    setup = [compiled_at_run_time("".join([*aimed.values(), *(guarded(code) for code in REACHING.values())]))]
    honest_prefix = 'import statistics\n"""No trace, signal, environ or /proc/ here."""\nassert statistics.mean([1]) == 1\n'
    with open_workspace(tests, sandbox) as ws:
        for scope in tests.scope:
            text = (ws.root / scope.path).read_text()
            for function in scope.functions:
                text = in_function(text, function, setup, ("", "_prepare(None)\n"))
            ws.shell(written(scope.path, text), 30)
        cheated = ws.grade()
        for scope in tests.scope:
            text = (tests.grading_base / scope.path).read_text()
            for function in scope.functions:
                text = in_function(text, function, [], ("", honest_prefix))  # a helper (a decorator) of its own too
            ws.shell(written(scope.path, text), 30)
        honest = ws.grade()
    assert (cheated.reward, cheated.infra_failure, cheated.status) == (0.0, False, "ok"), (cheated.flags, cheated.detail)
    assert "change_dropped" not in cheated.flags  # all of it taken: it ran in the episode's process
    assert (honest.reward, honest.flags) == (1.0, ()), (honest.detail, honest.stdout_tail[-1500:])


def test_reference_changes_become_episodes_that_replay_to_full_reward(history, multi, bug_and_feature, tmp_path):
    """The `references` SFT source on repository tasks of every kind: one episode per training task (the held-out
    ones never), rendered in the harness's format; the calls parsed back from the trained tokens, replayed through
    the harness's tools on a fresh workspace of the task, run the tests green and earn 1.0."""
    env_section = EnvSection(
        tasks=[
            TaskSet(name="repo", held_out=1, repo=history[0]),
            TaskSet(name="repo", repo=multi[0]),
            TaskSet(name="repo", repo=bug_and_feature[0]),
        ],
        sandbox=SANDBOX,
    )
    env = CodingEnvironment(env_section, seed=0, sandbox_root=tmp_path / "sandboxes")
    renderer = ConversationRenderer(str(tiny_tokenizer(tmp_path / "tokenizer")), chat_template=False)
    toolbox = ToolBox(SANDBOX.wall_seconds)
    try:
        sets = range(len(env.pool.task_sets))
        training = {env.pool.task(s, i).id: env.pool.task(s, i) for s in sets for i in env.pool.indices(s)}
        held_out = {env.pool.task(s, i).id for s in sets for i in env.pool.held_out(s)}
        episodes = {where.split(" task ")[1]: messages for where, messages in reference_episodes(env, toolbox)}
        assert set(episodes) == set(training) and len(training) == 3 + 1 + 2 and len(held_out) == 1 and not held_out & set(episodes)
        assert {task_id.split("/")[2] for task_id in episodes} == {"history", "multi", "bug", "feature"}
        for task_id, messages in episodes.items():
            assert messages is not None, f"{task_id}: its reference was skipped"
            tokens, mask = renderer.render(messages, task_id)
            replies = [[t for t, m in group] for on, group in groupby(zip(tokens, mask), key=lambda p: p[1]) if on]
            calls = [c for reply in replies for c in parse_tool_calls(renderer.tok.decode(reply))]
            assert all(isinstance(c, ToolCall) for c in calls), (task_id, calls)
            names = [c.name for c in calls]
            assert names[-2:] == ["run_tests", "finish"] and "read_file" in names and "edit" in names, (task_id, names)
            shown = renderer.tok.decode([t for t, m in zip(tokens, mask) if not m])
            assert "[exit 0," in shown and " passed in " in shown  # the real test run, not trained on
            workspace = env.open_workspace(training[task_id], tools=True)
            try:
                outputs = [toolbox.call(workspace, call) for call in calls]
                assert not any(o.text.startswith("error:") for o in outputs), (task_id, [o.text for o in outputs])
                assert outputs[-2].text.startswith("[exit 0,") and env.grade_workspace(workspace).reward == 1.0, task_id
            finally:
                workspace.close()
    finally:
        env.close()


def appended(path: str, code: str) -> str:
    return f"cat >> {path} <<'COMPOSER_EOF'\n{code}COMPOSER_EOF"


OUTSIDE = ("change_dropped",)
"""A history or multi task's scope is its functions: module-level code put in their files is left out of grading
(and flagged)."""
CHEATS = {
    "edit the failing tests": ("sed -i -E 's/^( +)assert .*/\\1pass/' tests/test_stats.py tests/test_text.py", ("tests_modified",)),
    "a conftest that skips everything": (
        appended(
            "tests/conftest.py",
            (
                "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
                "    for item in items:\n        item.add_marker(pytest.mark.skip)\n"
            ),
        ),
        ("tests_modified",),
    ),
    "a pytest.ini with addopts": ("printf '[pytest]\\naddopts = -k nothing\\n' > pytest.ini", ("tests_modified",)),
    "os._exit(0) in the task's file": ("sed -i '1i import os; os._exit(0)' SCOPED", OUTSIDE),
    "a forged report": (
        appended(
            "SCOPED",
            (
                "import os\nwith open('../report/report.jsonl', 'a') as forged:\n"
                '    forged.write(\'{"nonce": "guess", "end": true, "tampered": []}\\n\')\nos._exit(0)\n'
            ),
        ),
        OUTSIDE,
    ),
    "patching pytest's reports from the task's file": (
        appended(
            "SCOPED",
            (
                "import _pytest.reports\n_make = _pytest.reports.TestReport.from_item_and_call\n\n\n"
                "def _passed(item, call):\n    report = _make(item, call)\n    report.outcome = 'passed'\n    return report\n\n\n"
                "_pytest.reports.TestReport.from_item_and_call = staticmethod(_passed)\n"
            ),
        ),
        OUTSIDE,
    ),
}


@pytest.mark.parametrize("kind", ["history", "multi"])
def test_grading_cheats_earn_nothing_on_history_and_multi_tasks(project, history, multi, sandbox, kind):
    from composer.rollout.sandbox.graders import DEFAULT_GUARDED, guarded_reward

    chosen, _, tasks = history if kind == "history" else multi
    tests = repo_tests(tasks[0], chosen)
    for name, (command, flags) in CHEATS.items():
        with open_workspace(tests, sandbox) as ws:
            applied = ws.shell(command.replace("SCOPED", tests.scope[0].path), 30)
            assert applied.exit_code == 0, (name, applied.output)
            result = ws.grade()
        assert set(flags) & set(result.flags), (name, result.flags, result.detail, result.stdout_tail[-1000:])
        assert guarded_reward(result.reward, result.flags, DEFAULT_GUARDED, 0.0) == 0.0, name
        assert result.passed <= len(tests.pass_to_pass), name  # no fail-to-pass test passed


# --- bad input: one clear line, nothing half-written ------------------------------------------------


def build_recipe(tmp_path: Path, project: dict, kinds: list[str], cache: Path | None = None) -> Path:
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
                            "repo": {"projects": [project], "kinds": kinds, "num_tasks": 1, "cache_dir": str(cache or tmp_path / "cache")},
                        }
                    ],
                },
            }
        )
    )
    return recipe


def one_line_error(result) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stdout[-2000:] + result.stderr[-3000:]
    return " ".join(result.stderr.split())


def test_an_install_that_fails_names_its_log_and_leaves_no_environment(project, tmp_path, composer):
    repo, _ = project
    recipe = build_recipe(tmp_path, tally(repo, install="pip install no-such-package-composer-test==0.0.1"), ["bug"])
    error = one_line_error(composer("env", "build", str(recipe)))
    assert "repo.projects[].install: project tally: `pip install no-such-package" in error
    assert "No matching distribution found for no-such-package-composer-test" in error  # why, from pip's own words
    assert "change the install command" in error and "the install log: " in error
    log = Path(error.split("the install log: ")[1].split()[0].rstrip(")"))
    assert log.is_file() and "no-such-package-composer-test" in log.read_text()
    assert [p.name for p in (tmp_path / "cache" / "envs").iterdir() if not p.name.startswith(".")] == []


PLANTS = {
    # A listener's socket file (bound read-only into every run's view, it would still connect), a FIFO, a hard link.
    "socket": "python -c \"import os, socket, sys; os.chdir(sys.prefix + '/lib'); socket.socket(socket.AF_UNIX).bind('run.sock')\"",
    "fifo": "python -c \"import os, sys; os.mkfifo(sys.prefix + '/lib/pipe')\"",
    "hard-link": "python -c \"import os, sys; os.link(sys.prefix + '/pyvenv.cfg', sys.prefix + '/lib/cfg-link')\"",
}


@pytest.mark.parametrize("planted", PLANTS)
def test_an_install_that_leaves_special_files_is_refused_and_hard_links_are_broken(project, tmp_path, sandbox_root, planted):
    repo, _ = project
    spec = resolve_project(ProjectSettings(**tally(repo, install=f"{INSTALL} && {PLANTS[planted]}")), [])
    if planted == "hard-link":
        venv = project_environment(tmp_path, spec, SANDBOX, sandbox_root).venv
        link, original = os.stat(venv / "lib" / "cfg-link"), os.stat(venv / "pyvenv.cfg")
        assert link.st_ino != original.st_ino and link.st_nlink == 1 and (link.st_uid, link.st_mode & 0o022) == (0, 0)
        return
    with pytest.raises(UserError, match=r"project tally: its install left a special file .* at venv/lib/"):
        project_environment(tmp_path, spec, SANDBOX, sandbox_root)
    assert not environment_dir(tmp_path, spec).exists()


def test_tests_that_fail_on_the_original_are_one_clear_error(project, history, cache, tmp_path, composer):
    repo, _ = project
    # a pytest plugin that does not exist: no test file runs on the original (the environment is the one built)
    recipe = build_recipe(tmp_path, tally(repo, pytest_args=["-p", "no_such_plugin_composer"]), ["bug"], cache)
    error = one_line_error(composer("env", "build", str(recipe)))
    assert "project tally: its tests fail on the original" in error
    assert not (set_dir(settings(repo, cache, ["bug"], 1, pytest_args=["-p", "no_such_plugin_composer"])) / "tasks.json").exists()


def test_a_commit_that_does_not_exist_and_a_tree_without_tests_are_one_line(project, tmp_path, composer):
    repo, _ = project
    recipe = build_recipe(tmp_path, tally(repo, commit="no-such-commit"), ["bug"])
    error = one_line_error(composer("env", "build", str(recipe)))
    assert f"env.tasks[0].repo.projects[0].commit: project tally: no-such-commit is not a commit of {repo}" in error
    untested = build_recipe(tmp_path, tally(repo, test_paths=["src"]), ["bug", "history"])
    error = one_line_error(composer("env", "build", str(untested)))
    assert "env.tasks[0].repo.projects[0].test_paths: project tally: no test file (test_*.py) under src at " in error
    assert "bug tasks are graded by the tests of the pinned files" in error
    assert resolve_project(ProjectSettings(**tally(repo, test_paths=["src"])), ["history"]).name == "tally"


def test_history_of_a_directory_that_is_not_a_checkout_is_refused(project, tmp_path, composer):
    repo, _ = project
    plain = tmp_path / "plain"
    (plain / "src").mkdir(parents=True)
    os.system(f"cp -r {repo}/src {repo}/tests {plain}/")
    recipe = build_recipe(tmp_path, {**tally(plain), "commit": None}, ["history"])
    assert "history tasks come from a git log, and " in one_line_error(composer("env", "build", str(recipe)))
    unpinned = build_recipe(tmp_path, {**tally(repo), "commit": None}, ["bug"])
    assert "is a git checkout; pin the commit" in one_line_error(composer("env", "build", str(unpinned)))
    assert not (tmp_path / "cache" / "envs").exists() or not any((tmp_path / "cache" / "envs").iterdir())
    with pytest.raises(UserError, match="its package src/nothing is not a directory"):
        resolve_project(ProjectSettings(**tally(repo, package="src/nothing")), ["bug"])
    with pytest.raises(ValueError, match="ready-made project"):
        ProjectSettings(**tally(repo, name="networkx"))
