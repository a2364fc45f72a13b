"""One control group per sandboxed run (as root, where the host has the memory and CPU controllers): every memory the
run holds (its processes, memfds, its tmpfs and /dev/shm pages, SysV segments, the page cache of its writes) is
charged against one limit, and the CPU time of all its processes is counted together.

cgroup v2 where `/sys/fs/cgroup` is unified with the memory and cpu controllers (limit `memory.max`, hit:
`memory.events` oom_kill; CPU `cpu.stat` usage_usec), else cgroup v1's `memory` and `cpuacct` hierarchies (limit
`memory.limit_in_bytes`, hit: `memory.oom_control` oom_kill; CPU `cpuacct.usage`). Where neither exists (not root,
or a host without them) `RunCgroup.create` returns None, logged once: memory is then bounded per process only
(RLIMIT_AS, the tmpfs caps) and CPU per process (RLIMIT_CPU), as before.

The holder joins the group (`entry`: it writes its pid to each `procs` file before anything else), so everything of
the run is in it; the group is removed after the run, and `reclaim` removes what a killed driver left."""

from __future__ import annotations

import logging
import os
import time
from functools import cache
from pathlib import Path

log = logging.getLogger("composer.sandbox")
ROOT = Path("/sys/fs/cgroup")
PARENT = "composer-sandbox"


@cache
def _layout() -> tuple[str, dict[str, Path]] | None:
    """("v2", {"all": parent}) or ("v1", {"memory": parent, "cpu": parent}), the parents made; None without."""
    if os.geteuid() != 0:
        return None
    try:
        if (ROOT / "cgroup.controllers").exists() and "memory" in (ROOT / "cgroup.controllers").read_text().split():
            parent = ROOT / PARENT
            parent.mkdir(exist_ok=True)
            (ROOT / "cgroup.subtree_control").write_text("+memory +cpu")
            (parent / "cgroup.subtree_control").write_text("+memory +cpu")
            return "v2", {"all": parent}
    except OSError as e:
        log.warning("sandbox: cgroup v2 has no usable memory controller here (%s)", e)
    try:
        if (ROOT / "memory" / "memory.limit_in_bytes").exists() and (ROOT / "cpuacct" / "cpuacct.usage").exists():
            parents = {"memory": ROOT / "memory" / PARENT, "cpu": ROOT / "cpuacct" / PARENT}
            for parent in parents.values():
                parent.mkdir(exist_ok=True)
            return "v1", parents
    except OSError as e:
        log.warning("sandbox: cgroup v1 memory/cpuacct are not usable here (%s)", e)
    log.warning(
        "sandbox: no memory cgroup on this host: a run's memory is capped per process (RLIMIT_AS) and by its tmpfs caps, "
        "its CPU time per process (RLIMIT_CPU)"
    )
    return None


class RunCgroup:
    def __init__(self, version: str, dirs: dict[str, Path]):
        self.version, self.dirs = version, dirs

    @classmethod
    def create(cls, name: str, memory_bytes: int) -> RunCgroup | None:
        """A group named after this process (`reclaim` tells a dead driver's groups by it) and `name`."""
        layout = _layout()
        if layout is None:
            return None
        version, parents = layout
        dirs = {key: parent / f"{os.getpid()}-{name}" for key, parent in parents.items()}
        group = cls(version, dirs)
        try:
            for d in dirs.values():
                d.mkdir()
            if version == "v2":
                (dirs["all"] / "memory.max").write_text(str(memory_bytes))
                if (dirs["all"] / "memory.swap.max").exists():
                    (dirs["all"] / "memory.swap.max").write_text("0")
            else:
                (dirs["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
        except OSError as e:
            log.warning("sandbox: could not make the run's cgroup (%s); it runs with per-process limits only", e)
            group.remove()
            return None
        return group

    @property
    def procs(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def cpu_seconds(self) -> float:
        try:
            if self.version == "v2":
                for line in (self.dirs["all"] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return 0.0
            return int((self.dirs["cpu"] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return 0.0

    def memory_hit(self) -> bool:
        """The kernel killed a process of the run at the limit."""
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            lines = (self.dirs.get("all") or self.dirs["memory"]).joinpath(name).read_text().splitlines()
        except OSError:
            return False
        return any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in lines)

    def remove(self) -> None:
        for d in self.dirs.values():
            _remove_group(d)


def _remove_group(d: Path) -> None:
    for _ in range(400):  # EBUSY until the run's last exiting process has left the group
        try:
            for pid in (d / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)
    log.warning("sandbox: could not remove the run's cgroup %s", d)


@cache
def reclaim() -> None:
    """Groups a driver that is gone (killed) left: their processes killed, the groups removed. Groups of live
    processes (other drivers on the host) are left alone."""
    layout = _layout()
    if layout is None:
        return
    for parent in layout[1].values():
        for d in parent.iterdir():
            owner = d.name.split("-", 1)[0]
            if d.is_dir() and owner.isdigit() and not Path(f"/proc/{owner}").exists():
                _remove_group(d)
