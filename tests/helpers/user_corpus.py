"""A corpus of real user projects: pure-Python packages from the package registry, as source distributions that
ship their tests, one per build backend (setuptools with setup.cfg, setup.py, hatchling, flit, poetry-core,
pdm-backend), in src and flat layouts, with unittest-style and pytest suites and test dependencies from extras,
a requirements file and an explicit install command.

`scripts/setup.sh` fetches the pinned sdists and every wheel their installs need (tests/helpers/user_corpus.txt)
into `.cache/user-corpus`; nothing downloads later: the installs read that cache as the machine's package index
(`offline_index`). `make_repository` gives an unpacked sdist a git history: the sdist as the first commit, then, for
each seeded regression it is given, a commit that brings the bug in (source only) and one that fixes it and touches
its test file (what history tasks come from). Dates and authors are fixed: the same hashes every time."""

from __future__ import annotations

import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from composer.recipes.env_schema import RepoTaskSettings, SandboxSection
from composer.rollout.tasks.repository.build import BuildReport, build_repo_tasks, set_dir
from composer.rollout.tasks.repository.task_set import load_tasks
from tests.conftest import REPO
from tests.helpers.user_project import git

CACHE = Path(os.environ.get("COMPOSER_USER_CORPUS", REPO / ".cache" / "user-corpus"))
PINS = Path(__file__).with_name("user_corpus.txt")


@dataclass(frozen=True)
class CorpusProject:
    name: str
    version: str
    backend: str
    package: str
    install: str
    test_paths: tuple[str, ...] = ("tests",)
    max_test_seconds: float = 5.0
    """The build's `repo.max_test_seconds`: raised for a project whose test files need more CPU than the default."""

    @property
    def sdist(self) -> Path:
        return CACHE / f"{self.name}-{self.version}.tar.gz"

    def entry(self, repo: Path, commit: str = "main") -> dict:
        """The project as a recipe's `env.tasks[].repo.projects` entry."""
        return {
            "name": self.name,
            "path": str(repo),
            "commit": commit,
            "package": self.package,
            "install": self.install,
            "test_paths": list(self.test_paths),
        }


CORPUS = (
    # setuptools (setup.cfg), src layout, unittest.TestCase suite
    CorpusProject("cachetools", "5.5.0", "setuptools", "src/cachetools", "pip install . pytest"),
    # setup.py (versioneer), flat layout, tests inside the package
    CorpusProject("toolz", "1.0.0", "setup.py", "toolz", "pip install . pytest", test_paths=("toolz/tests",)),
    # hatchling with hatch-vcs, src layout, pytest configuration in pyproject, test dependencies as an extra
    CorpusProject("humanize", "4.11.0", "hatchling", "src/humanize", "pip install .[tests]"),
    # flit, src layout, test dependencies in tests/requirements.txt; test_version.py needs 21 s of CPU here
    CorpusProject("packaging", "24.2", "flit", "src/packaging", "pip install . -r tests/requirements.txt", max_test_seconds=30),
    # poetry-core, flat layout, conftest fixtures, test dependencies named in the install command
    CorpusProject("tomlkit", "0.13.2", "poetry-core", "tomlkit", "pip install . pytest pyyaml"),
    # pdm-backend, src layout, private modules (`_conversion.py`, tested by `test_conversion.py`), unittest suite
    CorpusProject("webcolors", "24.11.1", "pdm-backend", "src/webcolors", "pip install . pytest"),
)


def missing() -> str | None:
    """Why the corpus cannot be used here (None when every sdist and wheel is cached)."""
    absent = [p.sdist.name for p in CORPUS if not p.sdist.is_file()]
    if absent or not (CACHE / "wheels").is_dir():
        return f"the user-project corpus is not in {CACHE} (scripts/setup.sh fetches it): {', '.join(absent) or 'wheels/'}"
    return None


def offline_index() -> dict[str, str]:
    """pip settings under which the projects' installs (and their isolated builds) read only the cached wheels."""
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(CACHE / "wheels")}


def unpack(project: CorpusProject, target: Path) -> Path:
    """The sdist's tree at `target` (its top directory stripped)."""
    target.mkdir(parents=True)
    with tarfile.open(project.sdist) as archive:
        top = f"{project.name}-{project.version}/"
        for member in archive.getmembers():
            if member.name.startswith(top):
                member.name = member.name[len(top) :]
                archive.extract(member, target, filter="data")
    return target


def make_repository(project: CorpusProject, repo: Path) -> str:
    """The unpacked sdist as a git repository of one commit on `main`; its hash."""
    unpack(project, repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A", "-f")
    git(repo, "commit", "-q", "-m", f"{project.name} {project.version} from its sdist")
    return git(repo, "rev-parse", "HEAD")


@dataclass(frozen=True)
class Regression:
    """A seeded bug that the project's tests catch: the file's text with it, the function, and the test file."""

    path: str
    buggy: str
    function: str
    test_file: str


def add_fixes(repo: Path, regressions: list[Regression]) -> list[str]:
    """For each regression: a commit that brings it in (source only), then one that fixes it and adds a regression
    note to its test file (a history task); the fixing commits' hashes."""
    fixes = []
    for regression in regressions:
        source, test = repo / regression.path, repo / regression.test_file
        original = source.read_text()
        source.write_text(regression.buggy)
        git(repo, "commit", "-q", "-am", f"Refactor {regression.function}")
        source.write_text(original)
        test.write_text(test.read_text() + f"\n# regression: {regression.function} is covered by the tests above\n")
        git(repo, "commit", "-q", "-am", f"Fix {regression.function}: the refactoring broke it")
        fixes.append(git(repo, "rev-parse", "HEAD"))
    return fixes


KINDS = ["bug", "feature", "multi", "history"]
LIMITS = SandboxSection(cpu_seconds=60, wall_seconds=180, memory_mb=2048)
REGRESSIONS = 2


def seeded_regressions(project: CorpusProject, repo: Path, cache: Path, sandbox_root: Path, workers: int) -> list[Regression]:
    """Bug tasks at the sdist's commit (validated: its tests catch them), as regressions to commit."""
    seeding = RepoTaskSettings(
        projects=[project.entry(repo)],
        kinds=["bug"],
        num_tasks=REGRESSIONS,
        cache_dir=str(cache),
        max_test_seconds=project.max_test_seconds,
    )
    build_repo_tasks(seeding, LIMITS, sandbox_root, workers)
    return [
        Regression(t["path"], (set_dir(seeding) / t["layer"] / t["path"]).read_text(), t["function"], t["test_file"])
        for t in load_tasks(seeding)
    ]


@dataclass(frozen=True)
class CorpusBuild:
    settings: RepoTaskSettings
    report: BuildReport
    fixes: list[str]
    """The commits that fixed a seeded regression."""
    seconds: float


def build_project(project: CorpusProject, base: Path, workers: int, num_tasks: int = 100_000) -> CorpusBuild:
    """The project's sdist as a repository with fixes of seeded regressions, built into every kind (the candidates
    in order until `num_tasks` validate: all of them by default); its installs read only the cached wheels
    (`offline_index`, set in the environment by the caller)."""
    repo, cache, sandbox_root = base / project.name, base / "cache", base / "sandboxes"
    started = time.monotonic()
    make_repository(project, repo)
    fixes = add_fixes(repo, seeded_regressions(project, repo, cache, sandbox_root, workers))
    settings = RepoTaskSettings(
        projects=[project.entry(repo)], kinds=KINDS, num_tasks=num_tasks, cache_dir=str(cache), max_test_seconds=project.max_test_seconds
    )
    report = build_repo_tasks(settings, LIMITS, sandbox_root, workers)
    return CorpusBuild(settings, report, fixes, time.monotonic() - started)
