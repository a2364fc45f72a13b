"""The kernel's surface a run reaches (#44, #37): the seccomp filter in every kind of run (a function script, a tool
command, pytest under guarded grading), no nested namespaces, a run's own IPC namespace and session keyring: what a
run makes there is gone with it and never seen by the next run; an honest program in the same sandbox still passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.results import ScriptRun
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.workspace import run_tests_guarded
from tests.helpers.toy_package import toy_package

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs get their namespaces and uids as root")

PROBE = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
NR = {"io_uring_setup": 425, "perf_event_open": 298, "bpf": 321, "userfaultfd": 323, "keyctl": 250,
      "add_key": 248, "unshare": 272, "setns": 308, "mount": 165, "ptrace": 101, "kexec_load": 246,
      "init_module": 175, "clock_settime": 227, "personality": 135, "open_by_handle_at": 304, "pivot_root": 155,
      "swapon": 167, "reboot": 169, "sethostname": 170, "syslog": 103}
ARGS = {"add_key": (b"user", b"k", b"v", 1, -3), "unshare": (0x10000000,), "personality": (0x0040000,),
        "io_uring_setup": (1, ctypes.create_string_buffer(120)), "syslog": (3, ctypes.create_string_buffer(64), 64)}
refused = []
for name, nr in NR.items():
    if libc.syscall(nr, *ARGS.get(name, (0, 0, 0, 0, 0))) == -1 and ctypes.get_errno() == errno.EPERM:
        refused.append(name)
seccomp = [line.split()[1] for line in open("/proc/self/status") if line.startswith("Seccomp:")][0]
print("seccomp", seccomp, "refused", len(refused), "of", len(NR), sorted(set(NR) - set(refused)))
"""
ALL_REFUSED = "seccomp 2 refused 20 of 20 []"

PLANT_IPC = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(0x5EC, 1 << 20, 0o1666)  # IPC_CREAT | 0666
msg = libc.msgget(0x5ED, 0o1666)
libc.mq_open.restype = ctypes.c_int
mq = libc.mq_open(b"/planted", os.O_CREAT | os.O_RDWR, 0o666, None)
print("planted", shm >= 0, msg >= 0, mq >= 0)
"""
FIND_IPC = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print("found", libc.shmget(0x5EC, 0, 0) >= 0, libc.msgget(0x5ED, 0) >= 0, libc.mq_open(b"/planted", os.O_RDWR) >= 0)
"""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Sandbox:
    return Sandbox(SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048), root=tmp_path_factory.mktemp("sandboxes"))


def test_the_filter_refuses_the_kernels_surface_in_a_function_script(sandbox):
    result = sandbox.run(PROBE, ScriptRun())
    assert result.stdout_tail.startswith(ALL_REFUSED), result.stdout_tail + result.stderr_tail
    honest = sandbox.run(
        "import threading, subprocess\nt = threading.Thread(target=print, args=('ok',))\nt.start(); t.join()\n", ScriptRun()
    )
    assert (honest.stdout_tail, honest.flags) == ("ok\n", ())


def test_the_filter_holds_in_tool_commands_and_what_they_start(sandbox, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    os.chmod(tmp_path, 0o777)
    result = sandbox.run_command(
        "python probe.py; unshare -Ur true; echo unshare $?; "
        "python -c 'import os; pid = os.fork(); pid or os._exit(7); print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))'",
        tmp_path,
    )
    assert result.output.startswith(ALL_REFUSED), result.output
    assert "unshare 1" in result.output and result.output.endswith("\n7\n"), result.output


def test_ipc_objects_end_with_their_run(sandbox, tmp_path):
    planted = sandbox.run(PLANT_IPC + FIND_IPC, ScriptRun())
    assert "planted True True True\nfound True True True" in planted.stdout_tail, planted.stdout_tail + planted.stderr_tail
    later = sandbox.run(FIND_IPC, ScriptRun())
    assert later.stdout_tail == "found False False False\n", later.stdout_tail + later.stderr_tail
    on_host = Path("/proc/sysvipc/shm").read_text() + Path("/proc/sysvipc/msg").read_text()
    assert not any(line.split()[0] in {str(0x5EC), str(0x5ED)} for line in on_host.splitlines()[1:])


def test_a_run_cannot_reach_any_keyring(sandbox):
    keys = sandbox.run(
        "print(open('/proc/self/status').read().count('Seccomp:\\t2'))\nimport ctypes\nprint(ctypes.CDLL(None).syscall(250, 0, -3, 0))\n",
        ScriptRun(),
    )  # KEYCTL_GET_KEYRING_ID
    assert keys.stdout_tail == "1\n-1\n", keys.stdout_tail + keys.stderr_tail


CORE = "def double(x):\n    return x + x + 1\n"
TESTS = f"""from toy.core import double

PROBE = {PROBE!r}


def test_double():
    assert double(2) == 4


def test_the_filter_is_on_under_grading(capsys):
    exec(PROBE, {{}})
    assert capsys.readouterr().out.startswith({ALL_REFUSED!r})
"""


def test_the_filter_is_on_in_pytest_under_guarded_grading(sandbox, tmp_path):
    root = toy_package(tmp_path / "toy", CORE, {"test_core.py": TESTS})
    fix = {"toy/core.py": b"def double(x):\n    return x + x\n"}
    report = run_tests_guarded(sandbox, root, fix, ("toy/tests/test_core.py",), (), 60, (), tmp_path / "views")
    assert report.complete and set(report.outcomes.values()) == {"passed"} and len(report.outcomes) == 2, report.output


FLOOD = """
import os, time
for fd in map(int, os.listdir("/proc/self/fd")):
    if fd > 2:
        try:
            os.write(fd, b"x" * {first})
            time.sleep({pause})
            while True:
                os.write(fd, b"x" * (1 << 20))
        except OSError:
            pass
"""


@pytest.mark.parametrize("first, pause", [(1 << 20, 0), (10, 30)], ids=["too-long", "too-slow"])
def test_a_reply_record_that_never_ends_stops_the_run(sandbox, first, pause):
    result = sandbox.run(FLOOD.format(first=first, pause=pause), ScriptRun())
    assert "output_limit" in result.flags and result.status == "crash" and not result.infra_failure, result
    assert result.wall_seconds < 25
    honest = sandbox.run("print(sum(range(10)))\n", ScriptRun())
    assert (honest.stdout_tail, honest.flags) == ("45\n", ())


ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31mred\r\x08\x00\x9b\u202eevil"


def test_what_a_run_prints_reaches_a_person_as_visible_escapes(sandbox, tmp_path):
    script = sandbox.run(f"import sys\nprint({ESCAPES!r})\nprint({ESCAPES!r}, file=sys.stderr)\n", ScriptRun())
    command = sandbox.run_command("printf '%b' '" + ESCAPES.encode("unicode_escape").decode() + "'", tmp_path)
    for text in (script.stdout_tail, script.stderr_tail, command.output):
        assert "\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mred\\x0d\\x08\\x00" in text, text
        assert not any(ord(c) < 32 and c not in "\n\t" or 0x7F <= ord(c) <= 0x9F or c == "\u202e" for c in text), text
