"""Real user projects (tests/helpers/user_corpus.py): six sdists from the package registry, one per build backend
(setuptools, setup.py, hatchling, flit, poetry-core, pdm-backend), in src and flat layouts, with pytest and
unittest suites and test dependencies from extras, a requirements file or the install command. Each is given a git
history (its sdist, then seeded regressions and their fixes) and built by `env build` into every kind.

The installs read only the wheels scripts/setup.sh cached (nothing downloads here); without them the tests skip.
`benchmarks/user_projects.py` builds the same corpus and prints the table of docs/benchmarks.md."""

from __future__ import annotations

import json

import pytest

from composer.rollout.tasks.repository.build import set_dir
from composer.rollout.tasks.repository.projects import environment_dir, resolve_project
from composer.rollout.tasks.repository.task_set import load_tasks
from tests.helpers.user_corpus import CORPUS, KINDS, build_project, git, missing, offline_index

TASKS = 12
"""Validated tasks per project: candidates of every kind are taken in turn, so each kind gets its share."""


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.skipif(missing() is not None, reason=missing() or "")
@pytest.mark.parametrize("project", CORPUS, ids=[p.name for p in CORPUS])
def test_a_real_project_builds_into_tasks_of_every_kind(project, tmp_path, monkeypatch):
    for name, value in offline_index().items():
        monkeypatch.setenv(name, value)
    built = build_project(project, tmp_path, workers=2, num_tasks=TASKS)
    report, settings = built.report, built.settings
    tasks = load_tasks(settings)
    assert {kind for _, kind in report.tried_by_project_kind} == set(KINDS)  # candidates of every kind
    # bug tasks and history tasks validate on every project (feature and multi tasks too on most: benchmarks/
    # user_projects.py counts them per project and kind)
    assert {"bug", "history"} <= {t["kind"] for t in tasks}, (report.by_project_kind, report.rejected)

    # history: exactly the commits that fixed a seeded regression, each with tests that fail until it is fixed
    history = {t["base"]: t for t in tasks if t["kind"] == "history"}
    assert set(history) <= set(built.fixes) and history
    repo = tmp_path / project.name
    for commit, task in history.items():
        assert git(repo, "log", "-1", "--format=%s", commit) in task["prompt"]
        assert task["fail_to_pass"] and set(task["fail_to_pass"]).isdisjoint(task["pass_to_pass"])

    # the project was installed by its own build backend, with its test dependencies, and then removed: grading
    # imports the episode's copy
    spec = resolve_project(settings.projects[0], settings.kinds)
    frozen = json.loads((environment_dir(tmp_path / "cache", spec) / "manifest.json").read_text())["frozen"]
    assert any(line.startswith("pytest==") for line in frozen)
    assert not any(line.lower().startswith(f"{project.name}==") for line in frozen)

    # the set's index counts what was tried, validated and rejected per kind
    index = json.loads((set_dir(settings) / "tasks.json").read_text())
    assert sum(row["validated"] for row in index["build"]) == report.validated == len(tasks)
    assert sum(row["tried"] for row in index["build"]) == report.tried
