"""The real sandbox hosts of the fleet and the fleet the environment uses (`SandboxFleet`): this machine
(`localhost`: the Sandbox in this process, one thread per run) and hosts reached over SSH (cluster.ssh, host keys
checked), each running one sandbox server program (`rollout.sandbox_host`, spoken to in `rollout.sandbox.wire`)
with its own composer, which grades there and ends with the connection. The scheduling is
`rollout.sandbox.fleet.SandboxPool`'s.

The servers of `env.sandbox.slurm` are started by composer as SLURM job steps (`cluster.slurm_steps`), on a node of
the driver's own job or of a job of their own, and speak the same protocol over the step's stdin/stdout. A server
joins the fleet once it has greeted the driver (its `ready` frame is its registration: CPUs and isolation); the
fleet starts with the first one up and takes the others as they come. A server whose step ends (killed, cancelled,
its node drained or dead) is a lost host: its runs fail as `connection_lost` and are retried on the others, and the
pool's re-admission probe (`readmit_seconds` later) starts it again, on another node while one is left (fewest
servers first); a node SLURM reports down or drained is not used again.
"""

from __future__ import annotations

import itertools
import logging
import os
import shlex
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from composer.cluster.slurm_steps import StepJob
from composer.recipes.env_schema import SandboxSection, slurm_server_names
from composer.recipes.errors import UserError
from composer.recipes.schema import SSHSection
from composer.rollout.sandbox.fleet import Failure, Outcome, Provider, RealClock, SandboxPool
from composer.rollout.sandbox.isolation import DEFAULT_ROOT, Isolation
from composer.rollout.sandbox.results import AssertionTests, RewardMode, SandboxResult, Tests
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.sandbox.wire import (
    SANDBOX_TYPES,
    SERVER_MODULE,
    Op,
    ProtocolError,
    RunRequest,
    SandboxRequest,
    exact_reader,
    frame_bytes,
    from_wire,
    read_frame,
    to_wire,
)

log = logging.getLogger("composer.fleet")

LOCALHOST = "localhost"
WORKSPACES_HERE = "rollout.harness: tools keeps function tasks' workspaces (solution.py) on this machine"
PROBE = RunRequest("def probe():\n    return 1\n", AssertionTests(entry_point="probe", setup="", cases=("assert candidate() == 1",)))
"""The health probe: a real run of a trivial program."""
PROBE_SECONDS = 60.0
CONNECT_SECONDS = 120.0
"""A new host's server: SSH, its composer's imports, its sandbox's isolation probe."""


def serve_request(sandbox: Sandbox, request: SandboxRequest) -> SandboxResult:
    """Run `request` in `sandbox` (on whichever host holds it: this machine's, or a host's server program)."""
    return sandbox.run(request.program, request.tests, request.reward)


class SandboxHost(ABC):
    """One host's sandboxes, as the `HostsProvider` reaches them."""

    name: str
    capacity: int
    isolation: Isolation
    on_lost: Callable[[str, str], None] | None = None
    """Told (name, why) when the host's connection ends by itself, between runs too: the fleet removes it at once."""

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
    """A host over SSH (cluster.ssh, host keys checked), running one server program (`wire.SERVER_MODULE`) started
    with its composer; runs are frames over the session's stdin/stdout, answered by id. The server ends with the connection."""

    def __init__(self, name: str, config: SandboxSection, ssh: SSHSection, python: str, capacity: int | None, connect: bool = True):
        self.name, self._config, self._ssh, self._python, self._asked = name, config, ssh, python, capacity
        self.where = name
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        """One frame at a time on the channel (runs and probes are sent from different threads)."""
        self._pending: dict[int, tuple[object, Callable[[], None], Callable[[Outcome], None]]] = {}
        """Runs sent and not answered: the channel they went out on, and their callbacks."""
        self._probes = itertools.count(-1, -1)
        self._requests = itertools.count(1 << 40)
        """Numbers of workspace and shipping operations (never a run's)."""
        self._host = self._channel = None
        self._errors: deque[str] = deque(maxlen=20)
        if connect:
            self.connect()

    def connect(self) -> None:
        """Start the host's server and wait for it to be ready (UserError when it cannot be)."""
        self._connect()
        self.capacity = self._asked or self._cpus

    def _start_server(self):
        """The server program started on the host: (what holds it, with `where`, `close` and `explain`; its channel)."""
        from composer.cluster.ssh import SSHHost

        host = SSHHost(self.name, self._ssh)
        try:
            channel = host.conn.client.get_transport().open_session()
            channel.exec_command(shlex.join(self.server_argv()))
        except Exception as e:
            host.close()
            raise self._start_error(host, e) from None
        return host, channel

    def server_argv(self) -> list[str]:
        return [self._python, "-m", SERVER_MODULE]

    def _start_error(self, host, error: Exception) -> UserError:
        if isinstance(error, (OSError, ProtocolError)):
            return UserError(
                f"sandbox host {host.where}: its sandbox server did not start ({error}) {self._said()}; "
                "env.sandbox.remote_python names the Python of the composer installed there"
            )
        return host.explain(error)

    def _connect(self) -> None:
        host, channel = self._start_server()
        self.where = host.where
        # the server's stderr is read from the start: a server that dies at once (no such Python) says why there
        errors = threading.Thread(target=self._drain_errors, args=(channel,), daemon=True, name=f"sandbox-{self.name}-stderr")
        try:
            channel.settimeout(CONNECT_SECONDS)
            errors.start()
            channel.sendall(frame_bytes({"op": Op.HELLO, "sandbox": self._config.model_dump(), "threads": self._asked}))
            reply = read_frame(exact_reader(channel.recv))
        except Exception as e:
            if isinstance(e, (OSError, ProtocolError)) and errors.ident is not None:
                errors.join(timeout=5)  # a server gone has closed its stderr: its last words are in once it ends
            host.close()
            raise self._start_error(host, e) from None
        if reply is None or reply["op"] != Op.READY:
            host.close()
            said = reply.get("error") if reply else self._said()
            raise UserError(
                f"sandbox host {self.where}: its sandbox server ({self._python} -m {SERVER_MODULE}) did not start: {said}; "
                "env.sandbox.remote_python names the Python of the composer installed there"
            )
        try:
            self._cpus = int(reply["cpus"])
            self.isolation = Isolation(**reply["isolation"])
        except (KeyError, TypeError, ValueError) as e:
            host.close()
            raise UserError(f"sandbox host {self.where}: its sandbox server's greeting is not one this composer reads ({e})") from None
        channel.settimeout(None)
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
        read = exact_reader(channel.recv)
        reason = "the SSH connection ended"
        while True:
            try:
                message = read_frame(read)
            except (ProtocolError, OSError) as e:
                reason = f"the connection broke ({e})"
                break
            if message is None:
                break
            number = message.get("id")
            if type(number) is not int:
                reason = "the server sent a frame without a run id"
                break
            with self._lock:
                callbacks = self._pending.get(number)
                if message["op"] in (Op.RESULT, Op.REPLY, Op.FAILED):
                    self._pending.pop(number, None)
            if callbacks is None:
                continue
            _, started, done = callbacks
            if message["op"] == Op.STARTED:
                started()
            elif message["op"] == Op.REPLY:
                done(message)
            elif message["op"] == Op.FAILED:
                done(Failure("server_error", str(message.get("error"))[:500]))
            else:
                try:
                    result = from_wire(message.get("result"), SANDBOX_TYPES)
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
            current = self._channel is channel
            if current:
                self._channel = None
            lost = [n for n, (sent_on, _, _) in self._pending.items() if sent_on is channel]
            callbacks = [self._pending.pop(n)[2] for n in lost]
        for done in callbacks:
            done(Failure("connection_lost", f"{self.where}: {reason}"))
        if current and self.on_lost is not None:
            self.on_lost(self.name, f"{self.where}: {reason}")

    def start(self, number: int, request: SandboxRequest | dict, started: Callable[[], None], done: Callable[[Outcome], None]) -> None:
        """Send a run (or, as a dict, another operation with its id) on the current connection."""
        frame = frame_bytes(
            request if isinstance(request, dict) else {"op": Op.RUN, "id": number, "request": to_wire(request, SANDBOX_TYPES)}
        )
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

    @property
    def connected(self) -> bool:
        return self._channel is not None

    def send(self, message: dict) -> bool:
        """Send a frame that has no answer of its own (a chunk of a shipped tree); False when not connected."""
        channel = self._channel
        if channel is None:
            return False
        try:
            with self._send_lock:
                channel.sendall(frame_bytes(message))
        except OSError as e:
            self._lost(channel, f"sending failed ({e})")
            return False
        return True

    def request(self, message: dict, timeout_s: float) -> dict | Failure:
        """Send `message` (a workspace or shipping operation) and wait for its reply: the reply frame, or a Failure
        (the connection was lost, the host answered `failed`, or no answer came within `timeout_s`)."""
        number = next(self._requests)
        answered = threading.Event()
        outcome: list = []
        self.start(number, {**message, "id": number}, lambda: None, lambda o: (outcome.append(o), answered.set()))
        if not answered.wait(timeout_s):
            self.cancel(number)
            return Failure("timeout", f"{self.where}: no answer within {timeout_s:.0f} s")
        return outcome[0]

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


class SlurmSandboxHost(RemoteSandboxHost):
    """One server of `env.sandbox.slurm`: a job step whose stdin/stdout is the channel; started again on a node the
    job places it on whenever it reconnects."""

    def __init__(self, name: str, config: SandboxSection, python: str, servers: SlurmServers):
        super().__init__(name, config, SSHSection(), python, config.sandboxes_per_host, connect=False)
        self._servers = servers
        self.node: str | None = None

    def _start_server(self):
        node = self._servers.place(self)
        step = self._servers.job.start(node, self._servers.step_name(self.name), self.server_argv())
        log.info("sandbox server %s: starting on %s", self.name, step.where)
        return step, step


class SlurmServers:
    """Starts every server of `config.slurm` (in parallel) and hands each to `register` once it is ready."""

    def __init__(self, config: SandboxSection, python: str, register: Callable[[SlurmSandboxHost], None]):
        assert config.slurm is not None
        self.config, self._register = config, register
        self._prefix = f"composer-sandbox-{os.getpid()}"
        self.job = StepJob(config.slurm, self._prefix)
        self.hosts = [SlurmSandboxHost(name, config, python, self) for name in slurm_server_names(config.slurm.servers)]
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._settled = threading.Condition(self._lock)
        self._up = 0
        self._first_errors: dict[str, str] = {}
        for host in self.hosts:
            threading.Thread(target=self._bring_up, args=(host,), daemon=True, name=f"sandbox-{host.name}-start").start()

    def step_name(self, server: str) -> str:
        return f"{self._prefix}-{server}"

    def place(self, host: SlurmSandboxHost) -> str:
        """The node for `host`'s next step (see `StepJob.place`)."""
        with self._lock:
            busy = Counter(other.node for other in self.hosts if other is not host and other.connected)
        host.node = self.job.place(busy, previous=host.node)
        return host.node

    def _bring_up(self, host: SlurmSandboxHost) -> None:
        """Start `host` until it is ready (a try every `readmit_seconds`), then register it; the pool's probes
        restart it from then on."""
        while not self._closed.is_set():
            try:
                host.connect()
            except UserError as e:
                log.warning("sandbox server %s did not start: %s", host.name, e)
                with self._lock:
                    self._first_errors.setdefault(host.name, str(e))
                    self._settled.notify_all()
                self._closed.wait(self.config.readmit_seconds)
                continue
            if self._closed.is_set():
                break
            self._register(host)  # a close from now on closes it with the others
            with self._lock:
                self._up += 1
                self._settled.notify_all()
            log.info("sandbox server %s is up on %s (%d at once)", host.name, host.where, host.capacity)
            return
        host.close()

    def wait_for_one(self) -> None:
        """Wait until a server is up; UserError when every one failed its first start (the same mistake, most likely:
        a wrong remote_python, a partition that refuses the steps)."""
        with self._lock:
            while not self._up and len(self._first_errors) < len(self.hosts):
                self._settled.wait()
            if not self._up:
                name, error = next(iter(self._first_errors.items()))
                raise UserError(f"env.sandbox.slurm: no sandbox server started ({name}: {error})")

    def close(self) -> None:
        with self._lock:
            self._closed.set()
        for host in self.hosts:
            host.close()
        self.job.close({self.step_name(host.name) for host in self.hosts})


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
        self.config = config
        self.root = (root or DEFAULT_ROOT).resolve()
        """This machine's sandbox root (where the episodes' workspaces live)."""
        hosts = _open_hosts(config, ssh, root)
        self.provider = HostsProvider(hosts)
        self.isolations = {host.name: host.isolation for host in hosts}
        self.capacities = {host.name: host.capacity for host in hosts}
        self.pool: SandboxPool | None = None
        self._joining = threading.Lock()
        self.slurm: SlurmServers | None = None
        if config.slurm is not None:
            try:
                self.slurm = SlurmServers(config, config.remote_python or sys.executable, self._join)
                self.slurm.wait_for_one()
            except BaseException:
                self.provider.close()
                if self.slurm is not None:
                    self.slurm.close()
                raise
        self.open_workspaces: Counter[str] = Counter()
        """Repository workspaces open on each host (`rollout.tasks.repository.remote` places episodes by it)."""
        self.shipped_bytes: Counter[str] = Counter()
        """Bytes of trees shipped to each host (project files, environments, tasks' changed files)."""
        self.clock = RealClock()
        with self._joining:
            self.pool = self._pool(config, weights)
            for host in self.provider.by_name.values():
                host.on_lost = self.pool.host_lost

    def _pool(self, config: SandboxSection, weights: dict[str, float] | None) -> SandboxPool:
        return SandboxPool(
            self.provider,
            dict(self.capacities),
            self.clock,
            max_concurrent=config.max_concurrent,
            max_queued=config.max_queued,
            retries=config.infra_retries,
            backoff_seconds=config.retry_backoff_seconds,
            probe_after_failures=config.probe_after_failures,
            readmit_seconds=config.readmit_seconds,
            # well past the run's own limits (two wall-clock limits: loading, then the tests) and the round trip
            request_timeout=3 * config.wall_seconds + 60,
            weights=weights,
        )

    def _join(self, host: SandboxHost) -> None:
        """A host that came up after the fleet opened (a SLURM-started server): in the maps, then in the pool."""
        with self._joining:
            # new dicts, not changed ones: readers iterate them without a lock
            self.provider.by_name = {**self.provider.by_name, host.name: host}
            self.isolations = {**self.isolations, host.name: host.isolation}
            self.capacities = {**self.capacities, host.name: host.capacity}
            if self.pool is not None:
                host.on_lost = self.pool.host_lost
                self.pool.add_host(host.name, host.capacity)

    @property
    def max_concurrent(self) -> int:
        return self.pool.max_concurrent

    @property
    def local(self) -> Sandbox:
        """This machine's sandbox: function tasks' workspaces live here and run their commands here."""
        host = self.provider.by_name.get(LOCALHOST)
        if not isinstance(host, LocalSandboxHost):
            raise UserError(f"{WORKSPACES_HERE}: env.sandbox.hosts must include localhost")
        return host.sandbox

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
        if self.slurm is not None:
            self.slurm.close()
        self.provider.close()


def _open_hosts(config: SandboxSection, ssh: SSHSection, root: Path | None) -> list[SandboxHost]:
    """Every host of `config.hosts`, connected in parallel; a host that cannot be reached is an error (a wrong
    host list should stop the run, not shrink the fleet without a word), and the others are closed again."""
    names = config.hosts
    if not names:
        return []
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
