"""A user's project of several packages (`packages:` instead of `package:`): how the recipe names them, what is
refused, and how a file of the project is placed among them (which package, which module, which sys.path entry); bug
and feature candidates come from every package's modules, history candidates from a commit in any of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from composer.recipes.env_schema import ProjectSettings, RepoTaskSettings
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.rollout.sandbox.results import RunEnvironment
from composer.rollout.tasks.repository.boundary import module_name
from composer.rollout.tasks.repository.candidates import candidates
from composer.rollout.tasks.repository.grading_policy import import_path, package_of, package_sources
from composer.rollout.tasks.repository.history import commit_of
from composer.rollout.tasks.repository.projects import resolve_project, resolve_projects
from composer.rollout.tasks.repository.workspace import packages_environment
from tests.conftest import REPO
from tests.helpers.user_project import git

MODULE = '''def scale(value, factor):
    """`value` times `factor`, at least zero."""
    result = value * factor
    if result < 0:
        return 0
    return result
'''


def _project(root: Path) -> Path:
    """Two packages, one under src/ and one at the root, each module with its test file."""
    for package in ("src/alpha", "beta"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        name = Path(package).name
        (root / package / f"{name}_ops.py").write_text(MODULE)
    (root / "tests").mkdir()
    for name in ("alpha", "beta"):
        (root / "tests" / f"test_{name}_ops.py").write_text(
            f"from {name}.{name}_ops import scale\n\n\ndef test_scale():\n    assert scale(2, 3) == 6\n"
        )
    return root


def entry(root: Path, **keys) -> dict:
    return {"name": "duo", "path": str(root), **keys}


@pytest.mark.parametrize("keys, said", [({}, "neither"), ({"package": "beta", "packages": ["beta"]}, "both")])
def test_a_project_gives_package_or_packages_exactly(tmp_path, keys, said):
    with pytest.raises(ValidationError, match=rf"project duo: give `package` \(one package\) or `packages` \(a list\), not {said}"):
        ProjectSettings(**entry(tmp_path, **keys))


@pytest.mark.parametrize(
    "packages, said",
    [
        (["src/alpha", "beta", "src/alpha/"], "`packages` lists src/alpha twice; list each package once"),
        (["src/alpha", "src/alpha/sub"], "`packages` holds src/alpha and src/alpha/sub, one inside the other"),
        (["src/alpha", "lib/alpha"], "`packages` src/alpha and lib/alpha are both imported as `alpha`: only one of them"),
        ([], "`packages` is empty; list the packages, or give `package`"),
    ],
)
def test_packages_that_would_collide_are_refused(tmp_path, packages, said):
    with pytest.raises(ValidationError, match=f"project duo: {said}".replace("(", r"\(").replace(")", r"\)")):
        ProjectSettings(**entry(tmp_path, packages=packages))


def test_the_recipe_names_where_the_two_keys_clash():
    with pytest.raises(UserError) as refused:
        load_recipe(REPO / "recipes" / "smoke-repo-sft.yaml", ["env.tasks.0.repo.projects.0.packages=[src/tally, lib/other]"])
    assert "env.tasks[0].repo.projects[0].ProjectSettings.packages: project tally: give `package` (one package) or `packages`" in str(
        refused.value
    )


def test_a_package_that_is_not_a_directory_is_named_with_its_key(tmp_path):
    root = _project(tmp_path / "duo")
    with pytest.raises(UserError, match=rf"project duo: its packages entry lib/gamma is not a directory of {root}$"):
        resolve_project(ProjectSettings(**entry(root, packages=["src/alpha", "lib/gamma"])), ["bug"])
    with pytest.raises(UserError, match=rf"project duo: its package gamma is not a directory of {root}$"):
        resolve_project(ProjectSettings(**entry(root, package="gamma")), ["bug"])


def test_one_package_either_way_is_the_same_project_and_cache(tmp_path):
    root = _project(tmp_path / "duo")
    one = resolve_project(ProjectSettings(**entry(root, package="beta")), ["bug"])
    listed = resolve_project(ProjectSettings(**entry(root, packages=["beta"])), ["bug"])
    both = resolve_project(ProjectSettings(**entry(root, packages=["src/alpha", "beta"])), ["bug"])
    assert (
        (one.packages, one.tests_key, one.digest)
        == (listed.packages, listed.tests_key, listed.digest)
        == (("beta",), one.tests_key, one.digest)
    )
    assert both.packages == ("src/alpha", "beta") and both.import_names == ("alpha", "beta")
    assert both.tests_key != one.tests_key  # the packages decide which test runs a survey records
    assert both.digest != one.digest  # and what the environment's install must not leave behind


def test_a_file_resolves_against_the_package_that_holds_it():
    packages = ("src/alpha", "beta", "lib/gamma")
    assert [package_of(p, packages) for p in ("src/alpha/x/y.py", "beta/__init__.py", "lib/gamma.py", "betamax/z.py")] == [
        "src/alpha",
        "beta",
        None,
        None,
    ]
    assert str(import_path("src/alpha/x/y.py", packages)) == "alpha/x/y.py" and str(import_path("beta/b.py", packages)) == "beta/b.py"
    assert import_path("tools/t.py", packages) is None
    assert module_name("lib/gamma/core.py", packages) == "gamma.core" and module_name("beta/__init__.py", packages) == "beta"
    assert package_sources(packages) == ("src", "", "lib") and package_sources(("src/a", "src/b")) == ("src",)


def test_every_package_directory_but_the_root_goes_on_pythonpath():
    venv = RunEnvironment(path=("/envs/duo/venv/bin",))
    assert packages_environment(venv, ("src/alpha", "beta", "lib/gamma"), "repo") == RunEnvironment(
        path=venv.path, pythonpath=("repo/src", "repo/lib")
    )
    assert packages_environment(None, ("beta",), ".") is None  # the root is the run's own directory
    assert packages_environment(None, ("src/alpha", "beta"), ".") == RunEnvironment(pythonpath=("src",))


def test_candidates_come_from_every_package(tmp_path):
    root = _project(tmp_path / "bases" / "grading")
    settings = RepoTaskSettings(projects=[entry(root, packages=["src/alpha", "beta"])], kinds=["bug", "feature"], cache_dir=str(tmp_path))
    found = list(candidates(settings, {"duo": root.parent}, resolve_projects(settings)))
    assert {(e.path, c.test_files, c.kind) for c in found for e in c.edits} == {
        (path, (test,), kind)
        for path, test in [("src/alpha/alpha_ops.py", "tests/test_alpha_ops.py"), ("beta/beta_ops.py", "tests/test_beta_ops.py")]
        for kind in ("bug", "feature")
    }


def test_history_counts_a_commit_in_any_of_the_packages(tmp_path):
    root = _project(tmp_path / "duo")
    (root / "tools").mkdir()
    (root / "tools" / "helper.py").write_text(MODULE)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "start")
    commits = {}
    for path in ("beta/beta_ops.py", "src/alpha/alpha_ops.py", "tools/helper.py"):
        (root / path).write_text(MODULE.replace("return 0", "return 0.0"))
        test = root / "tests" / f"test_{Path(path).stem}.py"
        test.write_text((test.read_text() if test.exists() else "") + "\n\ndef test_more():\n    pass\n")
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", f"change {path}")
        commits[path] = git(root, "rev-parse", "HEAD")
    spec = resolve_project(ProjectSettings(**entry(root, commit="main", packages=["src/alpha", "beta"])), ["history"])
    found = {path: commit_of(spec, commit, f"{commit}^") for path, commit in commits.items()}
    assert found["beta/beta_ops.py"].sources == ("beta/beta_ops.py",) and found["beta/beta_ops.py"].functions == (("scale",),)
    assert found["src/alpha/alpha_ops.py"].sources == ("src/alpha/alpha_ops.py",)
    assert found["tools/helper.py"] is None  # outside every package: no source change to hand back
