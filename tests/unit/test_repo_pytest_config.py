"""A user project's own pytest configuration carried into composer's test runs: found in the file pytest itself
would choose, the settings that decide which tests exist and how they pass kept, plugin options of addopts left."""

from __future__ import annotations

import subprocess
import sys

from composer.recipes.env_schema import ProjectSettings
from composer.rollout.tasks.repository.projects import resolve_project
from composer.rollout.tasks.repository.pytest_config import config_args, project_config

PYPROJECT = """[tool.pytest.ini_options]
addopts = "--color=yes --cov=mylib -p no:randomly"
testpaths = ["tests"]
python_functions = ["check_*"]
markers = ["network: needs the internet", "slow"]
filterwarnings = ["error", "ignore::DeprecationWarning"]
xfail_strict = true
"""


def test_the_file_pytest_chooses_wins():
    files = {"pyproject.toml": PYPROJECT, "setup.cfg": "[tool:pytest]\npython_functions = nope_*\n", "tox.ini": "[tox]\n"}
    name, settings = project_config(files.get)
    assert name == "pyproject.toml" and settings["python_functions"] == ["check_*"]
    files["pytest.ini"] = "[pytest]\npython_files = *_check.py\n"
    assert project_config(files.get)[0] == "pytest.ini"
    assert project_config({"setup.cfg": "[metadata]\nname = x\n", "tox.ini": "[pytest]\nxfail_strict = true\n"}.get) == (
        "tox.ini",
        {"xfail_strict": "true"},
    )
    assert project_config({"pyproject.toml": "[project]\nname = 'x'\n"}.get) is None


def test_what_decides_tests_is_carried_and_plugin_options_are_not(tmp_path):
    args = config_args(project_config({"pyproject.toml": PYPROJECT}.get)[1])
    assert args == [
        "-p",
        "no:randomly",
        "-o",
        "python_functions=check_*",
        "-o",
        "markers=network: needs the internet\nslow",
        "-o",
        "filterwarnings=error\nignore::DeprecationWarning",
        "-o",
        "xfail_strict=true",
    ]
    # pytest takes them as the project's file would have set them: `check_*` functions are its tests, and an
    # xfail test that passes fails the run
    (tmp_path / "test_things.py").write_text(
        "import pytest\n\n\ndef check_one():\n    pass\n\n\n@pytest.mark.xfail\ndef check_two():\n    pass\n\n\ndef test_ignored():\n    pass\n"
    )
    (tmp_path / "empty.ini").write_text("[pytest]\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", "empty.ini", "-p", "no:cacheprovider", "-q", *args[2:], "test_things.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert "1 passed" in done.stdout and "1 failed" in done.stdout and "[XPASS(strict)]" in done.stdout, done.stdout


def test_a_project_runs_with_its_configuration_then_the_recipes_arguments(tmp_path):
    (tmp_path / "mylib").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_core.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "setup.cfg").write_text("[tool:pytest]\naddopts = -p no:randomly --strict-markers\nxfail_strict = true\n")
    entry = ProjectSettings(name="mylib", path=str(tmp_path), package="mylib", pytest_args=["-x"], exclude_markers=["slow"])
    spec = resolve_project(entry, ["bug"])
    assert spec.pytest_args == ("-p", "no:randomly", "-o", "xfail_strict=true", "-x", "-m", "not slow")
