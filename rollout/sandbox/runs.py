"""Run model-written code in an isolated child and grade what it computed, outside it.

`Sandbox.run` starts a fresh isolated child per run (`session`, `isolation`): it loads the program and calls its
entry point on inputs; outputs come back as plain data over a pipe the grader owns, and the verdict is made here,
where no program code ever runs (`graders`), against expected outputs that never enter the sandbox.
`Sandbox.run_command` runs a shell command in a work directory under the same isolation.

Always: resource limits, a clean environment, everything the run started killed at its end, captured
output capped, the run's directory removed, flags for what the program tried (`graders.FLAGS`). Failures
of the sandbox itself (the fork server, setup, a host too busy to run the program) are retried and
reported as `infra_failure`, never as the program's score.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from composer.recipes.env_schema import SandboxSection
from composer.recipes.errors import UserError
from composer.rollout.sandbox import cgroups
from composer.rollout.sandbox.cgroups import RunCgroup
from composer.rollout.sandbox.graders import grade_program
from composer.rollout.sandbox.isolation import (
    COMMAND_TOOLS,
    DEFAULT_ROOT,
    UID_LOCK_DIR,
    WORK_DIR,
    Isolation,
    UidLease,
    check_root_layout,
    inside,
    kill_uid,
    root_layout,
)
from composer.rollout.sandbox.results import AssertionTests, CommandResult, RewardMode, RunEnvironment, SandboxResult, Tests
from composer.rollout.sandbox.session import InfraError, Session, command_result, sandbox_environment, zygote_for
from composer.rollout.sandbox.trees import remove_tree

log = logging.getLogger("composer.sandbox")

# The harness's files (and the trusted pytest entry of repository tasks): a program that reads them is flagged.
_PROTECTED = Path(__file__).resolve().parents[1]

# A command's report channel (`run_command(channel=True)`).
CHANNEL_FD = 3
# Where a command run reads the caller's answers (`run_command(calls=...)`, `serving`).
CALL_FD = 4

_PROBE = ("def probe():\n    return 1\n", AssertionTests(entry_point="probe", setup="", cases=("assert candidate() == 1",)))


def _describe(isolation: Isolation) -> str:
    who = "a dedicated uid" if isolation.dedicated_uid else "the caller's uid"
    return f"{who} {'with' if isolation.namespaces else 'without'} namespaces"


@cache
def detect_isolation(sandbox_root: Path) -> Isolation:
    """The strongest isolation that runs a trivial program here, found once per process and sandbox root;
    each weaker fallback is logged with the reason the stronger one failed."""
    if os.geteuid() == 0:
        check_root_layout(sandbox_root)
        candidates = [Isolation(True, True), Isolation(True, False), Isolation(False, False)]
    else:
        log.warning(
            "sandbox: not running as root, so model code runs as this user with this user's view of the "
            "filesystem (no root of its own; RLIMIT_NPROC counts all the user's processes)"
        )
        candidates = [Isolation(False, True), Isolation(False, False)]
    for isolation in candidates:
        probe = Sandbox(SandboxSection(infra_retries=0), sandbox_root, isolation).run(*_PROBE)
        if probe.reward == 1.0:
            return isolation
        lines = (probe.stderr_tail.strip() or probe.detail).splitlines()
        log.warning("sandbox: %s does not work here (%s)", _describe(isolation), lines[-1] if lines else probe.status)
    raise UserError(f"the sandbox cannot run Python programs here, even as {_describe(candidates[-1])}; see the log above")


@cache
def _warn_once(message: str) -> None:
    log.warning(message)


class Sandbox:
    """Runs programs against tests under the limits of a `SandboxSection`; safe to use from many threads."""

    def __init__(self, config: SandboxSection, root: Path | None = None, isolation: Isolation | None = None):
        self.config = config
        # absolute: sandboxed processes start in other working directories
        self.root = (root or DEFAULT_ROOT).resolve()
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        self._zygote = zygote_for(self.root)
        self.isolation = isolation or detect_isolation(self.root)
        if self.isolation.dedicated_uid:
            cgroups.reclaim()

    def run(self, program: str, tests: Tests, reward: RewardMode = "fraction") -> SandboxResult:
        for attempt in range(self.config.infra_retries + 1):
            result = self._run_once(program, tests, reward)
            if not result.infra_failure:
                return result
            log.warning(
                "sandbox: infrastructure failure (%s)%s",
                result.detail,
                ", retrying" if attempt < self.config.infra_retries else "; the run is marked infra_failure",
            )
        return result

    def run_command(
        self,
        command: str,
        workdir: Path,
        timeout_s: float | None = None,
        hidden: tuple[str, ...] = (),
        channel: bool = False,
        environment: RunEnvironment | None = None,
        calls: Callable[[bytes], bytes | None] | None = None,
        owned: bool = False,
    ) -> CommandResult:
        """`bash -c command` isolated like `run`, with the host directory `workdir` as the writable work
        directory (at /sandbox under a root of its own, also HOME and first on PYTHONPATH), everything it
        started killed at the end, and the host paths `hidden` (e.g. the installed copy of the task's project)
        unreadable. Each call runs as another uid with umask 0: files in `workdir` are writable by the next
        call only when they are world-writable. `timeout_s` (default: wall_seconds) bounds its wall time and,
        when longer, its CPU time. With `channel`, descriptor 3 of the command is a pipe to the caller: what
        the command writes there comes back, in order, as `CommandResult.channel` (a report that no file of
        the run holds); with `calls` too, a channel line starting with `CALL_PREFIX` is a question instead: its
        answer, `calls(rest of the line)`, is written as one line to the command's descriptor CALL_FD. `environment` adds a project's environment (PATH, binds, sys.path). `owned`: `workdir` serves this call only
        (a grading directory) and becomes the run's uid's, mode 0700, instead of world-writable. Without root the
        command runs as this user in `workdir` and `hidden` is not enforced (logged once)."""
        workdir = Path(workdir).resolve()
        if not workdir.is_dir():
            raise FileNotFoundError(f"sandbox work directory {workdir} does not exist")
        for attempt in range(self.config.infra_retries + 1):
            result = self._command_once(
                command, workdir, timeout_s or self.config.wall_seconds, hidden, channel, environment or RunEnvironment(), calls, owned
            )
            if not result.infra_failure:
                return result
            log.warning(
                "sandbox: infrastructure failure (%s)%s",
                result.output[-200:],
                ", retrying" if attempt < self.config.infra_retries else "; the run is marked infra_failure",
            )
        return result

    @contextmanager
    def _run_slot(self, prefix: str, memory_mb: int):
        """A fresh run directory and, with dedicated uids, a uid no other run holds; at the end (after the run's
        session is killed) every process of the uid is killed, the uid released and the directory removed."""
        run_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=self.root))
        lease = UidLease(UID_LOCK_DIR) if self.isolation.dedicated_uid else None
        group = None
        try:
            if lease:
                group = RunCgroup.create(run_dir.name, (memory_mb + _SHM_MB) << 20)
            yield run_dir, (lease.uid if lease else None), group
        finally:
            if group is not None:
                group.remove()
            if lease:
                # Before the uid serves another run: forks can outlive the process group, and a PID
                # namespace's processes die only as its init's exit reaches them.
                kill_uid(lease.uid)
                lease.release()
            remove_tree(run_dir)

    def _command_once(
        self,
        command: str,
        workdir: Path,
        timeout_s: float,
        hidden: tuple[str, ...],
        channel: bool,
        environment: RunEnvironment,
        calls: Callable[[bytes], bytes | None] | None = None,
        owned: bool = False,
    ) -> CommandResult:
        c = self.config
        # A command also writes its episode's workspace (a tmpfs charged to the run that wrote it).
        with self._run_slot("cmd-", c.memory_mb + c.max_write_mb + c.workspace_max_write_mb) as (run_dir, uid, group):
            started = time.monotonic()
            session = None
            try:
                config, plan = self._command_plan(run_dir, uid, command, workdir, timeout_s, hidden, channel, environment, owned)
                if calls is not None:
                    plan["call_fd"] = CALL_FD
                session = Session(config, self._zygote, _joined(plan, group), group)
                session.on_call = calls
                session.wait_exit()
                return command_result(session, config, uid)
            except InfraError as e:
                return CommandResult(None, "infra", str(e), time.monotonic() - started, infra_failure=True)
            finally:
                if session is not None:
                    session.kill()

    @contextmanager
    def serving(
        self, command: str, workdir: Path, timeout_s: float, hidden: tuple[str, ...] = (), environment: RunEnvironment | None = None
    ) -> Iterator[Session]:
        """`command` isolated like `run_command`, left running as a server: `Session.exchange` sends it a line on
        descriptor CALL_FD and returns the line it answers on CHANNEL_FD. Killed, with everything it started, on
        leaving. InfraError when it cannot start."""
        workdir = Path(workdir).resolve()
        c = self.config
        with self._run_slot("srv-", c.memory_mb + c.max_write_mb) as (run_dir, uid, group):
            config, plan = self._command_plan(run_dir, uid, command, workdir, timeout_s, hidden, True, environment or RunEnvironment())
            plan["call_fd"] = CALL_FD
            session = Session(config, self._zygote, _joined(plan, group), group)
            try:
                yield session
            finally:
                session.kill()

    def _command_plan(
        self,
        run_dir: Path,
        uid: int | None,
        command: str,
        workdir: Path,
        timeout_s: float,
        hidden: tuple[str, ...],
        channel: bool,
        environment: RunEnvironment,
        owned: bool = False,
    ) -> tuple[SandboxSection, dict]:
        config = self.config.model_copy(
            update={"wall_seconds": timeout_s, "cpu_seconds": max(self.config.cpu_seconds, math.ceil(timeout_s))}
        )
        plan = self._plan(run_dir, uid, config)
        own_root = "new_root" in plan
        if own_root:
            plan["work"] = str(workdir)
            extra = [*COMMAND_TOOLS, *environment.read_only]
            plan["read_only"] = plan["read_only"] + [p for p in extra if not inside(p, plan["read_only"])]
            plan["writable_binds"] = list(environment.writable)
            plan["hidden"] = sorted({*plan["hidden"], *(h for h in hidden if inside(h, plan["read_only"]))})
            empty = run_dir / "empty"
            empty.touch(mode=0o444)
            plan["empty_file"] = str(empty)
            if owned and uid is not None:
                os.chown(workdir, uid, uid)
                os.chmod(workdir, 0o700)
            else:
                os.chmod(workdir, 0o777)
        else:
            if hidden:
                _warn_once(
                    "sandbox: without a root of its own a command can read what this user can read, "
                    "including paths meant to be hidden (the installed copy of a task's project)"
                )
            plan.update(cwd=str(workdir), writable=[str(workdir), plan["writable"][1]], env=sandbox_environment(str(workdir)))
        plan["env"]["PYTHONPATH"] = ":".join([*(os.path.join(plan["cwd"], p) for p in environment.pythonpath), plan["cwd"]])
        plan["env"]["PATH"] = ":".join([*environment.path, plan["env"]["PATH"]])
        plan["env"].update(environment.variables)
        plan["command"] = command
        if channel:
            plan["channel_fd"] = CHANNEL_FD
        return config, plan

    def _run_once(self, program: str, tests: Tests, reward: RewardMode) -> SandboxResult:
        with self._run_slot("run-", self.config.memory_mb + self.config.max_write_mb) as (run_dir, uid, group):
            started = time.monotonic()
            session = None
            try:
                session = Session(self.config, self._zygote, _joined(self._plan(run_dir, uid, self.config), group), group)
                return grade_program(session, self.config, program, tests, reward, uid)
            except InfraError as e:
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
            "env": sandbox_environment(WORK_DIR if own_root else str(work)),
            "writable": [WORK_DIR, "/tmp"] if own_root else [str(work), str(tmp)],
            "protected": [str(_PROTECTED), *layout["hidden"]],
        }
        if own_root:
            (run_dir / "root").mkdir(mode=0o700)
            plan.update(
                new_root=str(run_dir / "root"), work=str(work), tmp=str(tmp), **layout, write_cap=[c.max_write_mb << 20, c.max_inodes]
            )
        return plan


_SHM_MB = 16
"""The run's /dev/shm (a tmpfs of its own), counted in its memory limit."""


def _joined(plan: dict, group: RunCgroup | None) -> dict:
    """The plan with the run's cgroup to join (its holder writes its pid to each `procs` file first)."""
    if group is not None:
        plan["cgroup_procs"] = group.procs
    return plan
