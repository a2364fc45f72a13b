"""Programs composer keeps running as SLURM job steps, one `srun` each, talked to over the step's stdin/stdout (the
sandbox servers of `env.sandbox.slurm`).

The steps run in the driver's own job when it runs inside one (SLURM_JOB_ID), sharing its nodes' CPUs with the job's
other steps (`--overlap`), or else in a job of their own that `salloc` holds for as long as this process lives: its
command waits for the end of its stdin, which is this process's pipe, so even a driver killed with -9 gives the
nodes back. Each `srun` gets SIGTERM when this process dies, and srun cancels its step then.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import select
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from composer.cluster.slurm import allocation_nodes, in_allocation, require
from composer.recipes.env_schema import SandboxServersOnSlurm
from composer.recipes.errors import UserError
from composer.runtime.processes import die_with_parent

LOST_STATES = ("down", "drain", "drng", "fail", "maint", "unk")
"""sinfo's short node states in which a node takes no more steps (a trailing `*`: not responding, too)."""
STOP_SECONDS = 30
QUEUE_CHECK_SECONDS = 5.0
NEVER_STARTS = ("PartitionNodeLimit", "PartitionConfig", "BadConstraints", "InvalidAccount", "InvalidQOS", "AccountNotAllowed")
"""Reasons squeue gives for a pending job that no amount of waiting will start."""
log = logging.getLogger("composer.fleet")
WANTED_BY = "env.sandbox.slurm starts sandbox servers"


class StepChannel:
    """One srun step's stdin/stdout as the channel a sandbox host's frames cross (the calls of an SSH channel that
    `rollout.sandbox.hosts.RemoteSandboxHost` makes), its stderr as the server's log."""

    def __init__(self, process: subprocess.Popen, node: str, job: str):
        self.process, self.node, self.job = process, node, job
        self.where = f"SLURM step of job {job} on {node}"
        self._timeout: float | None = None

    def settimeout(self, seconds: float | None) -> None:
        self._timeout = seconds

    def recv(self, size: int) -> bytes:
        fd = self.process.stdout.fileno()
        if self._timeout is not None and not select.select([fd], [], [], self._timeout)[0]:
            raise TimeoutError(f"no answer within {self._timeout:.0f} s")
        return os.read(fd, size)

    def recv_stderr(self, size: int) -> bytes:
        return os.read(self.process.stderr.fileno(), size)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.process.stdin.fileno(), view) :]

    def shutdown_write(self) -> None:
        self.process.stdin.close()

    def exit_status_ready(self) -> bool:
        return self.process.poll() is not None

    def close(self) -> None:
        """End the step: srun cancels it on SIGTERM."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            try:
                pipe.close()
            except OSError:
                pass

    def explain(self, error: Exception) -> UserError:
        return UserError(f"{self.where}: {type(error).__name__}: {error}")


class StepJob:
    """The SLURM job the steps run in, its nodes, and which of them are lost."""

    def __init__(self, settings: SandboxServersOnSlurm, name: str):
        self.settings, self.name = settings, name
        self._srun = require("srun", WANTED_BY)
        self._holder: subprocess.Popen | None = None
        self.lost: set[str] = set()
        self.job = ""
        self._lock = threading.Lock()
        # The kernel signals a process started with die_with_parent when the *thread* that started it ends: srun and
        # salloc are started by this one thread, which lives as long as the job.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurm-spawner")
        try:
            if in_allocation():
                self.job, self.nodes = os.environ["SLURM_JOB_ID"], allocation_nodes()
            else:
                self.job = self._allocate()
                self.nodes = _hostnames(_squeue(self.job, "%N"))
        except BaseException:
            self.close(set())
            raise

    def _allocate(self) -> str:
        """A job of their own: `salloc` holding `nodes` nodes while its command (`cat`, reading our pipe) runs."""
        s = self.settings
        argv = [require("salloc", WANTED_BY), f"--nodes={s.nodes or s.servers}", f"--job-name={self.name}"]
        for flag, value in (("partition", s.partition), ("account", s.account), ("time", s.time_limit)):
            if value:
                argv.append(f"--{flag}={value}")
        self._holder = self._spawn([*argv, "cat"], stdout=subprocess.DEVNULL, text=True)  # salloc gives the nodes back on SIGTERM
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_lines_into, args=(self._holder.stderr, lines), daemon=True, name="salloc-stderr").start()
        said, pending = [], None
        while (line := _next_line(lines)) is not None:  # salloc waits in the queue until SLURM grants the nodes
            if line == "":  # nothing said for a while: a job that can never start would wait for ever
                if pending is not None and (reason := _pending_reason(pending)) in NEVER_STARTS:
                    subprocess.run(["scancel", pending], capture_output=True)
                    self._holder.wait()
                    raise UserError(f"env.sandbox.slurm: SLURM will never start job {pending} (salloc {' '.join(argv[1:])}): {reason}")
                continue
            said.append(line.strip())
            if queued := re.search(r"Pending job allocation (\d+)", line):
                pending = queued.group(1)
                log.info("sandbox servers: waiting for SLURM to start job %s", pending)
            if granted := re.search(r"Granted job allocation (\d+)", line):
                return granted.group(1)
        self._holder.wait()
        raise UserError(f"env.sandbox.slurm: salloc {' '.join(argv[1:])} got no nodes: {' | '.join(said) or 'no output'}")

    def place(self, busy: dict[str, int], previous: str | None) -> str:
        """The node for a server (`pick_node`), after asking SLURM whether `previous`, where its step died, is lost."""
        with self._lock:
            if previous is not None and _node_lost(previous):
                self.lost.add(previous)
            node = pick_node(self.nodes, self.lost, busy, previous)
        if node is None:
            raise UserError(f"env.sandbox.slurm: every node of SLURM job {self.job} is lost ({', '.join(sorted(self.lost))})")
        return node

    def start(self, node: str, step_name: str, argv: list[str]) -> StepChannel:
        """`argv` as a step of one task on `node`, unbuffered, its stdin and stdout the channel."""
        cpus = self.settings.cpus_per_server
        srun = [
            self._srun,
            f"--jobid={self.job}",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node}",
            f"--job-name={step_name}",
            "--unbuffered",
            "--kill-on-bad-exit=1",
            *([f"--cpus-per-task={cpus}"] if cpus else []),
        ]
        return StepChannel(
            self._spawn([*srun, *argv], stdout=subprocess.PIPE, bufsize=0), node, self.job
        )  # srun cancels its step on SIGTERM

    def _spawn(self, argv: list[str], **options) -> subprocess.Popen:
        """`argv` started by the spawner thread, to get SIGTERM when this process ends."""
        start = partial(subprocess.Popen, argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE, **options)
        return self._spawner.submit(start, preexec_fn=lambda: die_with_parent(signal.SIGTERM)).result()

    def close(self, step_names: set[str]) -> None:
        """Cancel the steps named `step_names` that are still there, and give a job of their own back."""
        if step_names and self.job:
            steps = subprocess.run(["squeue", "-h", "-s", "-j", self.job, "-o", "%i %j"], capture_output=True, text=True).stdout
            left = [line.split()[0] for line in steps.splitlines() if len(line.split()) == 2 and line.split()[1] in step_names]
            if left:
                subprocess.run(["scancel", *left], capture_output=True)
        if self._holder is not None:
            self._holder.stdin.close()  # its `cat` ends, and salloc gives the nodes back
            try:
                self._holder.wait(timeout=STOP_SECONDS if self.job else 0)
            except subprocess.TimeoutExpired:  # still waiting in the queue, or stuck: SIGTERM revokes the job
                self._holder.terminate()
                self._holder.wait()
        self._spawner.shutdown()


def pick_node(nodes: list[str], lost: set[str], busy: dict[str, int], previous: str | None) -> str | None:
    """Of `nodes` not `lost`: another than `previous` (where a server's step just died) while there is one, then the
    one with the fewest servers (`busy`), then the first in the job's order; None when every node is lost."""
    usable = [node for node in nodes if node not in lost]
    return min(usable, key=lambda node: (node == previous, busy.get(node, 0), nodes.index(node)), default=None)


def _lines_into(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _next_line(lines: queue.Queue) -> str | None:
    """The next line, "" when none came for a few seconds, None at the end."""
    try:
        return lines.get(timeout=QUEUE_CHECK_SECONDS)
    except queue.Empty:
        return ""


def _pending_reason(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True).stdout.strip()


def _squeue(job: str, field: str) -> str:
    result = subprocess.run(["squeue", "-h", "-j", job, "-o", field], capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        raise UserError(f"env.sandbox.slurm: squeue does not show SLURM job {job}: {result.stderr.strip()}")
    return result.stdout.strip()


def _hostnames(nodelist: str) -> list[str]:
    result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"scontrol show hostnames {nodelist} failed: {result.stderr.strip()}")
    return result.stdout.split()


def _node_lost(node: str) -> bool:
    """Whether SLURM says `node` takes no more steps (down, drained, failed, not responding, or gone)."""
    result = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True)
    states = result.stdout.split()
    return result.returncode != 0 or not states or any(s.endswith("*") or s.rstrip("*~#!%$@^-+").startswith(LOST_STATES) for s in states)
