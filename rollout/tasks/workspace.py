"""Workspaces: an episode's writable files and the sandboxed commands that act on them.

A `Workspace` is what the agent harness works with, whatever the task: the one-file workspace of function tasks
(HumanEval, CodeI/O, smoke) or a repository task's copy-on-write view of its project
(`rollout.tasks.repository.workspace.RepoWorkspace`). The mounts here (tmpfs caps, overlayfs views) serve both.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from functools import cache
from pathlib import Path

from composer.rollout.sandbox.results import CommandResult, SandboxResult
from composer.rollout.sandbox.trees import remove_tree
from composer.rollout.tasks.files import read_text, write_text

log = logging.getLogger("composer.workspace")


class Workspace(ABC):
    """An episode's files and the sandbox that acts on them (the agent's tools and the grader use only this)."""

    root: Path
    """The episode's writable view of the task's files, on the host that holds it (at /sandbox inside the sandbox)."""

    def read_file(self, path: str) -> str:
        """The text of a file of the workspace (`rollout.tasks.files.read_text`: nothing outside it)."""
        return read_text(self.root, path)

    def write_file(self, path: str, text: str) -> None:
        """Create or replace a file of the workspace (`rollout.tasks.files.write_text`)."""
        write_text(self.root, path, text)

    @abstractmethod
    def shell(self, command: str, timeout_s: float) -> CommandResult:
        """Run `command` in the sandbox, in `root`."""

    @abstractmethod
    def run_tests(self) -> CommandResult:
        """The agent-visible test run (what "run the tests" shows)."""

    @abstractmethod
    def grade(self) -> SandboxResult:
        """The trusted, guarded grade of the final state (reward, flags)."""

    @abstractmethod
    def close(self) -> None:
        """Destroy the view and everything the episode started."""


# --- mounts ------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY = 1
MNT_DETACH = 2


@cache
def overlay_supported(area: Path) -> bool:
    """Whether overlayfs views can be mounted in `area` (root, a kernel with overlayfs, a fitting filesystem)."""
    if os.geteuid() != 0:
        return False
    probe = Path(tempfile.mkdtemp(prefix="overlay-probe-", dir=area))
    try:
        for name in ("lower", "upper", "work", "merged"):
            (probe / name).mkdir()
        mount_overlay(probe / "merged", [probe / "lower"], probe / "upper", probe / "work")
        unmount(probe / "merged")
        return True
    except OSError as e:
        log.warning("workspace: overlayfs is not available in %s (%s); episodes get plain copies", area, e)
        return False
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def mount_overlay(target: Path, lowers: list[Path], upper: Path | None = None, work: Path | None = None) -> None:
    """An overlayfs at `target`: `lowers` top first; read-only when there is no `upper`."""
    options = "lowerdir=" + ":".join(str(p) for p in lowers)
    if upper is not None:
        options += f",upperdir={upper},workdir={work}"
    flags = 0 if upper is not None else MS_RDONLY
    if _libc.mount(b"overlay", str(target).encode(), b"overlay", flags, options.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount overlay on {target}: {os.strerror(code)}")


def mount_capped(target: Path, max_bytes: int, max_inodes: int) -> None:
    """A tmpfs of `max_bytes` and `max_inodes` at `target` (an episode's files beyond its task's: writes past
    the cap are refused by the kernel, and the host's disk and memory are never at the episode's mercy)."""
    options = f"mode=0755,size={max_bytes},nr_inodes={max_inodes}".encode()
    if _libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", 0, options) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount tmpfs on {target}: {os.strerror(code)}")


def is_full(target: Path) -> bool:
    """The filesystem at `target` has (almost) no room or no inode left."""
    st = os.statvfs(target)
    return st.f_bavail * st.f_frsize < 64 << 10 or st.f_favail == 0


def unmount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), 0) != 0:
        code = ctypes.get_errno()
        if code == errno.EINVAL:  # not a mount point (any more)
            return
        if _libc.umount2(str(target).encode(), MNT_DETACH) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"unmount {target}: {os.strerror(code)}")


def owned_dir(prefix: str, area: Path) -> Path:
    """A fresh directory in `area` named after this process (`reclaim` tells a dead process's leftovers by it)."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=area))


_reclaimed: set[Path] = set()


def process_start(pid: int | str) -> str | None:
    """A live process's start time (ticks since boot), None when it is gone or a zombie (pids are reused)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _release(top: Path) -> None:
    """Detach every mount at or below `top` (deepest first: tmpfs caps, overlay views) and remove the tree."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    prefix = str(top)
    for point in sorted((p for p in points if p == prefix or p.startswith(prefix + "/")), key=len, reverse=True):
        _libc.umount2(point.encode(), MNT_DETACH)
    remove_tree(top)
    log.info("workspace: reclaimed %s, left by a process that is gone", top)


def reclaim(area: Path, prefixes: tuple[str, ...] = ("ws-", "grade-", "solution-")) -> None:
    """What a killed process left in `area` (once per area and process): the mounts (tmpfs caps, overlay views) below
    its directories detached, the directories removed. Only directories whose owner (the pid in their name) is gone:
    another live process's workspaces are left alone."""
    area = area.resolve()
    if area in _reclaimed or not area.is_dir():
        return
    _reclaimed.add(area)

    def dead(name: str) -> bool:
        for prefix in prefixes:
            owner = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
            if owner.isdigit() and int(owner) != os.getpid() and not os.path.exists(f"/proc/{owner}"):
                return True
        return False

    for entry in os.scandir(area):
        if entry.is_dir(follow_symlinks=False) and dead(entry.name):
            _release(area / entry.name)


def views_area(root: Path) -> Path:
    """This process's area for grading views under a sandbox root, named by its pid and start time (pids are reused).
    The first call in a process reclaims every area whose process is gone (a driver or build worker killed with -9
    leaves its views and their tmpfs mounted)."""
    root = root.resolve()
    if (root / "views-") not in _reclaimed and root.is_dir():
        _reclaimed.add(root / "views-")
        for entry in os.scandir(root):
            pid, _, start = entry.name.removeprefix("views-").partition("-")
            if entry.name.startswith("views-") and entry.is_dir(follow_symlinks=False) and process_start(pid) != start:
                _release(root / entry.name)
    return root / f"views-{os.getpid()}-{process_start(os.getpid())}"
