"""One memory limit and one CPU budget per run (#37, #44): memfds and /dev/shm count against the run's memory
limit (the kernel kills at it; flagged `memory_limit`), the CPU time of all the run's processes counts against
`cpu_seconds` (flagged `timeout`), the run's group is gone after it, and an honest run in the same sandbox passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox import cgroups
from composer.rollout.sandbox.results import ScriptRun
from composer.rollout.sandbox.runs import Sandbox

pytestmark = pytest.mark.skipif(cgroups._layout() is None, reason="no memory/cpu cgroup on this host (or not root)")

MEMFDS = """
import os
held = []
for i in range(40):
    fd = os.memfd_create(f"m{i}")
    for _ in range(16):
        os.write(fd, b"x" * (1 << 20))
    held.append(fd)
print("held", len(held) * 16, "MB")
"""
SHM = "import os\nwith open('/dev/shm/big', 'wb') as f:\n    f.write(b'x' * (12 << 20))\nprint('shm ok')\n"
SPIN = """
import os, time
children = []
for _ in range(8):  # 0.5 CPU seconds each: every process far under its own RLIMIT_CPU, 4 s together
    pid = os.fork()
    if pid == 0:
        while time.process_time() < 0.5:
            pass
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
print("all done")
"""


def groups() -> list[str]:
    _, parents = cgroups._layout()
    return sorted(d.name for parent in parents.values() for d in parent.iterdir() if d.name.startswith(f"{os.getpid()}-"))


@pytest.fixture
def sandbox(tmp_path) -> Sandbox:
    return Sandbox(
        SandboxSection(memory_mb=256, max_write_mb=64, workspace_max_write_mb=64, cpu_seconds=2, wall_seconds=120),
        root=tmp_path / "sandboxes",
    )


def test_memfds_count_against_the_runs_memory_limit(sandbox):
    result = sandbox.run(MEMFDS, ScriptRun())
    assert "memory_limit" in result.flags and result.status == "memory" and "held" not in result.stdout_tail, result
    assert groups() == []
    honest = sandbox.run(SHM, ScriptRun())
    assert (honest.stdout_tail, honest.flags) == ("shm ok\n", ())


def test_memfds_in_a_command_count_too(sandbox, tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir(mode=0o777)
    result = sandbox.run_command(f"python -c '{MEMFDS}'", work)
    assert "memory_limit" in result.flags and result.status == "memory", result


def test_cpu_time_of_all_processes_counts_against_one_budget(sandbox):
    result = sandbox.run(SPIN, ScriptRun())
    assert "timeout" in result.flags and result.detail == "CPU-time limit" and "all done" not in result.stdout_tail, result
    assert groups() == []
