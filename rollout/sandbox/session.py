"""A live sandboxed run: the fork server that starts it, and the pipe session the grader holds with it.

A fork server (`zygote`, started once per sandbox root and process) forks a fresh child per run, which isolates
itself (`entry`) and serves requests (`runner`). The session sends requests and reads replies, output and the
exit status under the run's limits; every record on the reply pipe is checked against the request it answers.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.cgroups import RunCgroup
from composer.rollout.sandbox.isolation import WORK_DIR, starved_seconds
from composer.rollout.sandbox.results import CommandResult

log = logging.getLogger("composer.sandbox")

_HERE = Path(__file__).resolve().parent
# Reply bytes beyond this are not results any more.
MAX_RESULT_BYTES = 64 << 20
# One record on the reply pipe: at most this long (an output over 1 MB is refused anyway), and ended (newline)
# within this many seconds of its first byte; else the run is stopped ("results": output_limit), so a record
# without an end costs the host neither memory nor CPU (it is never re-scanned) until the wall-clock limit.
MAX_RECORD_BYTES = 8 << 20
MAX_RECORD_SECONDS = 10.0
# A command's channel line that asks the caller a question (`Session.on_call`).
CALL_PREFIX = b"CALL "
_GRACE_SECONDS = 1.0
_ZYGOTE_START_SECONDS = 60.0


class InfraError(Exception):
    """The sandbox itself failed (not the program)."""


# --- the fork server ---------------------------------------------------------------------------


def sandbox_environment(home: str) -> dict[str, str]:
    # Nothing from the parent's environment: no secrets, no proxies, no PYTHONPATH.
    return {
        # the interpreter's directory as the sandbox's root binds it (a virtual environment reached through a
        # symlink is mounted at its real path)
        "PATH": f"{os.path.realpath(os.path.dirname(sys.executable))}:/usr/bin:/bin",
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


class Zygote:
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
                [sys.executable, "-s", "-P", str(_HERE / "zygote.py"), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=sandbox_environment(str(self._cwd)),
                cwd=self._cwd,
                start_new_session=True,
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
            raise InfraError("the sandbox fork server did not start")
        error = json.loads(ready).get("error")
        if error:
            ours.close()
            raise InfraError(error)
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
            raise InfraError(f"the sandbox fork server failed: {error}")

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


_zygotes: dict[Path, Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote_for(root: Path) -> Zygote:
    """One fork server per sandbox root and process, stopped when the process exits."""
    with _zygotes_lock:
        if root not in _zygotes:
            _zygotes[root] = Zygote(root)
            atexit.register(_zygotes[root].close)
        return _zygotes[root]


# --- one run -----------------------------------------------------------------------------------


class Tail:
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


class Session:
    """A live sandboxed child: send a request, wait for its reply (or the run's end), under the limits.

    Every record on the reply pipe is checked against the request it should answer: anything else is
    flagged `forged_records` and never taken as an answer to a later request."""

    def __init__(self, config: SandboxSection, zygote: Zygote, plan: dict, group: RunCgroup | None = None):
        self.config = config
        self._group = group
        self._cpu_checked = 0.0
        self.memory_hit = False
        self.flags: dict[str, str] = {}
        self.stop = ""
        self.exit_code: int | None = None
        self.cpu_seconds = 0.0
        self.setup_error = ""
        self._capped = bool(plan.get("write_cap"))
        cap = config.max_output_kb << 10
        self.stdout, self.stderr = Tail(cap), Tail(cap)
        self._reply_bytes = 0
        self._pending = bytearray()
        self._pending_since = 0.0
        self.channel = bytearray() if plan.get("channel_fd") is not None else None
        """A command's report channel: every byte it wrote there, in order."""
        self.on_call: Callable[[bytes], bytes | None] | None = None
        """Answers a command's questions on its channel (`_answer_calls`)."""
        self._call_pending = bytearray()
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
                view = view[os.write(self._cmd, view) :]
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
            if key.fd == self._reply and self.channel is not None:
                self._take_channel(chunk)
            elif key.fd == self._reply:
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
        if self._group is not None and time.monotonic() - self._cpu_checked > 0.1:
            # One CPU budget for every process of the run (RLIMIT_CPU alone is per process).
            self._cpu_checked = time.monotonic()
            if self._group.cpu_seconds() > self.config.cpu_seconds:
                self.stop = "cpu"
        if self.stop:
            pass
        elif self.stdout.total + self.stderr.total > self.config.max_file_mb << 20:
            self.stop = "output"
        elif self._reply_bytes > MAX_RESULT_BYTES or len(self._pending) > MAX_RECORD_BYTES:
            self.stop = "results"
        elif self._pending and time.monotonic() - self._pending_since > MAX_RECORD_SECONDS:
            self.stop = "results"
        elif self.setup_error:
            self.stop = "setup"
        if self.stop:
            self.live = False
        return self.live

    def _take_channel(self, chunk: bytes) -> None:
        if not chunk:
            self._sel.unregister(self._reply)
            return
        if self.on_call is not None:
            chunk = self._answer_calls(chunk)
        self.channel += chunk
        if len(self.channel) > MAX_RESULT_BYTES:
            self.stop = "results"

    def _answer_calls(self, chunk: bytes) -> bytes:
        """Channel lines that start with CALL_PREFIX are questions to the caller (`on_call`), answered on the
        command's `call_fd`; the rest of the channel is returned as it came."""
        self._call_pending += chunk
        kept = bytearray()
        while b"\n" in self._call_pending:
            line, _, rest = bytes(self._call_pending).partition(b"\n")
            self._call_pending = bytearray(rest)
            if line.startswith(CALL_PREFIX):
                answer = self.on_call(line[len(CALL_PREFIX) :])
                if answer is None or not self._send(answer + b"\n"):
                    self.stop = self.stop or "results"
                    break
            else:
                kept += line + b"\n"
        if len(self._call_pending) > MAX_RESULT_BYTES:
            self.stop = "results"
        return bytes(kept)

    def exchange(self, line: bytes) -> bytes | None:
        """A command run that answers on its channel (`call_fd` in, `channel_fd` out): send one line, return the
        next line it writes (None when it ended, was stopped, or its deadline passed first)."""
        if not self.live or not self._send(line + b"\n"):
            return None
        while b"\n" not in self.channel:
            if not self._pump():
                return None
        answer, _, rest = bytes(self.channel).partition(b"\n")
        self.channel[:] = rest
        return answer

    def _drain_channel(self) -> None:
        """What the command's processes wrote before they ended (anything a stray one writes later is not read)."""
        if self.channel is None or self._reply not in self._sel.get_map():
            return
        os.set_blocking(self._reply, False)
        while not self.stop:
            try:
                chunk = os.read(self._reply, 1 << 16)
            except BlockingIOError:
                break
            self._take_channel(chunk)
            if not chunk:
                break

    def _take_replies(self, chunk: bytes) -> None:
        if not self._pending:
            self._pending_since = time.monotonic()
        if b"\n" not in chunk:
            self._pending += chunk
            return
        self._pending += chunk
        *lines, rest = self._pending.split(b"\n")
        self._pending = bytearray(rest)
        self._pending_since = time.monotonic()
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
                if record.get("write_limit"):
                    self.flag(
                        "write_limit",
                        f"the run's files reached their cap ({self.config.max_write_mb} MB, "
                        f"{self.config.max_inodes} inodes); later writes were refused",
                    )

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
        """A command run: read its output (and its report channel) until the holder reports its exit, the deadline
        or a limit."""
        if self.channel is None:
            self._sel.unregister(self._reply)
        while self.live and self.exit_code is None and self._sel.get_map():
            self._pump()
        if self.exit_code is None and not self.stop and not self.setup_error:
            self._wait_end()  # every pipe closed: the status record may still be on its way
        self._drain_channel()
        self.live = False
        self.finish()

    def finish(self) -> int | None:
        """Ask the harness to end (it reports processes the program left), then kill what is left."""
        if self.live:
            bye = self.request({"op": "exit"})
            if bye and bye.get("children"):
                self.flag("stray_processes", f"{bye['children']} process(es) still running at the end")
            self.live = False
            if self._capped and bye is not None:
                self._wait_end()  # the holder's exit record says whether the run's files reached their cap
        if self._group is not None and self._group.memory_hit():
            self.memory_hit = True
            self.flag("memory_limit", "the run's memory (processes, memfd, tmpfs, shared memory) reached its limit")
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


def command_result(session: Session, config: SandboxSection, uid: int | None) -> CommandResult:
    wall = time.monotonic() - session.started
    exit_code, stop = session.exit_code, session.stop
    output = session.stdout
    cut = output.total - len(output.data)
    text = (f"[output cut: the first {cut} of {output.total} bytes are not shown]\n" if cut else "") + output.text()
    flags = [f for f in ("write_limit", "memory_limit") if f in session.flags]
    # The CPU limit ended it (SIGXCPU, SIGKILL past the hard limit, or bash reporting either: 128 + signal).
    cpu_kill = (
        stop == "cpu"
        or exit_code in (-signal.SIGXCPU, 128 + signal.SIGXCPU)
        or (exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL) and session.cpu_seconds >= config.cpu_seconds)
    )
    if session.setup_error or stop == "setup":
        return CommandResult(None, "infra", f"sandbox setup failed: {session.setup_error}", wall, infra_failure=True)
    if stop == "timeout":
        if uid is not None and starved_seconds(uid) > 0.5 * config.wall_seconds:
            return CommandResult(None, "infra", text, wall, ("host_timeout",), infra_failure=True)
        status, exit_code = "timeout", None
        flags.append("timeout")
        text += f"\n[killed: the command ran past its limit of {config.wall_seconds:g} s]"
    elif cpu_kill:
        status, exit_code = "timeout", None
        flags.append("timeout")
        text += f"\n[killed: the command used its CPU-time limit of {config.cpu_seconds} s]"
    elif session.memory_hit:
        status = "memory"
        text += "\n[the command's memory reached its limit: a process was killed]"
    elif stop in ("output", "results"):
        status, exit_code = "crash", None
        flags.append("output_limit")
        text += (
            f"\n[killed: the output went past {config.max_file_mb} MB]"
            if stop == "output"
            else f"\n[killed: the report channel went past {MAX_RESULT_BYTES >> 20} MB]"
        )
    elif exit_code is None:
        return CommandResult(None, "infra", text + "\n[the sandbox lost the command's exit status]", wall, infra_failure=True)
    elif exit_code != 0 and "MemoryError" in text:
        status = "memory"
    elif exit_code < 0:
        status = "crash"
    else:
        status = "ok"
    return CommandResult(
        exit_code, status, text, wall, tuple(sorted(flags)), cpu_seconds=session.cpu_seconds, channel=bytes(session.channel or b"")
    )
