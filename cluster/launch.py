"""Start a run's ranks with torchrun on its training hosts and watch them as one job.

`build_launcher(cluster).start(module, args, run)` (`cluster.launchers`) runs `python -m module args...` as `cluster.procs_per_host`
ranks on every host of `cluster.hosts`, started as `cluster.launcher` says:

- `local`: torchrun on this host (one host only);
- `ssh`: torchrun on every host over SSH (host keys checked, `cluster.ssh`), joined by torchrun's c10d
  rendezvous on the first host; each host's output goes to the console with a host prefix and to
  `logs/<host>/torchrun.log`. What a host runs ends when its SSH session does, so a driver killed with -9
  leaves nothing running there;
- `slurm`: inside an allocation, one `srun` task per node runs torchrun with SLURM's node id as node rank
  (`cluster/slurm.py` also writes and submits sbatch jobs).

The job stops on every host as soon as one host fails, and `Job.failure()` names the host, the rank and the
root cause: a rank's own message (a UserError recorded in `logs/error-rank-N.txt`), the traceback of the rank
that failed first, or how torchrun itself ended.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from composer.recipes.errors import RunFailed, UserError
from composer.recipes.schema import ClusterSection
from composer.runtime.processes import die_with_parent, free_port
from composer.runtime.run_dir import RunDir

ERROR_PREFIX = "error-rank-"
STOP_GRACE_SECONDS = 10
"""How long a host's torchrun may take to stop its ranks after SIGTERM before it is killed."""


# --- what ranks leave behind for the launcher -----------------------------------------------------


def first_rank_error(run: RunDir) -> str | None:
    """The user error of the lowest rank that recorded one, if any."""
    errors = sorted(run.logs.glob(f"{ERROR_PREFIX}*.txt"), key=lambda p: int(p.stem.removeprefix(ERROR_PREFIX)))
    return errors[0].read_text() if errors else None


def clear_rank_errors(run: RunDir) -> None:
    for stale in run.logs.glob(f"{ERROR_PREFIX}*.txt"):
        stale.unlink()


def rank_environment(cluster: ClusterSection) -> dict[str, str]:
    """What every rank gets on top of its host's environment: one thread per rank (faster than ranks sharing
    cores), unbuffered output (so it streams), then the recipe's `cluster.env`."""
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **cluster.env}


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostCommand:
    """What one training host runs: a torchrun command line in a working directory, with extra environment."""

    host: str
    node_rank: int
    ranks: range
    argv: list[str]
    env: dict[str, str]
    workdir: str

    def shell(self) -> str:
        exports = shlex.join([f"{k}={v}" for k, v in self.env.items()])
        return f"cd {shlex.quote(self.workdir)} && env {exports} {shlex.join(self.argv)}"


@dataclass(frozen=True)
class LaunchPlan:
    launcher: str
    hosts: list[HostCommand]
    rendezvous: str
    notes: list[str] = field(default_factory=list)
    """What else the launcher does (an srun line, an sbatch script), for --dry-run."""


def torchrun_argv(
    python: str,
    nproc: int,
    module: str,
    args: list[str],
    *,
    nnodes: int = 1,
    node_rank: str | int = 0,
    endpoint: str | None = None,
    run_id: str = "composer",
    local_addr: str | None = None,
) -> list[str]:
    """torchrun for one host: standalone on loopback for one host, else c10d rendezvous at `endpoint`."""
    argv = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if endpoint is None:
        argv += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    else:
        argv += [
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--max-restarts",
            "0",
        ]
        if local_addr is not None:
            # the address the other hosts reach this one at (the hostname may resolve elsewhere); the first host
            # serves the rendezvous store
            argv += ["--local-addr", local_addr, "--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'}"]
    return [*argv, "-m", module, *args]


# --- one host's torchrun, started somewhere --------------------------------------------------------


class HostProcess(ABC):
    """torchrun on one host: its exit code once ended, a way to stop it, the log of its output."""

    host: str
    node_rank: int
    ranks: range
    log: Path
    log_offset: int

    @abstractmethod
    def exit_code(self) -> int | None:
        """torchrun's exit code, None while it runs."""

    @abstractmethod
    def stop(self) -> None:
        """Ask torchrun to stop its ranks (SIGTERM), killing them if they do not within the grace."""

    def close(self) -> None:
        """Release what reaches the host, once the process has ended."""

    def where(self) -> str:
        return f"host {self.host} (node {self.node_rank}, ranks {self.ranks.start}-{self.ranks.stop - 1})"

    def output(self) -> str:
        """What this host wrote during this job."""
        if not self.log.exists():
            return ""
        with self.log.open("rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")


def _offset(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0  # logs are appended to across resumes


class LocalProcess(HostProcess):
    """torchrun as a child of this process; it gets SIGTERM when this process dies (even by SIGKILL)."""

    def __init__(self, command: HostCommand, log: Path, echo: bool):
        self.host, self.node_rank, self.ranks, self.log = command.host, command.node_rank, command.ranks, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = _offset(log)
        env = {**os.environ, **command.env}
        with log.open("ab") as out:
            # rank 0's progress goes to this terminal when echoing; the rest (torchrun's report, warnings) to the log
            self.process = subprocess.Popen(
                command.argv,
                cwd=command.workdir,
                env=env,
                stderr=out,
                stdout=None if echo else out,
                preexec_fn=lambda: die_with_parent(signal.SIGTERM),
            )

    def exit_code(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # torchrun forwards it to the ranks
            try:
                self.process.wait(timeout=STOP_GRACE_SECONDS + 20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class OutputPump:
    """Copies a stream of lines to a host's log and, with a host prefix, to the console."""

    def __init__(self, log: Path, console: Console | None):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.file = log.open("ab")
        self.console = console
        self.lock = threading.Lock()

    def line(self, host: str, data: bytes) -> None:
        with self.lock:
            self.file.write(data)
            self.file.flush()
        if self.console is not None:
            text = data.decode(errors="replace").rstrip("\n").split("\r")[-1]
            self.console.print(f"[cyan]{escape(host)}[/] | {escape(text)}", highlight=False)

    def close(self) -> None:
        self.file.close()


def _remote_script(command: HostCommand) -> str:
    """Run torchrun in a session of its own; when our SSH session's input ends (we stop it, or the driver dies
    and the connection drops), stop torchrun's whole process group: TERM, then KILL after the grace."""
    exports = shlex.join([f"{k}={v}" for k, v in command.env.items()])
    # the watcher reads our input through fd 3: a background job's own stdin would be /dev/null
    return (
        f"exec 3<&0; cd {shlex.quote(command.workdir)} && {{ env {exports} setsid {shlex.join(command.argv)} 3<&- < /dev/null & tr=$!; "
        f"{{ cat > /dev/null; kill -TERM -- -$tr || exit 0; i=0; while [ $i -lt {STOP_GRACE_SECONDS} ] && kill -0 -- -$tr; "
        f"do sleep 1; i=$((i+1)); done; kill -KILL -- -$tr; }} <&3 > /dev/null 2>&1 & "
        f"wait $tr; }}"
    )


class SSHProcess(HostProcess):
    """torchrun on a host over SSH; its output is pumped to logs/<host>/torchrun.log and the console."""

    def __init__(self, ssh, command: HostCommand, log: Path, console: Console | None):
        self.host, self.node_rank, self.ranks, self.log = command.host, command.node_rank, command.ranks, log
        self.ssh = ssh
        self.log_offset = _offset(log)
        self.pump = OutputPump(log, console)
        self.session = ssh.conn.client.get_transport().open_session()
        self.session.set_combine_stderr(True)
        self.session.exec_command(_remote_script(command))
        self.reader = threading.Thread(target=self._read, daemon=True, name=f"output-{self.host}")
        self.reader.start()

    def _read(self) -> None:
        pending = b""
        while True:
            data = self.session.recv(1 << 16)
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self.pump.line(self.host, line + b"\n")
        if pending:
            self.pump.line(self.host, pending + b"\n")

    def exit_code(self) -> int | None:
        if not self.session.exit_status_ready():
            return None
        self.reader.join(timeout=5)  # the last lines, before anyone reads the log
        code = self.session.recv_exit_status()
        self.lost = code < 0  # the session ended without a status: its shell or the connection died
        return 255 if self.lost else code

    def stop(self) -> None:
        if not self.session.exit_status_ready():
            self.session.shutdown_write()
        deadline = time.monotonic() + STOP_GRACE_SECONDS + 10
        while not self.session.exit_status_ready() and time.monotonic() < deadline:
            time.sleep(0.1)

    def close(self) -> None:
        self.session.close()
        self.reader.join(timeout=5)
        self.pump.close()


# --- the job ---------------------------------------------------------------------------------------


class Job:
    """All hosts' torchruns as one job: when one host fails, every other host is stopped within seconds."""

    def __init__(self, run: RunDir, processes: list[HostProcess], on_close: Callable[[], None] = lambda: None):
        self.run = run
        self.processes = processes
        self._on_close = on_close
        self._failed: tuple[HostProcess, int] | None = None
        self._code: int | None = None
        self._stopping = False
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="job-watcher")
        self._watcher.start()

    def _watch(self) -> None:
        try:
            while True:
                codes = [p.exit_code() for p in self.processes]
                if self._failed is None and not self._stopping:  # hosts we stop are not the cause
                    for process, code in zip(self.processes, codes):
                        if code not in (None, 0):
                            self._failed = (process, code)
                            break
                if (self._failed is not None or self._stopping) and any(c is None for c in codes):
                    self._stop_all()
                    continue
                if all(c is not None for c in codes):
                    self._code = self._failed[1] if self._failed else next((c for c in codes if c), 0)
                    return
                time.sleep(0.1)
        finally:
            if self._code is None:
                self._code = 1  # the watcher itself failed (its traceback is on stderr)
            for process in self.processes:
                process.close()
            self._on_close()
            self._done.set()

    def _stop_all(self) -> None:
        threads = [threading.Thread(target=p.stop) for p in self.processes if p.exit_code() is None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def poll(self) -> int | None:
        """None while running; then 0 when every host succeeded, else the failed host's exit code."""
        return self._code if self._done.is_set() else None

    def wait(self) -> int:
        try:
            while not self._done.wait(0.2):
                pass
        except KeyboardInterrupt:
            self.terminate()
            raise
        return self._code

    def terminate(self) -> None:
        """Stop every host (SIGTERM to torchrun, SIGKILL after the grace) and wait for them."""
        self._stopping = True
        self._done.wait()

    def failure(self) -> str:
        """One message for a failed job: the host, the rank and the root cause, and where the logs are."""
        error = first_rank_error(self.run)
        if error:
            return error
        if self._failed is None:
            return f"the job was stopped before it finished; logs in {self.run.logs}/"
        process, code = self._failed
        return f"{process.where()}: {self._root_cause(process, code)}; the job was stopped on every host; logs in {self.run.logs}/"

    def _root_cause(self, process: HostProcess, code: int) -> str:
        report = process.output()
        if "Root Cause" in report:
            # torchrun's own report names the rank that failed first and how; its traceback is in the rank's log
            block = report[report.rfind("Root Cause") :]
            rank = re.search(r"rank\s*:\s*(\d+)", block)
            exit_line = re.search(r"exitcode\s*:\s*(-?\d+)", block)
            cause = f"rank {rank.group(1) if rank else '?'} failed (exit code {exit_line.group(1) if exit_line else '?'})"
            if rank:
                log = self.run.logs / f"rank-{rank.group(1)}.log"
                last = _last_traceback_line(log)
                if last:
                    cause += f": {last} (traceback in {log})"
                exit_code = int(exit_line.group(1)) if exit_line else 0
                if exit_code < 0:
                    cause += f" (killed by {signal.Signals(-exit_code).name})"
            return cause
        if getattr(process, "lost", False):
            return "its SSH session ended without an exit status (the host, its shell or the connection went away)"
        if code > 128 and code - 128 in signal.valid_signals():
            return f"torchrun ended by {signal.Signals(code - 128).name} (exit code {code})"
        tail = " | ".join(report.strip().splitlines()[-3:])
        return f"torchrun exited with code {code}" + (f": {tail}" if tail else "")


def _last_traceback_line(log: Path) -> str | None:
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    at = text.rfind("Traceback (most recent call last)")
    if at < 0:
        return None
    lines = [line for line in text[at:].splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


class RanksFailed(RunFailed):
    """The ranks stopped on something that is not a user error (a bug, a crash, a lost host)."""


def run_to_end(job: Job) -> None:
    """Wait for a job; raise UserError with a rank's own message, or RanksFailed naming host, rank and cause."""
    if job.wait() == 0:
        return
    error = first_rank_error(job.run)
    if error:
        raise UserError(error)
    raise RanksFailed(job.failure())


# --- launchers -------------------------------------------------------------------------------------


class Launcher(ABC):
    """How a run's ranks reach its training hosts (`cluster.launcher`)."""

    def __init__(self, cluster: ClusterSection):
        self.cluster = cluster
        self.python = cluster.python or sys.executable
        self.workdir = cluster.workdir or os.getcwd()

    @abstractmethod
    def plan(self, module: str, args: list[str], run_id: str) -> LaunchPlan:
        """What each host would run (nothing started): for --dry-run, and checked before a run writes anything."""

    def check_startable(self) -> None:
        """Raise UserError when this launcher cannot start ranks from here (checked before a run writes anything)."""
        self.plan("", [], "check")

    @abstractmethod
    def start(self, module: str, args: list[str], run: RunDir, console: Console | None = None) -> Job:
        """Start the ranks; `console` gets every host's output (else it goes to the logs only)."""


class LocalLauncher(Launcher):
    def plan(self, module: str, args: list[str], run_id: str) -> LaunchPlan:
        if len(self.cluster.hosts) != 1:
            raise UserError(
                f"cluster.hosts lists {len(self.cluster.hosts)} hosts but cluster.launcher is `local`, "
                "which runs on this host only; set cluster.launcher: ssh (or slurm)"
            )
        nproc = self.cluster.procs_per_host
        argv = torchrun_argv(self.python, nproc, module, args)
        env = rank_environment(self.cluster)
        return LaunchPlan("local", [HostCommand(self.cluster.hosts[0], 0, range(nproc), argv, env, self.workdir)], "127.0.0.1 (standalone)")

    def start(self, module: str, args: list[str], run: RunDir, console: Console | None = None) -> Job:
        command = self.plan(module, args, run.root.name).hosts[0]
        clear_rank_errors(run)
        return Job(run, [LocalProcess(command, run.logs / "torchrun.log", echo=console is not None)])


class SSHLauncher(Launcher):
    def plan(self, module: str, args: list[str], run_id: str) -> LaunchPlan:
        hosts, nproc = self.cluster.hosts, self.cluster.procs_per_host
        endpoint = f"{hosts[0]}:{self.cluster.rdzv_port}"
        env = rank_environment(self.cluster)
        commands = [
            HostCommand(
                host,
                node,
                range(node * nproc, (node + 1) * nproc),
                torchrun_argv(
                    self.python, nproc, module, args, nnodes=len(hosts), node_rank=node, endpoint=endpoint, run_id=run_id, local_addr=host
                ),
                env,
                self.workdir,
            )
            for node, host in enumerate(hosts)
        ]
        return LaunchPlan("ssh", commands, endpoint)

    def start(self, module: str, args: list[str], run: RunDir, console: Console | None = None) -> Job:
        from composer.cluster.ssh import SSHHost

        plan = self.plan(module, args, f"{run.root.name}-{uuid.uuid4().hex[:8]}")
        connections: list[SSHHost] = []
        try:
            for command in plan.hosts:
                connections.append(SSHHost(command.host, self.cluster.ssh))
            check_shared_dir(connections, run.root)
            clear_rank_errors(run)
            processes = [
                SSHProcess(ssh, command, run.logs / command.host / "torchrun.log", console) for ssh, command in zip(connections, plan.hosts)
            ]
        except BaseException:
            for ssh in connections:
                ssh.close()
            raise
        return Job(run, processes, on_close=lambda: [ssh.close() for ssh in connections])


def check_shared_dir(connections, run_dir: Path) -> None:
    """Checkpoints and rank logs need `run_dir` on storage every training host sees."""
    missing = unshared_hosts(connections, run_dir)
    if missing:
        raise UserError(
            f"run.dir {run_dir} is not shared: a file written there on {connections[0].host} is not visible on "
            f"{', '.join(missing)}; put run.dir on storage every training host mounts at the same path"
        )


def unshared_hosts(connections, run_dir: Path) -> list[str]:
    """The hosts that do not see a probe file the first host writes into `run_dir`, with the same content."""
    probe = run_dir / f".probe-{uuid.uuid4().hex}"
    token = uuid.uuid4().hex
    first, *others = connections
    try:
        _remote(first, f"mkdir -p {shlex.quote(str(run_dir))} && printf %s {token} > {shlex.quote(str(probe))}")
        return [ssh.host for ssh in others if _remote(ssh, f"cat {shlex.quote(str(probe))} 2>/dev/null || true").strip() != token]
    finally:
        _remote(first, f"rm -f {shlex.quote(str(probe))}")


def _remote(ssh, command: str) -> str:
    try:
        result = ssh.conn.run(command, hide=True, warn=True, in_stream=False)
    except Exception as e:
        raise ssh.explain(e) from None
    if result.exited != 0:
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()[-2:]
        raise UserError(f"{ssh.where}: `{command[:100]}` failed (exit {result.exited}): {' '.join(said)}")
    return result.stdout
