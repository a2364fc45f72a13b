"""Run model-written code against hidden tests in a separate, limited, unprivileged process.

Each run gets a fresh directory with two parts: `harness/` (root-owned, read-only: the harness, the
program, the tests) and `work/` (the only place the program may write; its cwd, HOME and TMPDIR). The
process starts through `rollout.sandbox_entry`, which applies the isolation this machine allows:

  as root      a dedicated uid per concurrent run (so RLIMIT_NPROC counts only this run and every
               stray process can be found and killed), new mount, PID and network namespaces (the
               PID namespace's end kills and reaps whatever the program left running), masks over
               the project, /root and the shared temp directories;
  not root     a user + network namespace when the kernel allows it; the same uid as the caller, so
               the harness files are protected only by the re-hash after the run.

Always: resource limits, a clean environment, the whole process group (and the uid's processes) killed
at the end, captured output capped, the directory removed. What was found unavailable is logged once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

from recipes.errors import UserError
from recipes.schema import SandboxSection

log = logging.getLogger("composer.sandbox")

Status = Literal["ok", "timeout", "memory", "crash", "tampered"]
RewardMode = Literal["fraction", "all_or_nothing"]

_HERE = Path(__file__).resolve().parent
PROJECT_ROOT = _HERE.parent
# A range of uids no account uses: one per concurrent run, claimed through a lock file.
SANDBOX_UID_BASE = 1_900_000_000
MAX_CONCURRENT_RUNS = 4096
# Leases must be machine-wide (every process, every sandbox root), so their locks live in one place.
UID_LOCK_DIR = Path("/run/composer-sandbox-uids")
# Result lines beyond this are not a test report any more.
MAX_RESULT_BYTES = 64 << 20
_GRACE_SECONDS = 2.0


# --- tests, as the sandbox runs them -----------------------------------------------------------


@dataclass(frozen=True)
class AssertionTests:
    """Statements run after the program; each case passes when it runs without raising."""

    entry_point: str
    setup: str
    cases: tuple[str, ...]


@dataclass(frozen=True)
class CallTests:
    """Call the entry point on JSON keyword arguments; the outputs are compared outside the sandbox."""

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


Tests = AssertionTests | CallTests | GeneratedCalls | ScriptRun


def _tests_document(tests: Tests) -> dict:
    if isinstance(tests, AssertionTests):
        return {"kind": "assertions", "entry_point": tests.entry_point, "setup": tests.setup, "cases": list(tests.cases)}
    if isinstance(tests, ScriptRun):
        return {"kind": "script"}
    if isinstance(tests, CallTests):
        # The expected outputs stay here: the program never sees them.
        return {"kind": "calls", "entry_point": tests.entry_point, "inputs": list(tests.inputs), "seed": tests.seed}
    return {"kind": "generate", "entry_point": tests.entry_point, "generator": tests.generator, "count": tests.count, "seed": tests.seed}


def _num_cases(tests: Tests) -> int:
    if isinstance(tests, ScriptRun):
        return 0
    if isinstance(tests, AssertionTests):
        return len(tests.cases)
    if isinstance(tests, CallTests):
        return len(tests.inputs)
    return tests.count


def outputs_match(got, expected) -> bool:
    """Equal JSON values, floats within a relative 1e-6 (and NaN equal to NaN)."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return got is expected
    if isinstance(expected, float) or isinstance(got, float):
        if not isinstance(got, (int, float)) or not isinstance(expected, (int, float)):
            return False
        if math.isnan(expected) or math.isnan(got):
            return math.isnan(expected) and math.isnan(got)
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(outputs_match, got, expected))
    if isinstance(expected, dict):
        return isinstance(got, dict) and got.keys() == expected.keys() and all(outputs_match(got[k], expected[k]) for k in expected)
    return type(got) is type(expected) and got == expected


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
    masks: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _needed_paths(sandbox_root: Path) -> list[Path]:
    """Directories the unprivileged interpreter must reach: its prefixes and the sandbox runs."""
    return sorted({Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sandbox_root)})


def _mask_plan(sandbox_root: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(directory, children kept) pairs, outermost first: the places the program must not see, and
    every ancestor of a needed path that others cannot traverse (e.g. /root holding a pyenv Python)."""
    needed = _needed_paths(sandbox_root)
    hidden = {Path(os.path.realpath(p)) for p in (tempfile.gettempdir(), "/var/tmp", "/dev/shm", pwd.getpwuid(0).pw_dir, PROJECT_ROOT)}
    for path in needed:
        for ancestor in path.parents:
            if ancestor != Path("/") and not os.stat(ancestor).st_mode & 0o001:
                hidden.add(ancestor)
    for path in needed:
        # Below a hidden directory, each level down to a needed path keeps only that path, so its
        # siblings (other runs, other checkouts) stay hidden too.
        for outer in [h for h in hidden if h in path.parents]:
            hidden.update(a for a in path.parents if outer in a.parents)
    plan = []
    for directory in sorted(hidden, key=lambda p: len(p.parts)):
        # A needed directory (or one inside it) stays as it is.
        if not directory.is_dir() or any(directory.is_relative_to(n) for n in needed):
            continue
        keep = sorted({n.relative_to(directory).parts[0] for n in needed if directory in n.parents})
        plan.append((str(directory), tuple(keep)))
    return tuple(plan)


_PROBE_PROGRAM = "def probe():\n    return 1\n"
_PROBE_TESTS = AssertionTests(entry_point="probe", setup="", cases=("assert candidate() == 1",))


def _describe(isolation: Isolation) -> str:
    who = "a dedicated uid" if isolation.dedicated_uid else "the caller's uid"
    return f"{who} {'with' if isolation.namespaces else 'without'} namespaces"


@cache
def detect_isolation(sandbox_root: Path) -> Isolation:
    """The strongest isolation that runs a trivial program here, found once per process and sandbox root;
    each weaker fallback is logged with the reason the stronger one failed."""
    root = os.geteuid() == 0
    if root:
        candidates = [Isolation(True, True, _mask_plan(sandbox_root)), Isolation(True, False), Isolation(False, False)]
    else:
        log.warning("sandbox: not running as root, so model code runs as this user (RLIMIT_NPROC then counts all its "
                    "processes, and the harness files are guarded only by re-hashing them)")
        candidates = [Isolation(False, True), Isolation(False, False)]
    for isolation in candidates:
        probe = Sandbox(SandboxSection(), sandbox_root, isolation).run(_PROBE_PROGRAM, _PROBE_TESTS)
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


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (forks that left the process group); repeat until none is left."""
    for _ in range(100):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                # A zombie is already dead; its parent (or init) reaps it.
                if entry.stat().st_uid == uid and Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    os.kill(int(entry.name), signal.SIGKILL)
                    found = True
            except (FileNotFoundError, ProcessLookupError):
                continue
        if not found:
            return
        time.sleep(0.01)


# --- the sandbox -------------------------------------------------------------------------------


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


def _hash_dir(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


class Sandbox:
    """Runs programs against tests under the limits of a `SandboxSection`; safe to use from many threads."""

    def __init__(self, config: SandboxSection, root: Path | None = None, isolation: Isolation | None = None):
        self.config = config
        # absolute: sandboxed processes start in other working directories
        self.root = (root or Path(tempfile.gettempdir()) / "composer-sandbox").resolve()
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        self.isolation = isolation or detect_isolation(self.root)

    def run(self, program: str, tests: Tests, reward: RewardMode = "fraction") -> SandboxResult:
        run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self.root))
        lease = _UidLease(UID_LOCK_DIR) if self.isolation.dedicated_uid else None
        try:
            return self._run(run_dir, lease.uid if lease else None, program, tests, reward)
        finally:
            if lease:
                _kill_uid(lease.uid)
                lease.release()
            shutil.rmtree(run_dir, ignore_errors=True)

    def _run(self, run_dir: Path, uid: int | None, program: str, tests: Tests, reward: RewardMode) -> SandboxResult:
        os.chmod(run_dir, 0o711)
        harness, work = run_dir / "harness", run_dir / "work"
        harness.mkdir(mode=0o755)
        work.mkdir(mode=0o700)
        shutil.copyfile(_HERE / "sandbox_runner.py", harness / "runner.py")
        (harness / "program.py").write_text(program)
        (harness / "tests.json").write_text(json.dumps(_tests_document(tests)))
        for f in harness.iterdir():
            f.chmod(0o444)
        harness.chmod(0o555)
        if uid is not None:
            os.chown(work, uid, uid)
        before = _hash_dir(harness)

        read_end, write_end = os.pipe()
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_HERE / "sandbox_entry.py"), json.dumps(self._plan(uid, work, harness, write_end))],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write_end,),
                start_new_session=True, env=self._environment(work), cwd=run_dir,
            )
        finally:
            os.close(write_end)
        with os.fdopen(read_end, "rb") as results:
            stdout, stderr, report, stop = self._collect(proc, results)
        wall = time.monotonic() - started

        tampered = _hash_dir(harness) != before
        return self._judge(tests, reward, proc.returncode, stop, report, stdout, stderr, wall, tampered, uid)

    def _plan(self, uid: int | None, work: Path, harness: Path, result_fd: int) -> dict:
        c = self.config
        cpu_hard = c.cpu_seconds + 1
        limits = {
            "RLIMIT_CPU": [c.cpu_seconds, cpu_hard],
            "RLIMIT_AS": [c.memory_mb << 20] * 2,
            "RLIMIT_FSIZE": [c.max_file_mb << 20] * 2,
            "RLIMIT_NOFILE": [256, 256],
            "RLIMIT_CORE": [0, 0],
        }
        if uid is not None:
            # Counted per real uid: meaningful only for a uid of its own.
            limits["RLIMIT_NPROC"] = [c.max_processes] * 2
        iso = self.isolation
        return {
            "root": os.geteuid() == 0,
            "mount_namespace": iso.namespaces and iso.dedicated_uid,
            "network_namespace": iso.namespaces and not c.network,
            "masks": [list(m) for m in iso.masks],
            "limits": limits,
            "uid": uid,
            "cwd": str(work),
            # Not -I: that would ignore PYTHONHASHSEED. The environment is ours anyway; -s -P keep the
            # user site and the harness directory off sys.path.
            "argv": [sys.executable, "-s", "-P", str(harness / "runner.py"), str(harness), str(result_fd)],
            "env": self._environment(work),
        }

    @staticmethod
    def _environment(work: Path) -> dict[str, str]:
        # Nothing from the parent's environment: no secrets, no proxies, no PYTHONPATH.
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(work),
            "TMPDIR": str(work),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Fixed str hashing: set iteration order, and so many reference outputs, repeat across runs.
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }

    def _collect(self, proc: subprocess.Popen, results) -> tuple[_Tail, _Tail, bytearray, str]:
        """Read output and results until the process ends; kill it on the wall limit or too much output."""
        cap = self.config.max_output_kb << 10
        stdout, stderr, report = _Tail(cap), _Tail(cap), bytearray()
        deadline = time.monotonic() + self.config.wall_seconds
        max_output = self.config.max_file_mb << 20
        stop = ""
        sel = selectors.DefaultSelector()
        for stream, sink in ((proc.stdout, stdout), (proc.stderr, stderr), (results, report)):
            sel.register(stream, selectors.EVENT_READ, sink)
        try:
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # Past the grace after the harness ended, only stray children are left: not a timeout.
                    stop = "timeout" if proc.poll() is None else ""
                    break
                for key, _ in sel.select(timeout=min(remaining, 1.0)):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif isinstance(key.data, _Tail):
                        key.data.add(chunk)
                    else:
                        key.data.extend(chunk)
                if stdout.total + stderr.total > max_output:
                    stop = "output"
                    break
                if len(report) > MAX_RESULT_BYTES:
                    stop = "results"
                    break
                if proc.poll() is not None:
                    # The harness ended: whatever still holds the pipes is a stray child; give it a moment.
                    deadline = min(deadline, time.monotonic() + _GRACE_SECONDS)
        finally:
            sel.close()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        return stdout, stderr, report, stop

    def _judge(self, tests: Tests, reward: RewardMode, returncode: int, stop: str, report: bytearray,
               stdout: _Tail, stderr: _Tail, wall: float, tampered: bool, uid: int | None) -> SandboxResult:
        total = _num_cases(tests)
        cases, done = _parse_report(report)
        cases = cases[:total]
        if isinstance(tests, CallTests):
            cases = [_judge_call(case, expected) for case, expected in zip(cases, tests.expected)]
        passed = sum(case.ok for case in cases)
        memory = any(case.error and "MemoryError" in case.error for case in cases) or "MemoryError" in stderr.text()

        if tampered:
            status, detail, passed = "tampered", "the harness files changed during the run", 0
        elif stop == "timeout" or (not stop and returncode in (-signal.SIGXCPU, -signal.SIGKILL)):
            status, detail = "timeout", "wall-clock limit" if stop == "timeout" else "CPU-time limit"
        elif stop == "output":
            status, detail = "crash", f"output exceeded {self.config.max_file_mb} MB"
        elif stop == "results":
            status, detail = "crash", "result stream too large"
        elif memory:
            status, detail = "memory", f"memory limit of {self.config.memory_mb} MB"
        elif returncode != 0 or not done:
            status, detail = "crash", f"exit status {returncode}" + ("" if done else ", tests did not finish")
        else:
            status, detail = "ok", ""
        return SandboxResult(
            reward=0.0 if tampered else reward_for(passed, total, reward),
            passed=passed, total=total, status=status, detail=detail,
            stdout_tail=stdout.text(), stderr_tail=stderr.text(), wall_seconds=wall, uid=uid, cases=tuple(cases),
        )


def _parse_report(report: bytearray) -> tuple[list[CaseResult], bool]:
    cases, done = [], False
    for line in report.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(record, dict):
            break
        if record.get("done"):
            done = True
            break
        cases.append(CaseResult(ok=record.get("ok") is True, error=record.get("error"), input=record.get("input"), output=record.get("output")))
    return cases, done


def _judge_call(case: CaseResult, expected: str) -> CaseResult:
    if not case.ok:
        return case
    try:
        ok = outputs_match(json.loads(case.output), json.loads(expected))
    except (TypeError, json.JSONDecodeError):
        ok = False
    return CaseResult(ok=ok, error=None if ok else "wrong output", input=case.input, output=case.output)
