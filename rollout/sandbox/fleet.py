"""The sandbox fleet's scheduling core: every sandbox run of a rollout goes through one pool that spreads it over
the hosts of `env.sandbox.hosts` (the real hosts, this one and SSH-reached ones, are in `rollout.sandbox.hosts`).

The pool (`SandboxPool`) is independent of the transport: it sees hosts only through a `Provider` and time only
through a `Clock`, so the simulation (`benchmarks/fleet_sim.py`) drives the same code with a simulated provider on
a simulated clock. It keeps
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
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from composer.rollout.sandbox.results import SandboxResult
from composer.rollout.sandbox.wire import SandboxRequest

log = logging.getLogger("composer.fleet")

HOST_LOST = ("connection_lost", "unreachable")
"""Failure causes that remove a host at once (no probe can reach it)."""
ALIVE = ("up", "probing")
"""Host states in which runs wait for it (a suspect host may pass its probe)."""
MAX_BACKOFF_SECONDS = 30.0


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
    def start(self, host: str, number: int, request: SandboxRequest, started: Callable[[], None], done: Callable[[Outcome], None]) -> None:
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
        """Seconds from being sent to a host to the host starting the run's sandbox (the provider's `started`: for an
        SSH host, the request crossed the channel and its server began the run; the fork and isolation are in the run)."""
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

    def __init__(
        self,
        provider: Provider,
        hosts: dict[str, int],
        clock: Clock,
        *,
        max_concurrent: int | None = None,
        max_queued: int = 4096,
        retries: int = 2,
        backoff_seconds: float = 0.2,
        probe_after_failures: int = 3,
        readmit_seconds: float = 30.0,
        request_timeout: float | None = None,
        weights: dict[str, float] | None = None,
        window: int = 4096,
        seed: int = 0,
    ):
        if not hosts:
            raise ValueError("a pool needs hosts")
        self.provider, self.clock = provider, clock
        self.hosts = {name: _Host(name, capacity) for name, capacity in hosts.items()}
        self._concurrent_limit = max_concurrent
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
        self._deadlines: OrderedDict[int, _Job] = OrderedDict()
        """Runs on hosts by token, in dispatch order: with one request_timeout, also the order they time out in. One
        timer watches the first (not one per run: a timer would hold its finished run for request_timeout)."""
        self._deadline_timer = False
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)
        self._waiting = 0
        self._pumping = self._pump_again = False
        self._closed = False

    def add_host(self, name: str, capacity: int) -> None:
        """A host that joins after the pool started (a sandbox server that came up later): it takes runs at once."""
        with self._lock:
            if self._closed or name in self.hosts:
                return
            host = self.hosts[name] = _Host(name, capacity)
            self._alive += 1
            if self._concurrent_limit is None:
                self.max_concurrent += capacity
            self._release(host)
            self._pump()

    def host_lost(self, name: str, detail: str) -> None:
        """`name`'s connection ended between runs: removed now, not at its next run (re-admitted by a probe later)."""
        with self._lock:
            host = self.hosts.get(name)
            if host is None or self._closed:
                return
            self._host_failed(host, Failure("connection_lost", detail))
            self._pump()

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
            self._deadlines[token] = job
            if not self._deadline_timer:
                self._watch_deadline(now + self.request_timeout)
        self.provider.start(
            host.name, token, job.request, lambda: self._started(job, token), lambda outcome: self._finished(job, token, outcome)
        )

    def _started(self, job: _Job, token: int) -> None:
        with self._lock:
            if job.token == token and not job.started:
                job.started = True
                self.metrics.start_latency.append(self.clock.now() - job.dispatched)

    def _watch_deadline(self, when: float) -> None:
        self._deadline_timer = True
        self.clock.call_at(when, self._time_out_overdue)

    def _time_out_overdue(self) -> None:
        """Time out every run past its deadline, then watch the next one's (the timer stays armed meanwhile: runs
        started by the retries below join the order without a timer of their own)."""
        with self._lock:
            now = self.clock.now()
            while self._deadlines:
                token, job = next(iter(self._deadlines.items()))
                deadline = job.dispatched + self.request_timeout
                if deadline > now:
                    self.clock.call_at(deadline, self._time_out_overdue)
                    return
                self.provider.cancel(job.host.name, token)
                self._finished(job, token, Failure("timeout", f"no result within {self.request_timeout:.0f} s"))
            self._deadline_timer = False

    def _finished(self, job: _Job, token: int, outcome: Outcome) -> None:
        with self._lock:
            if job.token != token:
                return  # an attempt that timed out and was retried
            job.token = 0
            self._deadlines.pop(token, None)
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
        log.warning(
            "sandbox host %s removed (%s: %s); probing it again in %.0f s", host.name, failure.cause, failure.detail, self.readmit_seconds
        )
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

    @property
    def queued(self) -> int:
        """Runs waiting for a host (a driver submitting in bursts sends the next when this is 0)."""
        return self._queued

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
