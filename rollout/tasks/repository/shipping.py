"""Repository workspaces on a sandbox host: what the driver ships there, and the host's side of an episode.

The driver packs each tree a task needs (the project's grading base, its environment, the task's changed files) as a
deterministic tar archive named by its sha256 (`pack`); a host keeps what it received in its sandbox root
(`<root>/shipped/<digest>/`), so a project's files and environment cross once per host: a later task asks `have` and
sends only what is missing. What arrives is checked against its name before it is unpacked (`Store.receive`), and
unpacked atomically; a shipped environment's scripts are pointed at their new place (a virtual environment's
interpreter finds its packages from its own location; only the scripts' `#!` lines name a path).

On the host, `WorkspaceService` opens the episode's copy-on-write view from the shipped trees (`RepoWorkspace`, as on
the driver), runs the tools' commands and file operations there and grades there with the same guarded grader; the
driver sends tool calls and receives observations and the verdict (`rollout.tasks.repository.remote`). The host's
server program (`rollout.sandbox_host`) serves it; `WIRE_TYPES` is what the two sides may send each other.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import shutil
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath

from composer.rollout.sandbox.isolation import installed_copies
from composer.rollout.sandbox.results import RunEnvironment
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.sandbox.trees import walk_files
from composer.rollout.sandbox.wire import SANDBOX_TYPES, wire_types
from composer.rollout.tasks.files import PathRefused
from composer.rollout.tasks.repository.grading_policy import Scope
from composer.rollout.tasks.repository.projects import _chmod_tree
from composer.rollout.tasks.repository.workspace import (
    RepoTestPlan,
    RepoTests,
    RepoWorkspace,
    TestReport,
    packages_environment,
    run_tests_across,
    run_tests_guarded,
)
from composer.rollout.tasks.workspace import views_area

CHUNK_BYTES = 8 << 20
"""Bytes of a shipped archive per frame."""


# --- the driver's side: archives named by their content ------------------------------------------


@cache
def pack(directory: Path) -> tuple[str, Path]:
    """(sha256, archive) of an immutable tree: sorted entries, no times or owners, modes kept; made once per process
    (in the system's temporary directory, beside nothing else). Walked without following a symlink
    (`trees.walk_files`); a hard link goes as a file of its own, and a tree holding a device or special file or a
    symlink that leaves it (`_link_refused`) is refused (`ShippingError`): nothing of the kind reaches a host."""
    buffer = io.BytesIO()
    walked = sorted(relative for relative, _ in walk_files(directory, max_depth=256, max_path=3000, max_entries=2_000_000))
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for relative in [".", *walked]:
            path = directory / relative
            info = archive.gettarinfo(str(path), arcname=relative)
            info.mtime = info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.islnk():
                info.type, info.linkname, info.size = tarfile.REGTYPE, "", path.lstat().st_size
            if not (info.isreg() or info.isdir() or info.issym()):
                raise ShippingError(f"{path}: a device or special file cannot be shipped")
            if info.issym() and _link_refused(info):
                raise ShippingError(f"{path}: a symlink that leaves its tree ({info.linkname}) cannot be shipped")
            if info.isreg():
                with open(path, "rb") as f:
                    archive.addfile(info, f)
            else:
                archive.addfile(info)
    data = buffer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    target = Path(tempfile.gettempdir()) / "composer-shipping" / f"{digest}.tar"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.is_file():
        staging = target.with_suffix(f".{os.getpid()}-{threading.get_ident()}.part")
        staging.write_bytes(data)
        os.replace(staging, target)
    return digest, target


# --- the host's side ---------------------------------------------------------------------------


class ShippingError(ValueError):
    """What arrived is not what was announced."""


class Store:
    """The trees this host received, by digest, under `<sandbox root>/shipped/`."""

    def __init__(self, root: Path):
        self.root = root / "shipped"
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._incoming: dict[str, tuple[Path, object]] = {}

    def path(self, digest: str) -> Path:
        return self.root / digest

    def have(self, digest: str) -> bool:
        return (self.path(digest) / "tree").is_dir()

    def begin(self, digest: str) -> None:
        if not all(c in "0123456789abcdef" for c in digest) or len(digest) != 64:
            raise ShippingError(f"not a digest: {digest[:80]!r}")
        with self._lock:
            part = self.root / f".{digest}.{os.getpid()}.part"
            self._incoming[digest] = (part, open(part, "wb"))

    def chunk(self, digest: str, data: bytes) -> None:
        with self._lock:
            self._incoming[digest][1].write(data)

    def receive(self, digest: str, relocate_from: str | None) -> None:
        """The archive is whole: checked against its digest, then unpacked (atomically) into `<digest>/tree`; an
        environment's scripts made to name their new place instead of `relocate_from`."""
        with self._lock:
            part, handle = self._incoming.pop(digest)
        handle.close()
        try:
            sha = hashlib.sha256()
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    sha.update(block)
            if sha.hexdigest() != digest:
                raise ShippingError(f"the archive announced as {digest[:12]} has the digest {sha.hexdigest()[:12]}")
            staging = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=self.root))
            try:
                with tarfile.open(part) as archive:
                    archive.extractall(staging / "tree", filter=_keep_modes)
                if relocate_from:
                    _relocate(staging / "tree", relocate_from, str(self.path(digest) / "tree"))
                os.chmod(staging, 0o755)
                try:
                    os.rename(staging, self.path(digest))
                except OSError:
                    if not self.have(digest):
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        finally:
            part.unlink(missing_ok=True)

    def episode_base(self, digest: str) -> Path:
        """The grading base's copy every uid may write (0666/0777: every command runs as another uid), made once."""
        target = self.path(digest) / "episode"
        if not target.is_dir():
            staging = Path(tempfile.mkdtemp(prefix=".episode-", dir=self.path(digest)))
            shutil.copytree(self.path(digest) / "tree", staging, symlinks=True, dirs_exist_ok=True)
            _chmod_tree(staging, 0o666, 0o777)
            try:
                os.rename(staging, target)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
        return target


def _link_refused(member: tarfile.TarInfo) -> bool:
    """A symlink that leaves its tree: a relative target climbing out of it, or an absolute one other than a virtual
    environment's interpreter links (`bin/python*`, which name the host's interpreter at its own path)."""
    if member.linkname.startswith("/"):
        parts = PurePosixPath(member.name).parts
        return not (len(parts) == 2 and parts[0] == "bin" and parts[1].startswith("python"))
    return os.path.normpath(os.path.join(os.path.dirname(member.name), member.linkname)).startswith("..")


def _keep_modes(member: tarfile.TarInfo, destination: str) -> tarfile.TarInfo:
    """tarfile's `tar` filter (nothing outside the destination), no hard link, device or special file, no symlink
    leaving the tree (`_link_refused`), with the permission bits kept: a task's changed files and an episode base must
    stay writable by every uid."""
    if member.islnk() or not (member.isreg() or member.isdir() or member.issym()):
        raise tarfile.SpecialFileError(member)
    if member.issym() and _link_refused(member):
        raise tarfile.LinkOutsideDestinationError(member, member.linkname)
    return tarfile.tar_filter(member, destination).replace(mode=member.mode & 0o777, deep=False)


def _relocate(venv: Path, old: str, new: str) -> None:
    """Never through a symlink: a `bin` that is one is left alone (and the archive refused it already)."""
    if (venv / "bin").is_symlink() or not (venv / "bin").is_dir():
        return
    for script in (venv / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        head = script.read_bytes()[:2]
        if head == b"#!":
            text = script.read_bytes()
            if old.encode() in text.split(b"\n", 1)[0]:
                script.write_bytes(text.replace(old.encode(), new.encode(), 1))


@dataclass(frozen=True)
class ShippedTrees:
    """The trees a test run on a host needs, by digest: the project's grading base and environment."""

    project: str
    ready_made: bool
    """The project is installed with the host's composer (hide every copy of it there)."""
    grading: str
    environment: str = ""
    """The digest of the project's virtual environment ("" for a ready-made project)."""
    prefixes: tuple[str, ...] = ()
    """The interpreter's installation the environment was made from (the same path on every host)."""


@dataclass(frozen=True)
class ShippedTask:
    """A repository task as a host opens it: its tests as they are, its trees and changed files by digest."""

    tests: RepoTestPlan
    trees: ShippedTrees
    layer: str
    reward: str = "fraction"


@dataclass(frozen=True)
class ShippedTests:
    """A build's test run over a shipped grading base: guarded, with `changes` in pytest's process (a survey's, a
    validation's of the task's own change), or, when `scope` names the task's functions, across the grading boundary
    with `changes` in the episode's process (`run_tests_across`)."""

    trees: ShippedTrees
    packages: tuple[str, ...]
    changes: tuple[tuple[str, str], ...]
    test_files: tuple[str, ...]
    pytest_args: tuple[str, ...]
    timeout_s: float
    scope: tuple[Scope, ...] = ()


WIRE_TYPES = {**SANDBOX_TYPES, **wire_types(ShippedTask, ShippedTrees, ShippedTests, RepoTestPlan, Scope, TestReport)}
"""What crosses between the driver and a host's server: runs, and repository workspaces and test runs."""


class WorkspaceService:
    """The workspaces open on this host, by number (the driver's episodes)."""

    def __init__(self, sandbox: Sandbox, store: Store):
        self.sandbox, self.store = sandbox, store
        self._open: dict[int, RepoWorkspace] = {}
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    def _environment(self, trees: ShippedTrees, *digests: str) -> RunEnvironment | None:
        missing = [d for d in (trees.grading, *digests, trees.environment) if d and not self.store.have(d)]
        if missing:
            raise ShippingError(f"not shipped here: {', '.join(d[:12] for d in missing)}")
        if not trees.environment:
            return None
        venv = self.store.path(trees.environment) / "tree"
        return RunEnvironment(path=(str(venv / "bin"),), read_only=(str(venv), *trees.prefixes))

    def _hidden(self, trees: ShippedTrees) -> tuple[str, ...]:
        return installed_copies(trees.project) if trees.ready_made else ()

    def test(self, job: ShippedTests) -> TestReport:
        """A build's test run here (`run_tests_guarded` or `run_tests_across`, as the driver would run it)."""
        environment = self._environment(job.trees)
        changes = {p: t.encode() for p, t in job.changes}
        if job.scope:
            tests = RepoTests(
                packages=job.packages,
                test_files=job.test_files,
                fail_to_pass=(),
                pass_to_pass=(),
                pytest_args=job.pytest_args,
                timeout_s=job.timeout_s,
                scope=job.scope,
                layer=Path(),
                episode_base=Path(),
                grading_base=self.store.path(job.trees.grading) / "tree",
                hidden=self._hidden(job.trees),
                environment=environment,
            )
            return run_tests_across(self.sandbox, tests, changes, views_area(self.sandbox.root))
        return run_tests_guarded(
            self.sandbox,
            self.store.path(job.trees.grading) / "tree",
            changes,
            job.test_files,
            job.pytest_args,
            job.timeout_s,
            self._hidden(job.trees),
            views_area(self.sandbox.root),
            packages_environment(environment, job.packages, "repo"),
        )

    def open(self, task: ShippedTask) -> int:
        environment = self._environment(task.trees, task.layer)
        tests = RepoTests.of_plan(
            task.tests,
            layer=self.store.path(task.layer) / "tree",
            episode_base=self.store.episode_base(task.trees.grading),
            grading_base=self.store.path(task.trees.grading) / "tree",
            hidden=self._hidden(task.trees),
            environment=environment,
        )
        workspace = RepoWorkspace(tests, self.sandbox, self.sandbox.root / "workspaces", task.reward)
        with self._lock:
            number = next(self._numbers)
            self._open[number] = workspace
        return number

    def call(self, number: int, name: str, arguments: dict) -> object:
        """One operation on an open workspace: shell, run_tests, read, write, grade, close."""
        with self._lock:
            workspace = self._open.get(number) if name != "close" else self._open.pop(number, None)
        if workspace is None:
            raise KeyError(f"no open workspace {number}")
        if name == "shell":
            return workspace.shell(str(arguments["command"]), float(arguments["timeout_s"]))
        if name == "run_tests":
            return workspace.run_tests()
        if name == "grade":
            return workspace.grade()
        if name == "close":
            workspace.close()
            return None
        try:
            if name == "read":
                return {"text": workspace.read_file(str(arguments["path"]))}
            if name == "write":
                workspace.write_file(str(arguments["path"]), str(arguments["text"]))
                return {}
        except (PathRefused, FileNotFoundError) as e:
            return {"refused": str(e), "missing": isinstance(e, FileNotFoundError)}
        except OSError as e:
            return {"refused": e.strerror or str(e), "missing": False}
        raise KeyError(f"not a workspace operation: {name}")

    def close(self) -> None:
        with self._lock:
            workspaces, self._open = list(self._open.values()), {}
        for workspace in workspaces:
            workspace.close()
