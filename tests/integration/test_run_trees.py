"""Trees an episode makes in its workspace that once broke the host side (#37, #44): a 1,200-deep tree and 22 nested
255-character names (paths past PATH_MAX). Grading walks them iteratively and bounded: what is over the bounds is
dropped and named (`change_dropped`), the host side raises nothing, an honest fix in the same workspace still gets
1.0, and closing the workspace leaves nothing on the host. Shipping: what an environment or workspace must not carry
(links out of its tree, hard links, devices, special files) is refused by the sender and by the unpack filter, and
relocation never follows a symlink."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tarfile
from pathlib import Path

import pytest

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.grading_policy import Scope
from composer.rollout.tasks.repository.workspace import RepoTests, RepoWorkspace

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="workspaces are views mounted as root")

TESTS = "from toy.core import double\n\n\ndef test_double():\n    assert double(2) == 4\n"
DEEP = 'python -c \'import os\nfor _ in range({depth}): os.mkdir("{name}"); os.chdir("{name}")\nopen("x.py", "w").write("1")\''


def toy(tmp_path: Path) -> RepoTests:
    base, layer = tmp_path / "base", tmp_path / "layer"
    (base / "toy" / "tests").mkdir(parents=True)
    (base / "toy" / "__init__.py").write_text("")
    (base / "toy" / "core.py").write_text("def double(x):\n    return x + x + 1\n")
    (base / "toy" / "tests" / "__init__.py").write_text("")
    (base / "toy" / "tests" / "test_core.py").write_text(TESTS)
    for path in [base, *base.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    layer.mkdir()
    shutil.copytree(base, tmp_path / "episode")
    for path in [tmp_path / "episode", *(tmp_path / "episode").rglob("*")]:
        os.chmod(path, 0o777 if path.is_dir() else 0o666)
    return RepoTests(
        packages=("toy",),
        test_files=("toy/tests/test_core.py",),
        fail_to_pass=("toy/tests/test_core.py::test_double",),
        pass_to_pass=(),
        pytest_args=(),
        layer=layer,
        episode_base=tmp_path / "episode",
        grading_base=base,
        hidden=(),
        timeout_s=60,
        scope=(Scope("toy/core.py", ("double",)),),
    )


@pytest.mark.parametrize("depth, name", [(1200, "d"), (22, "n" * 255)], ids=["1200-deep", "past-PATH_MAX"])
def test_a_deep_tree_in_a_workspace_is_dropped_and_an_honest_fix_still_passes(tmp_path, depth, name):
    sandbox = Sandbox(SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048), root=tmp_path / "sandboxes")
    with RepoWorkspace(toy(tmp_path), sandbox, tmp_path / "workspaces") as ws:
        made = ws.shell("cd toy && " + DEEP.format(depth=depth, name=name), 60)
        assert made.exit_code == 0, made.output
        ws.shell("printf 'def double(x):\\n    return x + x\\n' > toy/core.py", 30)
        result = ws.grade()
        assert result.reward == 1.0 and not result.infra_failure, result.detail
        assert "change_dropped" in result.flags and f"toy/{name}/" in " ".join(result.flag_details), result.flag_details
    assert not ws.root.exists() and list((tmp_path / "workspaces").iterdir()) == []


# --- shipping: no link out of a tree, no hard link, no device or special file ----------------------


def ship(store, tree: Path, relocate_from: str | None = None):
    from composer.rollout.tasks.repository.shipping import pack

    pack.cache_clear()
    digest, archive = pack(tree)
    store.begin(digest)
    store.chunk(digest, archive.read_bytes())
    store.receive(digest, relocate_from)
    return store.path(digest) / "tree"


def raw_archive(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes]) -> tuple[str, bytes]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data else None)
    return hashlib.sha256(buffer.getvalue()).hexdigest(), buffer.getvalue()


@pytest.mark.parametrize("planted", ["bin-to-outside", "link-to-etc", "link-climbing-out", "device", "fifo"])
def test_an_environment_holding_what_must_not_cross_is_refused_by_the_sender(tmp_path, planted):
    from composer.rollout.tasks.repository.shipping import ShippingError

    outside = tmp_path / "outside"
    outside.mkdir()
    env = tmp_path / "env"
    (env / "lib").mkdir(parents=True)
    if planted == "bin-to-outside":
        (env / "bin").symlink_to(outside)
    elif planted == "link-to-etc":
        (env / "lib" / "etc").symlink_to("/etc")
    elif planted == "link-climbing-out":
        (env / "lib" / "up").symlink_to("../../../../..")
    elif planted == "device":
        os.mknod(env / "lib" / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    else:
        os.mkfifo(env / "lib" / "fifo")
    from composer.rollout.tasks.repository.shipping import pack

    with pytest.raises(ShippingError):
        pack(env)


def test_hard_links_ship_as_files_and_relocation_never_follows_a_symlink(tmp_path):
    from composer.rollout.tasks.repository.shipping import Store

    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "tool").write_text(f"#!{env}/bin/python\n")
    (env / "bin" / "python").symlink_to("/usr/bin/python3")  # a venv's interpreter link: allowed
    (env / "lib").mkdir()
    (env / "lib" / "a").write_text("shared")
    os.link(env / "lib" / "a", env / "lib" / "b")
    tree = ship(Store(tmp_path / "host"), env, relocate_from=str(env))
    assert (tree / "lib" / "b").read_text() == "shared" and (tree / "lib" / "a").stat().st_ino != (tree / "lib" / "b").stat().st_ino
    assert (tree / "bin" / "tool").read_text() == f"#!{tree}/bin/python\n"


@pytest.mark.parametrize("kind", ["hard-link-to-host-file", "device", "symlink-climbing-out", "symlink-absolute"])
def test_the_unpack_filter_refuses_what_a_sender_should_not_send(tmp_path, kind):
    from composer.rollout.tasks.repository.shipping import Store

    victim = tmp_path / "victim"
    victim.write_text("host file")
    os.chmod(victim, 0o600)
    info = tarfile.TarInfo("x")
    if kind == "hard-link-to-host-file":
        info.type, info.linkname = tarfile.LNKTYPE, str(victim)
    elif kind == "device":
        info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    elif kind == "symlink-climbing-out":
        info.type, info.linkname = tarfile.SYMTYPE, "../../../../.."
    else:
        info.type, info.linkname = tarfile.SYMTYPE, "/etc"
    digest, data = raw_archive(tmp_path, (info, b""))
    store = Store(tmp_path / "host")
    store.begin(digest)
    store.chunk(digest, data)
    with pytest.raises(tarfile.FilterError):
        store.receive(digest, None)
    assert not store.have(digest) and [p for p in store.root.iterdir() if not p.name.startswith(".")] == []
    assert victim.read_text() == "host file" and stat.S_IMODE(victim.stat().st_mode) == 0o600


FILL_TEST = """
def test_fills_the_grading_directory():
    written = 0
    try:
        with open("/sandbox/big", "wb") as f:
            for _ in range(100):
                f.write(b"x" * (1 << 20))
                f.flush()
                written += 1
    except OSError:
        pass
    assert written < 100


def test_the_grading_directory_is_the_runs_own():
    import os, stat
    st = os.stat("/sandbox")
    assert st.st_uid == os.getuid() != 0 and stat.S_IMODE(st.st_mode) == 0o700
"""


def test_grading_writes_go_to_a_capped_tmpfs_removed_after(tmp_path):
    from composer.rollout.tasks.repository.workspace import run_tests_guarded

    tests = toy(tmp_path)
    (tests.grading_base / "toy" / "tests" / "test_fill.py").write_text(FILL_TEST)
    os.chmod(tests.grading_base / "toy" / "tests" / "test_fill.py", 0o644)
    sandbox = Sandbox(SandboxSection(cpu_seconds=60, wall_seconds=120, max_write_mb=16, max_inodes=500), root=tmp_path / "sandboxes")
    free = shutil.disk_usage(tmp_path).free
    report = run_tests_guarded(sandbox, tests.grading_base, {}, ("toy/tests/test_fill.py",), (), 60, (), tmp_path / "views")
    assert report.complete and "write_limit" in report.flags, report.output
    assert report.outcomes["toy/tests/test_fill.py::test_the_grading_directory_is_the_runs_own"] == "passed", report.output
    assert abs(shutil.disk_usage(tmp_path).free - free) < 8 << 20 and list((tmp_path / "views").iterdir()) == []


def test_what_a_killed_process_left_mounted_is_reclaimed_by_the_next(tmp_path):
    import subprocess

    from composer.rollout.tasks.workspace import mount_capped, reclaim, unmount

    area = tmp_path / "workspaces"
    gone = subprocess.Popen(["true"])
    gone.wait()
    left, live = area / f"ws-{gone.pid}-abc", area / f"ws-{os.getppid()}-def"
    for d in (left, live):
        (d / "root").mkdir(parents=True)
        mount_capped(d, 1 << 20, 100)
        (d / "root").mkdir()
        mount_capped(d / "root", 1 << 20, 100)
    try:
        reclaim(area)
        mounts = Path("/proc/self/mountinfo").read_text()
        assert not left.exists() and str(left) not in mounts
        assert os.path.ismount(live) and os.path.ismount(live / "root")  # a live process's workspace is left alone
    finally:
        for target in (live / "root", live, left / "root", left):
            if os.path.ismount(target):
                unmount(target)


HOLDER = """
import os, sys, time
from pathlib import Path
from composer.rollout.tasks.workspace import mount_capped, owned_dir, views_area
root = Path(sys.argv[1])
views = views_area(root)  # what grading makes: a views area of this process, a capped tmpfs per grade
grade = owned_dir("grade-", (views.mkdir(parents=True), views)[1])
mount_capped(grade, 1 << 20, 100)
(grade / "repo").mkdir()
mount_capped(grade / "repo", 1 << 20, 100)
workspaces = root / "workspaces"  # and a function task's workspace
workspaces.mkdir()
solution = owned_dir("solution-", workspaces)
mount_capped(solution, 1 << 20, 100)
print(views, solution, flush=True)
time.sleep(600)
"""


def test_a_driver_killed_with_9_leaves_mounts_the_next_process_reclaims(tmp_path):
    import signal
    import subprocess
    import sys

    from composer.rollout.tasks.workspace import reclaim, views_area

    root = tmp_path / "sandbox"
    root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    views, solution = map(Path, holder.stdout.readline().split())
    assert os.path.ismount(solution) and len([p for p in views.iterdir() if os.path.ismount(p)]) == 1
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    mine = views_area(root)
    reclaim(root / "workspaces")
    mounts = Path("/proc/self/mountinfo").read_text()
    assert not views.exists() and not solution.exists() and str(root) not in mounts
    assert mine.name == f"views-{os.getpid()}-{mine.name.split('-')[2]}" and not mine.exists()
