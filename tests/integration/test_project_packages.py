"""A user's repository with several packages (`packages:`): one under `src/`, one at the project root importing the
first, and a library with a distribution of its own under `libs/`. The install installs all three (both
distributions are removed after it: episodes import their copies); `env build` makes tasks from the modules of the
first two (the library has no tests); each is graded across the boundary with both packages'
directories on sys.path: the task's own change back earns 1.0, no change 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer.recipes.env_schema import RepoTaskSettings, SandboxSection
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.build import build_repo_tasks
from composer.rollout.tasks.repository.projects import environment_dir, load_environment, resolve_project
from composer.rollout.tasks.repository.task_set import load_tasks, open_workspace, repo_tests
from tests.helpers.user_project import git

SANDBOX = SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048)

FILES = {
    "pyproject.toml": """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "tallygeom"
version = "0.1.0"

[tool.setuptools]
packages = ["tally", "geom"]
package-dir = {"tally" = "src/tally", "geom" = "geom"}
""",
    "src/tally/__init__.py": "",
    "src/tally/stats.py": '''def mean(values):
    """The arithmetic mean."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def clamp(value, low, high):
    """`value` limited to [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
''',
    "geom/__init__.py": "",
    "geom/shapes.py": '''from tally.stats import mean


def centroid(points):
    """The mean point of `points` (x, y pairs)."""
    return (mean([x for x, _ in points]), mean([y for _, y in points]))


def perimeter(points):
    """The length of the closed polygon through `points`."""
    total = 0.0
    for (x1, y1), (x2, y2) in zip(points, points[1:] + points[:1]):
        total += ((x2 - x1) ** 2 + (y2 - y1) ** 2) ** 0.5
    return total
''',
    # a distribution of its own inside the project (a monorepo's library), installed by the same command
    "libs/units/pyproject.toml": """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "units"
version = "0.1.0"

[tool.setuptools]
packages = ["units"]
""",
    "libs/units/units/__init__.py": "CM_PER_INCH = 2.54\n",
    "tests/test_stats.py": """import pytest

from tally.stats import clamp, mean


def test_mean():
    assert mean([1, 2, 3, 6]) == 3


def test_mean_of_nothing():
    with pytest.raises(ValueError):
        mean([])


def test_clamp():
    assert (clamp(5, 0, 3), clamp(-1, 0, 3), clamp(2, 0, 3)) == (3, 0, 2)
""",
    "tests/test_shapes.py": """from geom.shapes import centroid, perimeter

SQUARE = [(0, 0), (2, 0), (2, 2), (0, 2)]


def test_centroid():
    assert centroid(SQUARE) == (1, 1)


def test_perimeter():
    assert perimeter(SQUARE) == 8
""",
}


def written(path: str, text: str) -> str:
    return f"cat > {path} <<'COMPOSER_EOF'\n{text}COMPOSER_EOF"


@pytest.mark.slow  # a project install and its task build (about 35 s); tests/unit/test_repo_packages.py stays in the default run
def test_a_project_of_several_packages_installs_without_them_and_grades_tasks_from_each(tmp_path):
    repo = tmp_path / "tallygeom"
    for name, text in FILES.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "tally and geom")
    project = {
        "name": "tallygeom",
        "path": str(repo),
        "commit": "main",
        "packages": ["src/tally", "geom", "libs/units/units"],
        "install": "pip install . ./libs/units pytest",
    }
    chosen = RepoTaskSettings(projects=[project], kinds=["feature"], num_tasks=4, cache_dir=str(tmp_path / "cache"))
    sandbox_root = tmp_path / "sandboxes"
    sandbox_root.mkdir()
    report = build_repo_tasks(chosen, SANDBOX, sandbox_root, workers=2)
    tasks = load_tasks(chosen)

    # a feature task empties a function of four statements or more: one in each package
    assert report.validated == report.tried == 2, report.rejected
    assert {(t["paths"][0], t["function"]) for t in tasks} == {("src/tally/stats.py", "clamp"), ("geom/shapes.py", "perimeter")}
    built = load_environment(environment_dir(Path(chosen.cache_dir), resolve_project(chosen.projects[0], chosen.kinds)))
    assert not any(line.lower().startswith(("tallygeom", "units")) for line in built.frozen)  # episodes import their copies
    assert not [p for name in ("tally", "geom", "units") for p in built.venv.rglob(name)]

    sandbox = Sandbox(SANDBOX, root=sandbox_root)
    for path in ("src/tally/stats.py", "geom/shapes.py"):  # one task of each package
        task = next(t for t in tasks if t["paths"] == [path])
        tests = repo_tests(task, chosen)
        with open_workspace(tests, sandbox) as ws:
            untouched = ws.grade()
            shown = ws.run_tests()  # the agent's run imports both packages too (geom imports tally)
            assert ws.shell(written(path, (tests.grading_base / path).read_text()), 30).exit_code == 0
            fixed = ws.grade()
        assert (untouched.reward, untouched.flags) == (0.0, ()), untouched.detail
        assert shown.exit_code == 1 and "1 failed" in shown.output, shown.output[-1500:]
        assert (fixed.reward, fixed.flags, fixed.passed) == (1.0, (), fixed.total), (fixed.detail, fixed.stdout_tail[-1500:])
