"""Bounded writes: a program, a tool command and an episode's workspace that write until refused are stopped at their
caps (`env.sandbox.max_write_mb`/`max_inodes` per run, `workspace_max_write_mb`/`workspace_max_inodes` per workspace),
flagged `write_limit`, and leave the host as it was (no file left, the next run unflagged)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.results import ScriptRun
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.workspace import RepoTests, RepoWorkspace

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="write caps are sized tmpfs mounts, made as root")

CAPS = SandboxSection(max_write_mb=16, max_inodes=300, workspace_max_write_mb=24, workspace_max_inodes=400, max_file_mb=4)
FILL_BYTES = """
import os
written = 0
try:
    for i in range(1000):
        with open(f"{where}/fill-{{i}}", "wb") as f:
            f.write(b"x" * (4 << 20))
        written += 4
except OSError as e:
    print("refused after", written, "MB:", os.strerror(e.errno))
"""
FILL_FILES = "i=0; while dd if=/dev/zero of=big$i bs=1M count=3 status=none 2>&1; do i=$((i+1)); done; echo stopped after $i"
"""3 MB files (max_file_mb is 4) until refused."""
FILL_INODES = "i=0; while touch f$i 2>/dev/null; do i=$((i+1)); done; echo refused after $i files"


@pytest.fixture
def sandbox(tmp_path) -> Sandbox:
    return Sandbox(CAPS, root=tmp_path / "sandboxes")


def host_bytes_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("where", ["/tmp", "/sandbox"])
def test_a_program_that_writes_until_refused_is_stopped_at_the_cap_and_flagged(sandbox, tmp_path, where):
    free = host_bytes_free(tmp_path)
    result = sandbox.run(FILL_BYTES.format(where=where), ScriptRun())
    assert "refused after 16 MB: No space left on device" in result.stdout_tail, result.stdout_tail + result.stderr_tail
    assert result.flags == ("write_limit",) and not result.infra_failure
    assert abs(host_bytes_free(tmp_path) - free) < 8 << 20  # nothing of it reached the host's disk
    assert list(sandbox.root.iterdir()) == []  # the run's directory is gone
    calm = sandbox.run("print('hello')\n", ScriptRun())
    assert (calm.stdout_tail, calm.flags) == ("hello\n", ())


def test_a_tool_command_that_fills_its_tmp_or_its_inodes_is_flagged(sandbox, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    filled = sandbox.run_command(f"cd /tmp && {FILL_FILES}", work)
    assert "No space left on device" in filled.output and filled.flags == ("write_limit",), filled.output
    inodes = sandbox.run_command(f"cd /tmp && {FILL_INODES}", work)
    assert inodes.flags == ("write_limit",) and int(inodes.output.split()[2]) < CAPS.max_inodes, inodes.output
    calm = sandbox.run_command("echo fine > /tmp/x && cat /tmp/x", work)
    assert (calm.output, calm.flags, calm.exit_code) == ("fine\n", (), 0)


def test_a_workspace_holds_at_most_its_cap(sandbox, tmp_path):
    base, layer = tmp_path / "base", tmp_path / "layer"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg" / "mod.py").write_text("x = 1\n")
    layer.mkdir()
    shutil.copytree(base, tmp_path / "episode")
    for path in [tmp_path / "episode", *(tmp_path / "episode").rglob("*")]:
        os.chmod(path, 0o777 if path.is_dir() else 0o666)
    tests = RepoTests(
        packages=("pkg",),
        test_files=(),
        fail_to_pass=(),
        pass_to_pass=(),
        pytest_args=(),
        layer=layer,
        episode_base=tmp_path / "episode",
        grading_base=base,
        hidden=(),
        timeout_s=30,
    )
    free = host_bytes_free(tmp_path)
    with RepoWorkspace(tests, sandbox, tmp_path / "workspaces") as ws:
        big = ws.shell(f"cd pkg && {FILL_FILES}", 30)
        assert "No space left on device" in big.output and big.flags == ("write_limit",), big.output
        assert abs(host_bytes_free(tmp_path) - free) < 8 << 20
        ws.shell("rm pkg/big*", 30)
        assert ws.shell("echo 2 > pkg/two.txt", 30).flags == ()
        many = ws.shell(f"mkdir -p pkg/many && cd pkg/many && {FILL_INODES}", 60)
        assert many.flags == ("write_limit",) and int(many.output.split()[2]) < CAPS.workspace_max_inodes, many.output
        assert (ws.root / "pkg" / "mod.py").read_text() == "x = 1\n"  # the task's own files are still there
    assert not os.path.ismount(ws.root) and not ws.root.exists()
