"""The projects whose own test suites make repository tasks, and their environments.

Ready-made projects (`networkx`, `sympy`) are installed packages that ship their tests (`rollout.tasks.repository.build`
says why these two): their files are the installed package, their environment the sandbox's own interpreter, with
every installed copy of the project hidden. A project of the user's own (`env.tasks[].repo.projects`, a mapping) is
a directory, or a git checkout read at its pinned commit; its environment is a virtual environment of its own, made
once per digest (the project's files, the install command, the interpreter) by running the install command in the
sandbox with the machine's package index (pip's configuration, its local indexes and certificates bound read-only),
then frozen: the project's own distributions removed (episodes import their copy), `pip freeze` recorded, the tree
made read-only to every run, and its manifest written last (a directory without one is half-made and made again).

Every project becomes a `ProjectSpec`: where its files come from, the packages tasks change, where its tests are, its
pytest arguments (what its own pytest configuration decides, `rollout.tasks.repository.pytest_config`, then the
recipe's), and the digest its bases, surveys and tasks are cached under.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from composer.recipes.env_schema import ProjectSettings, RepoTaskSettings, SandboxSection
from composer.recipes.errors import UserError
from composer.rollout.sandbox.isolation import installed_copies
from composer.rollout.sandbox.results import RunEnvironment
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.sandbox.trees import TreeTooLarge, remove_tree, walk_files
from composer.rollout.tasks.repository.grading_policy import package_of
from composer.rollout.tasks.repository.pytest_config import config_args, project_config
from composer.runtime.run_dir import atomic_write_text

ENVIRONMENT_VERSION = 1
"""Bump when how an environment is made changes: part of every environment's digest."""
SKIPPED_NAMES = (".git", "__pycache__", "*.pyc", ".venv", ".tox", ".pytest_cache", "*.egg-info")
NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates", "/usr/share/ca-certificates")
"""What a sandboxed install needs to reach a package index by name over TLS."""


@dataclass(frozen=True)
class Project:
    """A ready-made project: an installed package that ships its tests."""

    name: str
    """Distribution and top-level package."""
    pytest_args: tuple[str, ...] = ()
    skip_files_with: tuple[str, ...] = ()
    """Test files whose text holds one of these are not used (nondeterministic tools)."""


PROJECTS = {
    "networkx": Project("networkx"),
    "sympy": Project("sympy", pytest_args=("-m", "not slow"), skip_files_with=("hypothesis",)),
}


@dataclass(frozen=True)
class ProjectSpec:
    """One project of a task set, as the build and the workspaces use it."""

    name: str
    packages: tuple[str, ...]
    """The packages tasks change, relative to the project root (`networkx`; `src/mylib`, `lib/other`)."""
    version: str
    """What prompts call it: the installed version, or the commit (a short hash) / content digest."""
    digest: str
    """Decides its bases and environment: the version of a ready-made project, else the files' and install's."""
    pytest_args: tuple[str, ...] = ()
    skip_files_with: tuple[str, ...] = ()
    test_paths: tuple[str, ...] = ()
    """Where its test files are (relative to the root); empty: `<module dir>/tests/test_<module>.py`."""
    hidden: tuple[str, ...] = ()
    checkout: Path | None = None
    """The git checkout (history tasks read its log), None for a directory or an installed package."""
    commit: str | None = None
    settings: ProjectSettings | None = None
    """The recipe's mapping of a user's project (None: ready-made)."""
    group_requirements: tuple[str, ...] = ()
    """The requirements of its `dependency_groups`, installed after its install command."""

    @property
    def import_names(self) -> tuple[str, ...]:
        return tuple(PurePosixPath(p).name for p in self.packages)

    def package_of(self, path: str) -> str | None:
        """The package holding `path` (relative to the project root), None outside every package."""
        return package_of(path, self.packages)

    @property
    def tests_key(self) -> str:
        """Decides what its test runs report beyond its files: the packages, the test paths, the pytest arguments."""
        # one package as the string it always was: the surveys and sets cached before `packages` stay valid
        packages = self.packages[0] if len(self.packages) == 1 else list(self.packages)
        decided = [packages, list(self.test_paths), list(self.pytest_args), list(self.skip_files_with)]
        return hashlib.sha256(json.dumps(decided).encode()).hexdigest()[:8]


def _git(checkout: Path, *args: str, data: bool = False) -> str | bytes:
    done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=not data)
    if done.returncode != 0:
        err = done.stderr if isinstance(done.stderr, str) else done.stderr.decode(errors="replace")
        raise UserError(f"git {' '.join(args[:2])} in {checkout}: {err.strip().splitlines()[-1] if err.strip() else 'failed'}")
    return done.stdout


def is_git_checkout(path: Path) -> bool:
    done = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    return done.returncode == 0 and Path(done.stdout.strip()).resolve() == path.resolve()


def _tree_digest(root: Path) -> str:
    """The content of a plain directory (paths and bytes, the skipped names left out)."""
    digest = hashlib.sha256()
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not _skipped(d))
        for name in sorted(f for f in files if not _skipped(f)):
            path = Path(directory, name)
            digest.update(f"{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes() if not path.is_symlink() else os.readlink(path).encode())
    return digest.hexdigest()


def _skipped(name: str) -> bool:
    return any(PurePosixPath(name).match(pattern) for pattern in SKIPPED_NAMES)


def ready_made_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"env.tasks: the repo task project {name} is not installed (pip install {name})") from None


def resolve_project(entry: str | ProjectSettings, kinds: list[str], index: int | None = None) -> ProjectSpec:
    """A recipe's project entry as a spec: every problem a user can cause is one UserError naming the project (and
    its key, `env.tasks[].repo.projects[index]`; the command that knows the task set's index fills in the first)."""
    if isinstance(entry, str):
        project = PROJECTS[entry]
        version = ready_made_version(entry)
        return ProjectSpec(entry, (entry,), version, version, project.pytest_args, project.skip_files_with, hidden=installed_copies(entry))
    where = f"env.tasks: project {entry.name}"
    path = Path(entry.path).expanduser().resolve()
    if not path.is_dir():
        raise UserError(f"{where}: {entry.path} is not a directory")
    git = is_git_checkout(path)
    if git and entry.commit is None:
        raise UserError(f"{where}: {path} is a git checkout; pin the commit its tasks come from (`commit: <hash>`)")
    if not git and entry.commit is not None:
        raise UserError(f"{where}: `commit: {entry.commit}` but {path} is not a git checkout")
    if not git and "history" in kinds:
        raise UserError(
            f"{where}: history tasks come from a git log, and {path} is not a git checkout "
            "(drop `history` from kinds, or point `path` at a checkout)"
        )
    key = f"env.tasks[].repo.projects[{'' if index is None else index}]"
    if git:
        try:
            commit = _git(path, "rev-parse", "--verify", "--quiet", f"{entry.commit}^{{commit}}").strip()
        except UserError:
            raise UserError(
                f"{key}.commit: project {entry.name}: {entry.commit} is not a commit of {path} "
                "(a hash, branch or tag of that checkout; fetch it first if it is a remote's)"
            ) from None
        files = commit
        present = lambda relative: _git(path, "cat-file", "-t", f"{commit}:{relative}").strip() == "tree"
        version = commit[:12]
    else:
        commit = None
        files = _tree_digest(path)
        present = lambda relative: (path / relative).is_dir()
        version = files[:12]
    packages = [(p, "package" if entry.packages is None else "packages entry") for p in entry.package_paths]
    for relative, what in [*packages, *((p, "test path") for p in entry.test_paths)]:
        try:
            found = present(relative)
        except UserError:
            found = False
        if not found:
            raise UserError(f"{where}: its {what} {relative} is not a directory of {path}" + (f" at {version}" if git else ""))
    if git:
        listed = _git(path, "ls-tree", "-r", "--name-only", commit, "--", *entry.test_paths)
        test_files = [name for name in str(listed).splitlines() if PurePosixPath(name).match("test_*.py")]
    else:
        test_files = [p for t in entry.test_paths for p in (path / t).rglob("test_*.py")]
    if not test_files and set(kinds) - {"history"}:
        raise UserError(
            f"{key}.test_paths: project {entry.name}: no test file (test_*.py) under {', '.join(entry.test_paths)}"
            + (f" at {version}" if git else "")
            + f": {', '.join(sorted(set(kinds) - {'history'}))} tasks are graded by the tests of the pinned files "
            "(point test_paths at its tests, or pin a commit that has them)"
        )

    def root_file(name: str) -> str | None:
        try:
            return str(_git(path, "show", f"{commit}:{name}")) if git else (path / name).read_text(errors="replace")
        except (UserError, OSError):
            return None

    groups = dependency_groups(root_file("pyproject.toml"), entry.dependency_groups, f"{key}.dependency_groups: project {entry.name}")
    found = project_config(root_file)
    args = [*(config_args(found[1]) if found else []), *entry.pytest_args]
    if entry.exclude_markers:
        args += ["-m", " and ".join(f"not {m}" for m in entry.exclude_markers)]
    digest = hashlib.sha256(
        json.dumps(
            {
                "files": files,
                "install": entry.install,
                "groups": list(groups),
                "python": _python_identity(entry),
                "environment": ENVIRONMENT_VERSION,
                # which distributions the install leaves is checked per package; one package keeps the digest it had
                **({"packages": entry.package_paths} if len(entry.package_paths) > 1 else {}),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:16]
    return ProjectSpec(
        entry.name,
        tuple(entry.package_paths),
        version,
        digest,
        tuple(args),
        (),
        tuple(entry.test_paths),
        checkout=path if git else None,
        commit=commit,
        settings=entry,
        group_requirements=groups,
    )


def dependency_groups(pyproject: str | None, names: list[str], where: str) -> tuple[str, ...]:
    """The requirements of the named PEP 735 groups of a pyproject.toml's text, `include-group` entries followed, in
    order and without repeats; a missing file, table or group, a cycle or a malformed entry is one UserError."""
    if not names:
        return ()
    if pyproject is None:
        raise UserError(f"{where}: the pinned files have no pyproject.toml to read dependency groups from")
    try:
        table = tomllib.loads(pyproject).get("dependency-groups")
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"{where}: its pyproject.toml is not valid TOML ({error})") from None
    if not isinstance(table, dict) or not table:
        raise UserError(f"{where}: its pyproject.toml has no [dependency-groups] table (drop the key, or name an extra in `install`)")
    # PEP 735 compares group names normalized, as package names are
    normalized = {str(k).lower().replace("_", "-").replace(".", "-"): k for k in table}
    requirements: list[str] = []

    def add(name: str, seen: tuple[str, ...]) -> None:
        key = normalized.get(name.lower().replace("_", "-").replace(".", "-"))
        if key is None:
            raise UserError(f"{where}: no group {name!r} in its [dependency-groups] (it has: {', '.join(map(str, table))})")
        if key in seen:
            raise UserError(f"{where}: group {key!r} includes itself ({' -> '.join([*seen, key])})")
        entries = table[key]
        if not isinstance(entries, list):
            raise UserError(f"{where}: group {key!r} is not a list")
        for item in entries:
            if isinstance(item, str):
                requirements.append(item)
            elif isinstance(item, dict) and set(item) == {"include-group"} and isinstance(item["include-group"], str):
                add(item["include-group"], (*seen, key))
            else:
                raise UserError(f"{where}: group {key!r} holds {item!r}: an entry is a requirement or {{include-group = NAME}}")

    for name in names:
        add(name, ())
    return tuple(dict.fromkeys(requirements))


def resolve_projects(settings: RepoTaskSettings) -> dict[str, ProjectSpec]:
    return {spec.name: spec for spec in (resolve_project(p, settings.kinds, j) for j, p in enumerate(settings.projects))}


def _python(entry: ProjectSettings) -> str:
    python = entry.python or sys.executable
    found = shutil.which(python)
    if found is None:
        raise UserError(f"env.tasks: project {entry.name}: its python {python} is not an executable")
    return found


def _python_identity(entry: ProjectSettings) -> str:
    """The interpreter an environment is made from: its real path and version (a new Python, a new digest)."""
    python = _python(entry)
    done = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"env.tasks: project {entry.name}: its python {python} does not run ({done.stderr.strip()[-200:]})")
    return f"{os.path.realpath(python)} {done.stdout.strip()}"


# --- bases: the project's files, twice ------------------------------------------------------------


def _chmod_tree(root: Path, file_mode: int, dir_mode: int) -> None:
    for directory, _, files in os.walk(root):
        os.chmod(directory, dir_mode)
        for name in files:
            path = Path(directory, name)
            if not path.is_symlink():
                os.chmod(path, file_mode)


def _export(spec: ProjectSpec, commit: str | None, target: Path) -> None:
    """The project's files into `target`: the installed package, the directory, or the checkout at `commit`."""
    if spec.settings is None:
        origin = importlib.util.find_spec(spec.name)  # found without importing it (sympy's import takes a second)
        if origin is None or not origin.submodule_search_locations:
            raise UserError(f"env.tasks: the repo task project {spec.name} is not installed as a package")
        shutil.copytree(origin.submodule_search_locations[0], target / spec.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    elif spec.checkout is not None:
        target.mkdir(parents=True)
        archive = _git(spec.checkout, "archive", "--format=tar", commit or spec.commit, data=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    else:
        shutil.copytree(Path(spec.settings.path).expanduser(), target, symlinks=True, ignore=shutil.ignore_patterns(*SKIPPED_NAMES))


def bases_dir(cache_dir: Path, spec: ProjectSpec, commit: str | None = None) -> Path:
    """Where the bases of `spec` (at `commit`, for a history task, else its pinned files) live."""
    key = commit[:16] if commit else spec.digest if spec.settings is not None else spec.version
    return cache_dir / "projects" / f"{spec.name}-{key}"


def project_bases(cache_dir: Path, spec: ProjectSpec, commit: str | None = None) -> Path:
    """<cache>/projects/<name>-<key>/{episode,grading}/: the project's files without bytecode, made once
    (atomically): an episode base (0666/0777: every command runs as another uid) and a grading base (root's)."""
    target = bases_dir(cache_dir, spec, commit)
    if (target / "grading").is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent))
    try:
        _export(spec, commit, staging / "grading")
        shutil.copytree(staging / "grading", staging / "episode", symlinks=True)
        _chmod_tree(staging / "episode", 0o666, 0o777)
        _chmod_tree(staging / "grading", 0o644, 0o755)
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "grading").is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# --- environments ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProjectEnvironment:
    """A built, frozen virtual environment of a user's project."""

    root: Path
    digest: str
    prefixes: tuple[str, ...]
    """The interpreter's installation it was made from (read-only in every run)."""
    frozen: tuple[str, ...]
    """`pip freeze --all` after the install."""

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    def run_environment(self) -> RunEnvironment:
        return RunEnvironment(path=(str(self.venv / "bin"),), read_only=(str(self.venv), *self.prefixes))


def environment_dir(cache_dir: Path, spec: ProjectSpec) -> Path:
    return cache_dir / "envs" / f"{spec.name}-{spec.digest}"


def load_environment(root: Path) -> ProjectEnvironment | None:
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        return ProjectEnvironment(root, manifest["digest"], tuple(manifest["prefixes"]), tuple(manifest["frozen"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def project_environment(cache_dir: Path, spec: ProjectSpec, sandbox: SandboxSection, sandbox_root: Path) -> ProjectEnvironment | None:
    """The project's environment, made now unless a finished one of its digest is cached (None for a ready-made
    project: the sandbox's interpreter). One builder at a time per digest (a lock file); a failed install leaves
    its log (named in the error) and nothing else."""
    if spec.settings is None:
        return None
    root = environment_dir(cache_dir, spec)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (found := load_environment(root)) is not None:
            return found
        remove_tree(root)  # half-made by a build that was killed
        try:
            return _make_environment(cache_dir, spec, sandbox, sandbox_root, root)
        except BaseException:
            remove_tree(root)
            raise


def _pip_configuration() -> tuple[dict[str, str], list[str]]:
    """This machine's pip settings as PIP_* variables for the sandboxed install, and the local paths they name
    (file:// indexes, find-links directories, certificates, constraint files) to bind read-only."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    variables, paths = {}, []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        key, _, value = line.partition("=")
        name = key.split(".", 1)[-1].replace("-", "_").upper()
        value = value.strip().strip("'\"")
        variables[f"PIP_{name}"] = value
        for word in value.split():
            local = word.removeprefix("file://").rstrip("/")
            if local.startswith("/") and os.path.exists(local):
                # a local index's pages (`.../simple`) link to files beside them
                paths.append(os.path.dirname(local) if local.endswith("/simple") else local)
    for key, value in os.environ.items():
        if key.startswith("PIP_"):
            variables[key] = value
            paths += [w for w in value.split() if w.startswith("/") and os.path.exists(w)]
    return variables, paths


def _make_environment(cache_dir: Path, spec: ProjectSpec, sandbox: SandboxSection, sandbox_root: Path, root: Path) -> ProjectEnvironment:
    entry = spec.settings
    python = _python(entry)
    root.mkdir(parents=True)
    venv = root / "venv"
    made = subprocess.run([python, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        raise UserError(f"env.tasks: project {spec.name}: {python} -m venv failed: {made.stderr.strip()[-300:]}")
    prefixes = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True, check=True
    ).stdout.split()
    _chmod_tree(venv, 0o666, 0o777)  # the install runs as a sandbox uid
    for script in (venv / "bin").iterdir():
        if not script.is_symlink():
            os.chmod(script, 0o777)
    variables, pip_paths = _pip_configuration()
    read_only = tuple(p for p in dict.fromkeys([*prefixes, *pip_paths, *NETWORK_FILES]) if os.path.exists(p))
    installing = RunEnvironment(
        path=(str(venv / "bin"),), read_only=read_only, writable=(str(venv),), variables=tuple(sorted(variables.items()))
    )
    limits = sandbox.model_copy(
        update={
            "network": True,
            "memory_mb": max(sandbox.memory_mb, 4096),
            "max_processes": 512,
            "max_file_mb": 1024,
            "max_write_mb": 8192,
            "max_inodes": 1 << 20,
            "max_output_kb": 1024,
            "infra_retries": 0,
        }
    )
    installer = Sandbox(limits, root=sandbox_root)
    log_path = cache_dir / "logs" / f"{spec.name}-{spec.digest}-install.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="install-", dir=sandbox_root) as work:
        bases = project_bases(cache_dir, spec)
        shutil.copytree(bases / "episode", work, symlinks=True, dirs_exist_ok=True)
        # The dependency groups' requirements, installed by composer: the environment's pip may not know `--group`.
        commands = [entry.install, *([f"python -m pip install {shlex.join(spec.group_requirements)}"] if spec.group_requirements else [])]
        command = " && ".join(commands)
        own = "; ".join(
            [
                command,
                # The project's own distributions go: episodes import their workspace's copy of each package.
                "status=$?; [ $status -ne 0 ] && exit $status",
                "python - <<'EOF'\n" + _REMOVE_OWN.replace("PACKAGES", json.dumps(list(spec.packages))) + "EOF",
            ]
        )
        result = installer.run_command(own, Path(work), timeout_s=entry.install_seconds, environment=installing)
        log_path.write_text(f"$ {command}\n{result.output}\n[{result.status}, exit {result.exit_code}]\n")
        if result.status != "ok" or result.exit_code != 0:
            errors = [line.strip() for line in result.output.splitlines() if line.startswith("ERROR:") or "Error:" in line]
            key = "install" if not spec.group_requirements else "install / dependency_groups"
            raise UserError(
                f"env.tasks[].repo.projects[].{key}: project {spec.name}: `{command}` failed ({result.status}, exit "
                f"{result.exit_code}){': ' + errors[-1][:300] if errors else ''}; change the install command, or make what it "
                f"needs reachable from this machine's package index (the install log: {log_path})"
            )
        check = installer.run_command(
            _CHECK.replace("IMPORTS", json.dumps(list(spec.import_names))), Path(work), timeout_s=120, environment=installing
        )
    if check.exit_code != 0:
        log_path.write_text(log_path.read_text() + f"\n$ (the environment's check)\n{check.output}\n")
        raise UserError(
            f"env.tasks: project {spec.name}: {check.output.strip().splitlines()[-1] if check.output.strip() else 'its environment check failed'}"
            f"; the install log: {log_path}"
        )
    frozen = [line for line in check.output.splitlines() if line and not line.startswith("#")]
    _seal(spec, venv)
    os.chmod(root, 0o755)
    atomic_write_text(
        root / "manifest.json",
        json.dumps({"digest": spec.digest, "python": python, "prefixes": prefixes, "install": command, "frozen": frozen}, indent=1),
    )
    return load_environment(root)


def _seal(spec: ProjectSpec, venv: Path) -> None:
    """Make the environment the install (a sandbox uid) wrote root's and read-only to runs. It may hold files,
    directories and symlinks only: a socket, FIFO or device the install left is refused (bound read-only into every
    run's view, a socket would still connect runs to whatever listens on it); a hard link is broken into a file of
    its own first, so that making it root's never reaches an inode another path holds. Walked without following
    links or recursing (`trees.walk_files`)."""
    try:
        entries = list(walk_files(venv))
    except TreeTooLarge as e:
        raise UserError(f"env.tasks: project {spec.name}: its install left an environment too large to seal ({e})") from None
    for relative, st in [("", os.lstat(venv)), *entries]:
        path = venv / relative
        if stat.S_ISLNK(st.st_mode):
            continue
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            raise UserError(
                f"env.tasks: project {spec.name}: its install left a special file (socket, FIFO or device) at "
                f"venv/{relative}; an environment may hold only files, directories and symlinks: change `install`"
            )
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            copy = path.with_name(f".{path.name}.unlinked")
            shutil.copyfile(path, copy, follow_symlinks=False)
            os.replace(copy, path)
        if os.geteuid() == 0:
            os.chown(path, 0, 0, follow_symlinks=False)
        os.chmod(path, 0o755 if stat.S_ISDIR(st.st_mode) else (st.st_mode & 0o755) | 0o444)


_REMOVE_OWN = """import json, os, subprocess, sys, sysconfig
from urllib.parse import unquote
site = sysconfig.get_paths()["purelib"]
# a distribution of the project: installed from its root, or from a directory of it that holds one of its packages
packages = [os.path.realpath(p) for p in PACKAGES]
mine = []
for info in os.listdir(site):
    if not info.endswith(".dist-info"):
        continue
    try:
        url = json.load(open(os.path.join(site, info, "direct_url.json"))).get("url", "")
    except (OSError, ValueError):
        continue
    where = os.path.realpath(unquote(url[7:])) if url.startswith("file://") else None
    if where is not None and (where == os.path.realpath(os.getcwd()) or any(p == where or p.startswith(where + os.sep) for p in packages)):
        mine.append(info.split("-")[0])
if mine:
    # Run from outside the project: its directory is first on pip's path, and the metadata a build backend leaves
    # there (setuptools' `<name>.egg-info`) would be the copy pip finds ("Not uninstalling ... outside environment").
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sys.exit(subprocess.call([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *mine], cwd="/", env=clean))
"""
"""Run after the install in its work directory (PACKAGES: the packages' paths there, as JSON): uninstall the
distributions installed from that directory or from one of its directories that holds a package."""

_CHECK = """cd /tmp && env -u PYTHONPATH python - <<'EOF'
import importlib.util, subprocess, sys
for name in IMPORTS:
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"the environment still holds an installed copy of {name} ({importlib.util.find_spec(name).origin}): "
                 "install the project's dependencies, not the project, or install it from its directory")
if importlib.util.find_spec("pytest") is None:
    sys.exit("the environment has no pytest: the install command must install it (e.g. `pip install . pytest`)")
sys.exit(subprocess.call([sys.executable, "-m", "pip", "freeze", "--all"]))
EOF"""
"""The environment holds pytest and no copy of any of the packages (IMPORTS: their names, as JSON); its frozen
requirements on stdout."""
