"""The sandbox fleet: every sandbox run of a rollout goes through one pool that spreads it over the hosts of
`env.sandbox.hosts` (this machine, `localhost`, is a host like any other; remote hosts are reached over SSH and
grade on their own sandbox server, `rollout.sandbox_server`).

The pool (`SandboxPool`) is the scheduling core, independent of the transport: it sees hosts only through a
`Provider` and time only through a `Clock`, so the simulation (`benchmarks/fleet_sim.py`) drives the same code
with a simulated provider on a simulated clock. It keeps
  - per-host and global concurrency limits;
  - a bounded queue: a submitter waits (or, with `wait=False`, is told to) while it is full;
  - fair sharing between task sets: deficit round-robin, each set's quantum proportional to its weight;
  - retries with exponential backoff and jitter when a host fails a run; a run that fails on every attempt is
    an `infra_failure` result (reward 0, marked: never a score of the program);
  - health: a lost connection removes a host at once; `probe_after_failures` consecutive failures start a health
    probe (a real sandbox run), and a failed probe removes it; a removed host is probed again after
    `readmit_seconds` and re-admitted when the probe passes. While no host is up, runs fail as infra_failure;
  - metrics: queue wait and sandbox start latency percentiles, failures by cause, runs per host.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import shlex
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from recipes.errors import UserError
from recipes.schema import SandboxSection, SSHSection
from rollout.sandbox import AssertionTests, Isolation, RewardMode, Sandbox, SandboxResult, Tests
from rollout.sandbox_server import MODULE as SERVER_MODULE
from rollout.sandbox_server import (ProtocolError, RunRequest, SandboxRequest, frame_bytes, from_wire, read_frame, serve_request,
                                    to_wire)

log = logging.getLogger("composer.fleet")

LOCALHOST = "localhost"
HOST_LOST = ("connection_lost", "unreachable")
"""Failure causes that remove a host at once (no probe can reach it)."""
ALIVE = ("up", "probing")
"""Host states in which runs wait for it (a suspect host may pass its probe)."""
MAX_BACKOFF_SECONDS = 30.0
PROBE = RunRequest("def probe():\n    return 1\n", AssertionTests(entry_point="probe", setup="", cases=("assert candidate() == 1",)))
PROBE_SECONDS = 60.0
CONNECT_SECONDS = 120.0
"""A new host's server: SSH, its composer's imports, its sandbox's isolation probe."""


@dataclass(frozen=True)
class Failure:
    """A run that the host, not the program, failed: `cause` is one of a few words (metrics count by it)."""

    cause: str
    detail: str


Outcome = SandboxResult | Failure


# --- what the pool needs from the world ---------------------------------------------------------


class Clock(ABC):
    @abstractmethod
    def now(self) -> float: ...

    @abstractmethod
    def call_at(self, when: float, action: Callable[[], None]) -> None:
        """Run `action` at time `when` (on another thread, for a real clock)."""


class Provider(ABC):
    """The transport: how runs reach hosts. Callbacks may come from any thread, also from inside these calls."""

    @abstractmethod
    def start(self, host: str, number: int, request: SandboxRequest, started: Callable[[], None],
              done: Callable[[Outcome], None]) -> None:
        """Start run `number` on `host`: call `started` when its sandbox starts, `done` once with its outcome."""

    @abstractmethod
    def cancel(self, host: str, number: int) -> None:
        """Forget run `number` (it timed out): a late outcome is not reported."""

    @abstractmethod
    def probe(self, host: str, done: Callable[[Failure | None], None]) -> None:
        """Check `host` with a real run (reconnecting first if its connection is gone); `done(None)` when healthy."""


class RealClock(Clock):
    """time.monotonic, and one timer thread for every delayed action."""

    def __init__(self):
        self._heap: list = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="fleet-timers")
        self._thread.start()

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, action: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._order), action))
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                _, _, action = heapq.heappop(self._heap)
            try:
                action()
            except Exception:
                log.exception("fleet: a timed action failed")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()


class SimulatedClock(Clock):
    """Simulated time for simulations and tests: `run` performs the actions in time order; nothing sleeps."""

    def __init__(self):
        self._now = 0.0
        self._heap: list = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._order), action))

    def run(self, until: float = math.inf) -> None:
        """Perform every action due by `until` (all of them by default), moving time forward to each."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, action = heapq.heappop(heap)
            self._now = max(self._now, when)
            action()
        if until != math.inf:
            self._now = max(self._now, until)


# --- the scheduling core ----------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 when empty)."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))]


class FleetMetrics:
    """What the pool did: latencies over the last `window` runs, counts since the start."""

    def __init__(self, window: int):
        self.queue_wait: deque[float] = deque(maxlen=window)
        """Seconds from entering the queue (again, for a retry) to being sent to a host."""
        self.start_latency: deque[float] = deque(maxlen=window)
        """Seconds from being sent to a host to its sandbox starting the run."""
        self.failures: Counter[str] = Counter()
        """Failed attempts by cause (a retried run counts once per failed attempt)."""
        self.completed = 0
        self.retried = 0
        self.infra_failures = 0
        """Runs given up after every retry (infra_failure results)."""
        self.refused = 0
        """Submissions told to wait because the queue was full."""


class _Host:
    __slots__ = ("name", "capacity", "running", "state", "failures", "ready", "runs", "failed", "removed", "readmitted", "last_failure")

    def __init__(self, name: str, capacity: int):
        self.name, self.capacity = name, capacity
        self.running = 0
        self.state = "up"
        """up: takes runs; probing: suspect, a probe decides; down: removed; rejoining: removed, probe running."""
        self.failures = 0
        """Consecutive failed runs."""
        self.ready = False
        """In the pool's round-robin of hosts with a free slot."""
        self.runs = self.failed = self.removed = self.readmitted = 0
        self.last_failure = ""


class _Job:
    __slots__ = ("request", "task_set", "done", "enqueued", "attempt", "token", "host", "dispatched", "started")

    def __init__(self, request: SandboxRequest, task_set: _TaskSet, done: Callable[[SandboxResult], None], now: float):
        self.request, self.task_set, self.done = request, task_set, done
        self.enqueued = now
        self.attempt = 0
        self.token = 0
        """The number of the attempt running now (0: none): outcomes of older attempts are ignored."""
        self.host: _Host | None = None
        self.dispatched = 0.0
        self.started = False


class _TaskSet:
    __slots__ = ("name", "quantum", "jobs", "deficit", "active", "dispatched")

    def __init__(self, name: str, quantum: float):
        self.name, self.quantum = name, quantum
        self.jobs: deque[_Job] = deque()
        self.deficit = 0.0
        self.active = False
        self.dispatched = 0


class SandboxPool:
    """Runs requests on the provider's hosts within the limits; `done` gets every run's result exactly once."""

    def __init__(self, provider: Provider, hosts: dict[str, int], clock: Clock, *, max_concurrent: int | None = None,
                 max_queued: int = 4096, retries: int = 2, backoff_seconds: float = 0.2, probe_after_failures: int = 3,
                 readmit_seconds: float = 30.0, request_timeout: float | None = None, weights: dict[str, float] | None = None,
                 window: int = 4096, seed: int = 0):
        if not hosts:
            raise ValueError("a pool needs hosts")
        self.provider, self.clock = provider, clock
        self.hosts = {name: _Host(name, capacity) for name, capacity in hosts.items()}
        self.max_concurrent = max_concurrent or sum(hosts.values())
        self.max_queued, self.retries, self.backoff_seconds = max_queued, retries, backoff_seconds
        self.probe_after_failures, self.readmit_seconds, self.request_timeout = probe_after_failures, readmit_seconds, request_timeout
        self.metrics = FleetMetrics(window)
        weights = weights or {}
        self._unit = min(weights.values(), default=1.0)
        self._weights = weights
        self._sets: dict[str, _TaskSet] = {}
        self._active: deque[_TaskSet] = deque()
        self._ready: deque[_Host] = deque()
        for host in self.hosts.values():
            self._release(host)
        self._queued = 0
        self._running = 0
        self._alive = len(self.hosts)
        self._tokens = itertools.count(1)
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)
        self._waiting = 0
        self._pumping = self._pump_again = False
        self._closed = False

    # --- submitting ---

    def submit(self, request: SandboxRequest, task_set: str, done: Callable[[SandboxResult], None], wait: bool = True) -> bool:
        """Queue `request`; while the queue is full, wait for room (False at once when not `wait`)."""
        with self._lock:
            while self._queued >= self.max_queued and not self._closed:
                if not wait:
                    self.metrics.refused += 1
                    return False
                self._waiting += 1
                try:
                    self._room.wait()
                finally:
                    self._waiting -= 1
            if self._closed:
                raise RuntimeError("the sandbox pool is closed")
            self._enqueue(_Job(request, self._task_set(task_set), done, self.clock.now()), front=False)
            self._pump()
            return True

    def _task_set(self, name: str) -> _TaskSet:
        found = self._sets.get(name)
        if found is None:
            # The lightest set gets one run per round, the others in proportion to their weights.
            found = self._sets[name] = _TaskSet(name, self._weights.get(name, self._unit) / self._unit)
        return found

    def _enqueue(self, job: _Job, front: bool) -> None:
        ts = job.task_set
        (ts.jobs.appendleft if front else ts.jobs.append)(job)
        self._queued += 1
        if not ts.active:
            ts.active = True
            ts.deficit = 0.0
            self._active.append(ts)
            if len(self._active) == 1:
                ts.deficit = ts.quantum

    def _next_job(self) -> _Job:
        """Deficit round-robin over the task sets with queued runs; the head of `_active` holds its turn's quantum."""
        while True:
            ts = self._active[0]
            if ts.deficit >= 1.0:
                ts.deficit -= 1.0
                job = ts.jobs.popleft()
                ts.dispatched += 1
                if not ts.jobs:
                    ts.active = False
                    self._active.popleft()
                    if self._active:
                        self._active[0].deficit += self._active[0].quantum
                self._queued -= 1
                if self._waiting:
                    self._room.notify()
                return job
            self._active.rotate(-1)
            self._active[0].deficit += self._active[0].quantum

    # --- dispatching ---

    def _pump(self) -> None:
        """Send queued runs to free hosts (re-entrant: a provider may answer from inside `start`)."""
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        try:
            self._pump_again = True
            while self._pump_again:
                self._pump_again = False
                while self._queued and self._running < self.max_concurrent:
                    host = self._free_host()
                    if host is None:
                        if not self._alive:
                            self._fail_queued()
                        break
                    self._start(self._next_job(), host)
        finally:
            self._pumping = False

    def _free_host(self) -> _Host | None:
        """The next host with a free slot, round-robin (hosts without one leave the round until a slot frees)."""
        while self._ready:
            host = self._ready.popleft()
            if host.state != "up" or host.running >= host.capacity:
                host.ready = False
                continue
            if host.running + 1 < host.capacity:
                self._ready.append(host)
            else:
                host.ready = False
            return host
        return None

    def _release(self, host: _Host) -> None:
        if host.state == "up" and not host.ready and host.running < host.capacity:
            host.ready = True
            self._ready.append(host)

    def _start(self, job: _Job, host: _Host) -> None:
        now = self.clock.now()
        token = next(self._tokens)
        job.token, job.host, job.dispatched, job.started = token, host, now, False
        self.metrics.queue_wait.append(now - job.enqueued)
        host.running += 1
        host.runs += 1
        self._running += 1
        if self.request_timeout is not None:
            self.clock.call_at(now + self.request_timeout, lambda: self._timed_out(job, token))
        self.provider.start(host.name, token, job.request, lambda: self._started(job, token),
                            lambda outcome: self._finished(job, token, outcome))

    def _started(self, job: _Job, token: int) -> None:
        with self._lock:
            if job.token == token and not job.started:
                job.started = True
                self.metrics.start_latency.append(self.clock.now() - job.dispatched)

    def _timed_out(self, job: _Job, token: int) -> None:
        with self._lock:
            if job.token == token:
                self.provider.cancel(job.host.name, token)
                self._finished(job, token, Failure("timeout", f"no result within {self.request_timeout:.0f} s"))

    def _finished(self, job: _Job, token: int, outcome: Outcome) -> None:
        with self._lock:
            if job.token != token:
                return  # an attempt that timed out and was retried
            job.token = 0
            host = job.host

            host.running -= 1
            self._running -= 1
            self._release(host)
            if isinstance(outcome, SandboxResult) and not outcome.infra_failure:
                host.failures = 0
                self.metrics.completed += 1
                job.request = None  # timers may hold the job a while: not its program
                job.done(outcome)
            else:
                failure = outcome if isinstance(outcome, Failure) else Failure("sandbox_infra", outcome.detail)
                self._host_failed(host, failure)
                self._retry_or_give_up(job, failure, outcome if isinstance(outcome, SandboxResult) else None)
            self._pump()

    # --- failures and health ---

    def _retry_or_give_up(self, job: _Job, failure: Failure, result: SandboxResult | None) -> None:
        job.attempt += 1
        if job.attempt > self.retries or self._closed:
            self.metrics.infra_failures += 1
            job.request = None
            job.done(result or _infra_result(f"{failure.cause}: {failure.detail} (after {job.attempt} attempt(s))"))
            return
        self.metrics.retried += 1
        delay = min(MAX_BACKOFF_SECONDS, self.backoff_seconds * 2 ** (job.attempt - 1)) * self._rng.uniform(0.5, 1.5)
        self.clock.call_at(self.clock.now() + delay, lambda: self._requeue(job))

    def _requeue(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                return job.done(_infra_result("the sandbox pool closed"))
            job.enqueued = self.clock.now()
            self._enqueue(job, front=True)  # it has waited its turn already
            self._pump()

    def _fail_queued(self) -> None:
        down = "; ".join(f"{h.name}: {h.last_failure}" for h in self.hosts.values())
        while self._queued:
            job = self._next_job()
            self.metrics.infra_failures += 1
            job.done(_infra_result(f"no sandbox host is up ({down})"))

    def _host_failed(self, host: _Host, failure: Failure) -> None:
        host.failed += 1
        host.last_failure = f"{failure.cause}: {failure.detail}"[:300]
        self.metrics.failures[failure.cause] += 1
        if failure.cause in HOST_LOST:
            return self._remove(host, failure)
        host.failures += 1
        if host.failures >= self.probe_after_failures and host.state == "up":
            log.warning("sandbox host %s: %d failures in a row (%s); probing it", host.name, host.failures, host.last_failure)
            self._probe(host, "probing")

    def _set_state(self, host: _Host, state: str) -> None:
        self._alive += (state in ALIVE) - (host.state in ALIVE)
        host.state = state

    def _probe(self, host: _Host, state: str) -> None:
        self._set_state(host, state)
        self.provider.probe(host.name, lambda found: self._probed(host, state, found))

    def _probed(self, host: _Host, state: str, failure: Failure | None) -> None:
        """A probe's answer: a suspect host stays or goes; a removed one is re-admitted or waits another cool-down."""
        with self._lock:
            if self._closed or host.state != state:
                return  # removed meanwhile (its connection was lost), or the pool closed
            if failure is None:
                self._set_state(host, "up")
                host.failures = 0
                if state == "rejoining":
                    host.readmitted += 1
                    log.warning("sandbox host %s re-admitted", host.name)
                self._release(host)
                self._pump()
                return
            self.metrics.failures["probe_failed"] += 1
            host.last_failure = f"{failure.cause}: {failure.detail}"[:300]
            if state == "probing":
                self._remove(host, failure)
            else:
                self._set_state(host, "down")
                self.clock.call_at(self.clock.now() + self.readmit_seconds, lambda: self._rejoin(host))

    def _remove(self, host: _Host, failure: Failure) -> None:
        if host.state in ("down", "rejoining"):
            return
        self._set_state(host, "down")
        host.removed += 1
        log.warning("sandbox host %s removed (%s: %s); probing it again in %.0f s", host.name, failure.cause, failure.detail,
                    self.readmit_seconds)
        self.clock.call_at(self.clock.now() + self.readmit_seconds, lambda: self._rejoin(host))
        self._pump()

    def _rejoin(self, host: _Host) -> None:
        with self._lock:
            if not self._closed and host.state == "down":
                self._probe(host, "rejoining")

    # --- reading ---

    def snapshot(self) -> dict:
        """The pool's figures, compact (for rollout_metrics.jsonl and the console)."""
        with self._lock:
            waits, starts = sorted(self.metrics.queue_wait), sorted(self.metrics.start_latency)
            m = self.metrics
            figures = {f"sandbox_queue_wait_p{q}": round(percentile(waits, q), 4) for q in (50, 95, 99)}
            figures |= {f"sandbox_start_p{q}": round(percentile(starts, q), 4) for q in (50, 95, 99)}
            return figures | {
                "sandbox_hosts_up": sum(h.state == "up" for h in self.hosts.values()),
                "sandbox_hosts": len(self.hosts),
                "sandbox_queued": self._queued,
                "sandbox_running": self._running,
                "sandbox_completed": m.completed,
                "sandbox_retries": m.retried,
                "sandbox_infra_failures": m.infra_failures,
                "sandbox_failures": dict(m.failures),
                "sandbox_host_runs": {h.name: h.runs for h in self.hosts.values()},
            }

    def dispatched_by_task_set(self) -> dict[str, int]:
        with self._lock:
            return {name: ts.dispatched for name, ts in self._sets.items()}

    def close(self) -> None:
        """Refuse new runs and stop probing; runs still queued end as infra_failure."""
        with self._lock:
            self._closed = True
            self._room.notify_all()
            while self._queued:
                job = self._next_job()
                job.done(_infra_result("the sandbox pool closed"))


def _infra_result(detail: str) -> SandboxResult:
    return SandboxResult(0.0, 0, 0, "infra", detail, "", "", 0.0, infra_failure=True)


# --- real hosts ---------------------------------------------------------------------------------------


class SandboxHost(ABC):
    """One host's sandboxes, as the `HostsProvider` reaches them."""

    name: str
    capacity: int
    isolation: Isolation

    @abstractmethod
    def start(self, number: int, request: SandboxRequest, started: Callable[[], None], done: Callable[[Outcome], None]) -> None: ...

    def cancel(self, number: int) -> None:
        """Forget a run; the host's own wall-clock limit ends it."""

    @abstractmethod
    def probe(self, done: Callable[[Failure | None], None]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def _probe_verdict(outcome: Outcome) -> Failure | None:
    if isinstance(outcome, Failure):
        return outcome
    if outcome.reward == 1.0:
        return None
    return Failure("probe_failed", f"the probe program scored {outcome.reward} ({outcome.status}: {outcome.detail})")


class LocalSandboxHost(SandboxHost):
    """Sandboxes on this machine: the real Sandbox, one thread per concurrent run."""

    def __init__(self, config: SandboxSection, root: Path | None, capacity: int | None):
        import os

        self.name = LOCALHOST
        self.sandbox = Sandbox(config.model_copy(update={"infra_retries": 0}), root=root)
        self.isolation = self.sandbox.isolation
        self.capacity = capacity or os.cpu_count() or 1
        self._threads = ThreadPoolExecutor(max_workers=self.capacity + 1, thread_name_prefix="sandbox")

    def start(self, number: int, request: SandboxRequest, started: Callable[[], None], done: Callable[[Outcome], None]) -> None:
        def run() -> None:
            started()
            try:
                outcome: Outcome = serve_request(self.sandbox, request)
            except Exception as e:
                outcome = Failure("error", f"{type(e).__name__}: {e}")
            done(outcome)
        self._threads.submit(run)

    def probe(self, done: Callable[[Failure | None], None]) -> None:
        self.start(0, PROBE, lambda: None, lambda outcome: done(_probe_verdict(outcome)))

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


class RemoteSandboxHost(SandboxHost):
    """A host over SSH (cluster.ssh, host keys checked), running one `rollout.sandbox_server` started with its
    composer; runs are frames over the session's stdin/stdout, answered by id. The server ends with the connection."""

    def __init__(self, name: str, config: SandboxSection, ssh: SSHSection, python: str, capacity: int | None):
        self.name, self._config, self._ssh, self._python, self._asked = name, config, ssh, python, capacity
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        """One frame at a time on the channel (runs and probes are sent from different threads)."""
        self._pending: dict[int, tuple[object, Callable[[], None], Callable[[Outcome], None]]] = {}
        """Runs sent and not answered: the channel they went out on, and their callbacks."""
        self._probes = itertools.count(-1, -1)
        self._host = self._channel = None
        self._errors: deque[str] = deque(maxlen=20)
        self._connect()
        self.capacity = capacity or self._cpus

    def _connect(self) -> None:
        """SSH to the host, start its server and wait for it to be ready (UserError when it cannot be)."""
        from cluster.ssh import SSHHost

        host = SSHHost(self.name, self._ssh)
        self.where = host.where
        try:
            channel = host.conn.client.get_transport().open_session()
            channel.exec_command(shlex.join([self._python, "-m", SERVER_MODULE]))
            channel.settimeout(CONNECT_SECONDS)
            channel.sendall(frame_bytes({"op": "hello", "sandbox": self._config.model_dump(), "threads": self._asked}))
            threading.Thread(target=self._drain_errors, args=(channel,), daemon=True, name=f"sandbox-{self.name}-stderr").start()
            reply = read_frame(_channel_reader(channel))
        except Exception as e:
            host.close()
            if isinstance(e, (OSError, ProtocolError)):
                raise UserError(f"sandbox host {self.where}: its sandbox server did not start ({e}) {self._said()}") from None
            raise host.explain(e) from None
        if reply is None or reply["op"] != "ready":
            host.close()
            said = reply.get("error") if reply else self._said()
            raise UserError(f"sandbox host {self.where}: its sandbox server ({self._python} -m {SERVER_MODULE}) did not start: {said}; "
                            "env.sandbox.remote_python names the Python of the composer installed there")
        channel.settimeout(None)
        self._cpus = int(reply["cpus"])
        self.isolation = Isolation(**reply["isolation"])
        with self._lock:
            self._host, self._channel = host, channel
        threading.Thread(target=self._read, args=(channel,), daemon=True, name=f"sandbox-{self.name}").start()

    def _said(self) -> str:
        time.sleep(0.2)  # the server's last words may still be on their way
        return f"(the host said: {' | '.join(self._errors)})" if self._errors else ""

    def _drain_errors(self, channel) -> None:
        """The server's stderr (its logs): into this log, the last lines kept for error messages."""
        buffer = b""
        while True:
            try:
                chunk = channel.recv_stderr(1 << 16)
            except TimeoutError:  # the channel's timeout while the server starts
                continue
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace").strip()
                if text:
                    self._errors.append(text[:300])
                    log.info("sandbox host %s: %s", self.name, text)

    def _read(self, channel) -> None:
        read = _channel_reader(channel)
        reason = "the SSH connection ended"
        while True:
            try:
                message = read_frame(read)
            except (ProtocolError, OSError) as e:
                reason = f"the connection broke ({e})"
                break
            if message is None:
                break
            with self._lock:
                callbacks = self._pending.get(message.get("id"))
                if message["op"] in ("result", "failed"):
                    self._pending.pop(message.get("id"), None)
            if callbacks is None:
                continue
            _, started, done = callbacks
            if message["op"] == "started":
                started()
            elif message["op"] == "failed":
                done(Failure("server_error", str(message.get("error"))[:500]))
            else:
                try:
                    result = from_wire(message.get("result"))
                    if not isinstance(result, SandboxResult):
                        raise ProtocolError("not a result")
                except (ProtocolError, ValueError) as e:
                    done(Failure("protocol", f"a result that is not one: {e}"))
                    continue
                done(result)
        self._lost(channel, f"{reason} {self._said()}".strip())

    def _lost(self, channel, reason: str) -> None:
        """`channel` is gone: the runs sent on it fail (a newer connection's runs are not its)."""
        with self._lock:
            if self._channel is channel:
                self._channel = None
            lost = [n for n, (sent_on, _, _) in self._pending.items() if sent_on is channel]
            callbacks = [self._pending.pop(n)[2] for n in lost]
        for done in callbacks:
            done(Failure("connection_lost", f"{self.where}: {reason}"))

    def start(self, number: int, request: SandboxRequest, started: Callable[[], None], done: Callable[[Outcome], None]) -> None:
        frame = frame_bytes({"op": "run", "id": number, "request": to_wire(request)})
        with self._lock:
            channel = self._channel
            if channel is not None:
                self._pending[number] = (channel, started, done)
        if channel is None:
            return done(Failure("connection_lost", f"{self.where}: not connected"))
        try:
            with self._send_lock:
                channel.sendall(frame)
        except OSError as e:
            self._lost(channel, f"sending failed ({e})")

    def cancel(self, number: int) -> None:
        with self._lock:
            self._pending.pop(number, None)

    def probe(self, done: Callable[[Failure | None], None]) -> None:
        def check() -> None:
            if self._channel is None:
                self._hang_up()
                try:
                    self._connect()
                except UserError as e:
                    return done(Failure("unreachable", str(e)))
            finished = threading.Event()
            outcome: list[Outcome] = []
            number = next(self._probes)
            self.start(number, PROBE, lambda: None, lambda o: (outcome.append(o), finished.set()))
            if not finished.wait(PROBE_SECONDS):
                self.cancel(number)
                return done(Failure("probe_failed", f"no probe result within {PROBE_SECONDS:.0f} s"))
            done(_probe_verdict(outcome[0]))
        threading.Thread(target=check, daemon=True, name=f"sandbox-{self.name}-probe").start()

    def _hang_up(self) -> None:
        with self._lock:
            host, channel, self._host, self._channel = self._host, self._channel, None, None
        if channel is not None:
            try:
                channel.shutdown_write()  # the server's stdin ends: it exits
                deadline = time.monotonic() + 5
                while not channel.exit_status_ready() and time.monotonic() < deadline:
                    time.sleep(0.05)
            except OSError:
                pass
        if host is not None:
            host.close()

    def close(self) -> None:
        channel = self._channel
        self._hang_up()
        if channel is not None:
            self._lost(channel, "the fleet closed")


def _channel_reader(channel):
    def read_exactly(n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = channel.recv(left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    return read_exactly


class HostsProvider(Provider):
    """The provider of real hosts: each run goes to its host's `SandboxHost`."""

    def __init__(self, hosts: list[SandboxHost]):
        self.by_name = {host.name: host for host in hosts}

    def start(self, host, number, request, started, done):
        self.by_name[host].start(number, request, started, done)

    def cancel(self, host, number):
        self.by_name[host].cancel(number)

    def probe(self, host, done):
        self.by_name[host].probe(done)

    def close(self) -> None:
        for host in self.by_name.values():
            host.close()


# --- the fleet the environment uses -------------------------------------------------------------------


class SandboxFleet:
    """`run` like a Sandbox's, on whichever host of the fleet has room; `submit` for a Future."""

    def __init__(self, config: SandboxSection, ssh: SSHSection, root: Path | None = None, weights: dict[str, float] | None = None):
        hosts = _open_hosts(config, ssh, root)
        self.provider = HostsProvider(hosts)
        self.isolations = {host.name: host.isolation for host in hosts}
        self.capacities = {host.name: host.capacity for host in hosts}
        self.clock = RealClock()
        self.pool = SandboxPool(
            self.provider, self.capacities, self.clock, max_concurrent=config.max_concurrent, max_queued=config.max_queued,
            retries=config.infra_retries, backoff_seconds=config.retry_backoff_seconds,
            probe_after_failures=config.probe_after_failures, readmit_seconds=config.readmit_seconds,
            # well past the run's own limits (two wall-clock limits: loading, then the tests) and the round trip
            request_timeout=3 * config.wall_seconds + 60, weights=weights)

    @property
    def max_concurrent(self) -> int:
        return self.pool.max_concurrent

    def submit(self, request: SandboxRequest, task_set: str = "default") -> Future:
        """Queue `request` (waiting while the queue is full); the Future holds its SandboxResult."""
        future: Future = Future()
        self.pool.submit(request, task_set, future.set_result)
        return future

    def run(self, program: str, tests: Tests, reward: RewardMode = "fraction", task_set: str = "default") -> SandboxResult:
        return self.submit(RunRequest(program, tests, reward), task_set).result()

    def metrics(self) -> dict:
        return self.pool.snapshot()

    def close(self) -> None:
        self.pool.close()
        self.clock.close()
        self.provider.close()


def _open_hosts(config: SandboxSection, ssh: SSHSection, root: Path | None) -> list[SandboxHost]:
    """Every host of `config.hosts`, connected in parallel; a host that cannot be reached is an error (a wrong
    host list should stop the run, not shrink the fleet without a word), and the others are closed again."""
    names = config.hosts
    python = config.remote_python or sys.executable

    def open_one(name: str) -> SandboxHost:
        if name == LOCALHOST:
            return LocalSandboxHost(config, root, config.sandboxes_per_host)
        return RemoteSandboxHost(name, config, ssh, python, config.sandboxes_per_host)

    with ThreadPoolExecutor(max_workers=len(names)) as threads:
        futures = [threads.submit(open_one, name) for name in names]
    opened = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for host in opened:
            host.close()
        raise errors[0] if isinstance(errors[0], UserError) else UserError(f"env.sandbox.hosts: {errors[0]}")
    return opened
