"""Where rollout engines run: this host, or remote hosts reached over SSH.

A host turns a policy version in the sync store into a weights directory its engines can load, and starts its
engines, and moves an engine to a new version: in place from the delta (only the layers whose tensors changed
are reloaded, read from the receiver's copy, which is patched where it differs) whenever the engine holds an
earlier version of the same tensors, else by a full reload. A remote host runs the composer installed there (`rollout.remote_python`) to pull from the store, and
vLLM servers bound to its loopback, reached through SSH port forwards, so their weight-update endpoints are never
exposed on the network. What a remote host starts ends when the SSH connection does: a driver killed with -9
leaves nothing running there.

An engine larger than one host (rollout.parallelism) runs on consecutive remote hosts of rollout.hosts in vLLM's own
multi-node modes (`EngineHosts`): every host of it pulls each policy into its own receiver, the first serves the
engine's API, the others run its headless ranks, each part in an SSH session of its host; when one part exits the
whole engine is restarted on the policy its hosts hold.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from composer.cluster.placement import (
    PROBE,
    EnginePlacement,
    HostDevices,
    HostPlacement,
    local_devices,
    place_fleet,
    place_host,
    planned_devices,
)
from composer.cluster.ssh import SSHHost
from composer.recipes.errors import UserError
from composer.recipes.schema import Recipe, RolloutSection, SSHSection, SyncSection
from composer.rl.protocol import RLRunFiles, sync_section
from composer.rollout.engines import server_guard
from composer.rollout.engines.vllm_engine import (
    Engine,
    RankReports,
    ServerEngine,
    ServerUnreachable,
    VllmServer,
    build_engines,
    checkpoint_config,
    engine_options,
    multinode_args,
    server_args,
    server_env,
    wait_healthy,
)
from composer.rollout.engines.worker_extension import read_rank_reports
from composer.runtime.run_dir import atomic_write_text
from composer.sync.receiver import pull, update_in_place
from composer.sync.store import Store

T = TypeVar("T")

SERVER_STOP_SECONDS = 30
ENGINE_RESTARTS = 3
"""Restarts of an engine over several hosts in one run (after a part of it exited) before the run stops."""
_FREE_PORTS = "import sys; from composer.runtime.processes import free_port; print(*(free_port() for _ in range(int(sys.argv[1]))))"
"""Run by the host's composer: free ports there."""


class _EngineVersions:
    """Which store version each engine of a host holds, and how to bring one to another."""

    def __init__(self):
        self._held: dict[int, str] = {}

    def started(self, engines: list[Engine], store_version: str) -> None:
        self._held.update((id(engine), store_version) for engine in engines)

    def move(self, engine: Engine, store: Store, store_version: str, weights: str) -> None:
        """`weights` holds `store_version`: load only what changed since the engine's version, or all of it."""
        held = self._held.get(id(engine))
        if held != store_version:
            target = store.manifest(store_version)
            before = store.manifest(held) if held in store.versions() else None  # gc may have dropped it
            if before is not None and target.same_tensors(before):
                engine.update_weights(weights, target.differing_tensors(before), target.piece_hashes())
            else:
                engine.load_weights(weights)
        self._held[id(engine)] = store_version


class LocalHost:
    """This host: the run directory's receiver, an embedded engine or local vLLM servers."""

    name = "localhost"

    def __init__(self, recipe: Recipe, files: RLRunFiles):
        self.recipe = recipe
        self.files = files
        self.lock = threading.Lock()
        """Held by an engine of this host while it pulls and loads a policy."""
        self.servers: list[VllmServer] = []
        self.engine_versions = _EngineVersions()
        self._pulled: str | None = None

    def _store(self) -> Store:
        sync = sync_section(self.recipe, self.files)
        return Store.open(sync.store, self.recipe.cluster.ssh, endpoint=sync.endpoint)

    def pull(self, store_version: str) -> str:
        with self._store() as store:
            pull(store, self.files.receiver, store_version)
        self._pulled = store_version
        return str((self.files.receiver / "current").resolve())

    def update(self, engine: Engine, store_version: str) -> None:
        """Bring one of this host's engines to `store_version` (call with `lock` held)."""
        with self._store() as store:
            update_in_place(store, self.files.receiver, store_version)
            self.engine_versions.move(engine, store, store_version, str((self.files.receiver / "current").resolve()))

    def devices(self) -> HostDevices:
        return local_devices()

    def placement(self) -> HostPlacement:
        """Which devices this host's engines (and learner ranks) get; refused before anything starts if they do not fit."""
        return host_placement(self.name, self.devices(), self.recipe)

    def start_engines(self, weights: str, seed: int, routed_experts: bool) -> list[Engine]:
        engines, self.servers = build_engines(
            self.recipe.rollout, weights, self.placement(), seed=seed, routed_experts=routed_experts, log_dir=self.files.root / "logs"
        )
        self.engine_versions.started(engines, self._pulled)
        return engines

    def close(self) -> None:
        for server in self.servers:
            server.stop()


@dataclass
class ServerPart:
    """A vLLM server, or an engine's headless ranks, in an SSH session of its host: it runs until the session's input
    ends (the driver stops it, or dies), and the session ends when it exits."""

    host: RemoteHost
    session: object
    """Its paramiko channel."""
    log: str
    stopped: bool = False

    def running(self) -> bool:
        """False once the server exited, or its host's connection is gone (paramiko then closes the session)."""
        return not self.session.exit_status_ready() and not self.session.closed

    @property
    def where(self) -> str:
        return f"{self.host.ssh.where}:{self.log}"


def stop_parts(parts: list[ServerPart]) -> None:
    """End the parts' session input (their servers are killed), wait for them, close the sessions."""
    parts = [part for part in parts if not part.stopped]
    for part in parts:
        part.stopped = True
        try:
            part.session.shutdown_write()
        except Exception:  # the connection is gone: so is the session, and the server with it
            pass
    deadline = time.monotonic() + SERVER_STOP_SECONDS
    for part in parts:
        while part.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        part.session.close()


class RemoteHost:
    """A rollout host over SSH (cluster.ssh): its own receiver under rollout.remote_dir, its own vLLM servers."""

    def __init__(self, name: str, recipe: Recipe, files: RLRunFiles):
        self.name = name
        self.recipe = recipe
        self.files = files
        self.lock = threading.Lock()
        self.ssh = SSHHost(name, recipe.cluster.ssh)
        self.python = recipe.rollout.remote_python or sys.executable
        self.dir = posixpath.join(recipe.rollout.remote_dir, recipe.run.name)
        self.receiver = posixpath.join(self.dir, "receiver")
        self._pulled: tuple[str, str] | None = None
        """(store version, weights directory) of the newest pull."""
        self._devices: HostDevices | None = None
        self._parts: list[ServerPart] = []
        self._logs: list[str] = []
        """The vLLM servers' logs there, copied into the run's logs/ when the host closes."""
        self.engine_versions = _EngineVersions()
        self._run(f"mkdir -p {shlex.quote(self.dir)}")
        store = sync_section(recipe, files).store
        if not store.startswith("ssh://"):
            self._refuse_unseen_store(Path(store))

    def _refuse_unseen_store(self, store: Path) -> None:
        """A directory store must be one the host mounts too: it pulls every policy from there itself."""
        probe = store / f".probe-{uuid.uuid4().hex}"
        atomic_write_text(probe, probe.name)
        try:
            seen = self._run(f"cat {shlex.quote(str(probe))} 2>/dev/null || true").strip() == probe.name
        finally:
            probe.unlink()
        if not seen:
            raise UserError(
                f"rollout host {self.ssh.where} does not see the sync store {store} (a directory on this machine); "
                "set sync.store to a directory every rollout host mounts, or to an ssh:// store they can reach"
            )

    def _run(self, command: str) -> str:
        try:
            result = self.ssh.conn.run(command, hide=True, warn=True, in_stream=False)
        except Exception as e:
            raise self.ssh.explain(e) from None
        if result.exited != 0:
            said = (result.stderr.strip() or result.stdout.strip()).splitlines()[-3:]
            raise UserError(f"rollout host {self.ssh.where}: `{command[:120]}` failed (exit {result.exited}): {' '.join(said)}")
        return result.stdout

    def _composer(self, *args: str) -> str:
        return self._run(shlex.join([self.python, "-m", "composer.cli", *args]))

    def pull(self, store_version: str) -> str:
        if self._pulled is None or self._pulled[0] != store_version:
            sync = sync_section(self.recipe, self.files)
            self._composer("sync", "pull", *_store_args(sync, self.recipe.cluster.ssh), "--to", self.receiver, "--version", store_version)
            self._pulled = (store_version, self._run(f"readlink -f {shlex.quote(self.receiver + '/current')}").strip())
        return self._pulled[1]

    def pull_in_place(self, store_version: str) -> str:
        """Bring the host's receiver to `store_version` by patching its current version's files (its composer's
        `sync pull --in-place`); the directory that holds it now."""
        if self._pulled is None or self._pulled[0] != store_version:
            sync = sync_section(self.recipe, self.files)
            self._composer(
                "sync", "pull", *_store_args(sync, self.recipe.cluster.ssh), "--to", self.receiver, "--version", store_version, "--in-place"
            )
            self._pulled = (store_version, self._run(f"readlink -f {shlex.quote(self.receiver + '/current')}").strip())
        return self._pulled[1]

    def update(self, engine: Engine, store_version: str) -> None:
        """Bring one of this host's engines to `store_version`: the host's receiver is patched in place by its
        composer, the engine reloads what changed from it (call with `lock` held)."""
        weights = self.pull_in_place(store_version)
        sync = sync_section(self.recipe, self.files)
        with Store.open(sync.store, self.recipe.cluster.ssh, endpoint=sync.endpoint) as store:
            self.engine_versions.move(engine, store, store_version, weights)

    def devices(self) -> HostDevices:
        """What the host has, as its own Python reports it (asked once, over SSH)."""
        if self._devices is None:
            self._devices = HostDevices.from_probe(self._run(shlex.join([self.python, "-c", PROBE])))
        return self._devices

    def placement(self, *, node_rank: int = 0, engine_base: int = 0) -> HostPlacement:
        """As `LocalHost.placement`, with the devices the host reports; `node_rank`: which host of an engine over
        several hosts this is, of the fleet's engine `engine_base`."""
        return host_placement(self.name, self.devices(), self.recipe, node_rank=node_rank, engine_base=engine_base)

    def free_ports(self, count: int) -> list[int]:
        return [int(port) for port in self._run(shlex.join([self.python, "-c", _FREE_PORTS, str(count)])).split()]

    def has_tokenizer(self, weights: str) -> bool:
        return self._run(f"test -f {shlex.quote(weights + '/tokenizer.json')} && echo yes || echo no").strip() == "yes"

    def checkpoint_config(self, weights: str) -> dict:
        """The config.json of the checkpoint this host holds in `weights`."""
        text = self._run(f"cat {shlex.quote(weights + '/config.json')}")
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"rollout host {self.ssh.where}: {weights}/config.json unreadable ({e})") from None

    def start_server(self, command: str, log_name: str) -> ServerPart:
        """Run `command` (a server) in a new SSH session, its output appended to `log_name` in the host's directory."""
        log = posixpath.join(self.dir, log_name)
        # The server runs until this session's input closes (when the driver stops or dies), and the session ends
        # when the server does: input is watched by a job of its own (fd 3: a job's stdin is /dev/null).
        script = (
            f"cd {shlex.quote(self.dir)} && exec 3<&0 && {{ setsid {command} >> {shlex.quote(log)} 2>&1 3<&- & server=$!; "
            "{ cat <&3 > /dev/null; kill $server; } > /dev/null 2>&1 & wait $server; }"
        )
        session = self.ssh.conn.client.get_transport().open_session()
        session.exec_command(script)
        part = ServerPart(self, session, log)
        self._parts.append(part)
        if log not in self._logs:
            self._logs.append(log)
        return part

    def rank_reports(self, ranks: int) -> RankReports:
        """The reports this host's data-parallel engine's `ranks` ranks leave in its directory."""
        return RankReports(posixpath.join(self.dir, "rank-reports"), lambda prefix: read_rank_reports(self.take_reports(prefix), ranks))

    def take_reports(self, prefix: str) -> str:
        """The rank reports under `prefix` here, removed."""
        files = f"{shlex.quote(prefix)}.*.json"
        return self._run(f"cat {files} 2>/dev/null; rm -f {files}")

    def start_engines(self, weights: str, seed: int, routed_experts: bool) -> list[Engine]:
        rollout = self.recipe.rollout
        placement = self.placement()
        tokenizer, config = self.has_tokenizer(weights), self.checkpoint_config(weights)
        starting = []
        for engine in placement.engines:
            [port] = self.free_ports(1)
            server = engine_command(
                rollout,
                placement,
                engine,
                python=self.python,
                weights=weights,
                config=config,
                seed=seed,
                routed_experts=routed_experts,
                tokenizer=tokenizer,
                port=port,
            )
            part = self.start_server(server, f"vllm-{engine.number}.log")
            starting.append((part, f"http://127.0.0.1:{self.ssh.forward(port)}"))
        for part, url in starting:
            wait_healthy(url, part.running, rollout.server_start_seconds, part.where)
        reports = self.rank_reports(rollout.parallelism.devices) if rollout.parallelism.dp > 1 else None
        engines: list[Engine] = [ServerEngine(url, rollout, model=weights, reports=reports) for _, url in starting]
        self.engine_versions.started(engines, self._pulled[0])
        return engines

    def close(self) -> None:
        """Stop the servers (end of their sessions' input) and wait for them, copy their logs here, then hang up."""
        stop_parts(self._parts)
        for log in self._logs:
            local = self.files.root / "logs" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', self.name)}-{posixpath.basename(log)}"
            try:
                self.ssh.conn.get(log, local=str(local))
            except Exception as e:  # the host may be gone; its log stays there
                print(f"rollout host {self.ssh.where}: could not copy {log}: {e}", file=sys.stderr)
        self.ssh.close()


class EngineHosts:
    """The hosts of one engine larger than a host, in vLLM's multi-node modes: the first serves the engine's API (on its
    loopback, reached through an SSH port forward), the others run its headless ranks, which meet the first at its
    name in rollout.hosts. Every host pulls each policy into its own receiver, all at once (hosts that mount the same
    rollout.remote_dir share its receiver: one of them pulls for all). Each part runs in an SSH session of its host
    and ends with it; when one exits, the others are stopped at once (a request waiting on a rank that is gone fails
    instead of hanging) and the whole engine is started again on the policy its hosts hold, at most ENGINE_RESTARTS
    times in a run."""

    PART_EXIT_SECONDS = 5
    """How long a request the engine failed waits to learn whether a part of it exited (the watcher polls)."""

    def __init__(self, members: list[RemoteHost], number: int):
        self.members = members
        self.number = number
        """The engine's number in the fleet (its seed offset, its logs' names)."""
        self.name = "+".join(member.name for member in members)
        self.recipe, self.files = members[0].recipe, members[0].files
        self.lock = threading.Lock()
        self.engine_versions = _EngineVersions()
        self.restarts = 0
        self._pulled: tuple[str, str] | None = None
        """(store version, weights directory) every host holds."""
        self._pullers: list[RemoteHost] | None = None
        """One host per distinct rollout directory (`_distinct_directories`)."""
        self._serving: tuple[int, bool] = (0, False)
        """(seed, routed experts) the engine was started with, for its restarts."""
        self._parts: list[ServerPart] = []
        self._exited: ServerPart | None = None
        self._closing = False

    def _held(self, store_version: str, weights: list[str]) -> str:
        if len(set(weights)) > 1:
            raise UserError(
                f"rollout hosts {self.name} hold {store_version} at different paths ({', '.join(weights)}); the ranks of "
                "one engine load it from the same path on every host (rollout.remote_dir)"
            )
        self._pulled = (store_version, weights[0])
        return weights[0]

    def pull(self, store_version: str) -> str:
        return self._held(store_version, on_each(self._distinct_directories(), lambda member: member.pull(store_version)))

    def update(self, engine: Engine, store_version: str) -> None:
        """Every host's receiver patched in place, then the engine reloads what changed, each rank from its host's copy."""
        weights = self._held(store_version, on_each(self._distinct_directories(), lambda member: member.pull_in_place(store_version)))
        sync = sync_section(self.recipe, self.files)
        with Store.open(sync.store, self.recipe.cluster.ssh, endpoint=sync.endpoint) as store:
            self.engine_versions.move(engine, store, store_version, weights)

    def _distinct_directories(self) -> list[RemoteHost]:
        """The first host of each group that sees the same rollout directory (found once, with a mark each host leaves
        there): two pulls into one receiver at once would collide on its writer lock."""
        if self._pullers is None:
            marks = {member.name: f".mark-{uuid.uuid4().hex}" for member in self.members}
            try:
                on_each(self.members, lambda member: member._run(f"touch {shlex.quote(posixpath.join(member.dir, marks[member.name]))}"))
                seen = on_each(self.members, lambda member: set(member._run(f"ls -A {shlex.quote(member.dir)}").split()))
            finally:
                on_each(
                    self.members,
                    lambda member: member._run(f"rm -f {' '.join(shlex.quote(posixpath.join(member.dir, m)) for m in marks.values())}"),
                )
            pullers: list[RemoteHost] = []
            for member, names in zip(self.members, seen):
                if not any(marks[puller.name] in names for puller in pullers):
                    pullers.append(member)
            self._pullers = pullers
        return self._pullers

    def placements(self) -> list[HostPlacement]:
        return [member.placement(node_rank=rank, engine_base=self.number) for rank, member in enumerate(self.members)]

    def start_engines(self, weights: str, seed: int, routed_experts: bool) -> list[Engine]:
        self._serving = (seed, routed_experts)
        rollout = self.recipe.rollout
        reports = (
            RankReports(posixpath.join(self.members[0].dir, "rank-reports"), self._read_reports) if rollout.parallelism.dp > 1 else None
        )
        engine = MultiNodeServerEngine(self, self._start(weights), rollout, model=weights, reports=reports)
        self.engine_versions.started([engine], self._pulled[0])
        return [engine]

    def _read_reports(self, prefix: str) -> list:
        return read_rank_reports("".join(member.take_reports(prefix) for member in self.members), self.recipe.rollout.parallelism.devices)

    def _start(self, weights: str) -> str:
        """Start every part of the engine on `weights`; the URL of its API once it answers."""
        rollout, head = self.recipe.rollout, self.members[0]
        seed, routed_experts = self._serving
        api_port, head_port = head.free_ports(2)
        tokenizer, config = head.has_tokenizer(weights), head.checkpoint_config(weights)
        parts: list[ServerPart] = []
        try:
            for member, placement in zip(self.members, self.placements()):
                [engine] = placement.engines
                command = engine_command(
                    rollout,
                    placement,
                    engine,
                    python=member.python,
                    weights=weights,
                    config=config,
                    seed=seed,
                    routed_experts=routed_experts,
                    tokenizer=tokenizer,
                    port=None if engine.node_rank else api_port,
                    head=head.name,
                    head_port=head_port,
                )
                parts.append(member.start_server(command, f"vllm-{engine.number}-node{engine.node_rank}.log"))
            url = f"http://127.0.0.1:{head.ssh.forward(api_port)}"
            wait_healthy(
                url, lambda: all(part.running() for part in parts), rollout.server_start_seconds, ", ".join(p.where for p in parts)
            )
        except UserError as e:
            exited = [part.where for part in parts if not part.running()]
            stop_parts(parts)
            raise UserError(
                f"rollout engine {self.number} on {self.name}: "
                + (f"a part exited during start-up; see {', '.join(exited)}" if exited else str(e))
            ) from None
        except BaseException:
            stop_parts(parts)
            raise
        self._parts, self._exited = parts, None
        threading.Thread(target=self._watch, args=(parts,), daemon=True, name=f"engine-{self.number}-parts").start()
        return url

    def _watch(self, parts: list[ServerPart]) -> None:
        while not self._closing:
            exited = next((part for part in parts if not part.running()), None)
            if exited is not None:
                if not self._closing:
                    print(
                        f"rollout engine {self.number} on {self.name}: its part {exited.where} exited; stopping the others", file=sys.stderr
                    )
                    self._exited = exited
                    stop_parts(parts)
                return
            time.sleep(0.5)

    def exited_part(self) -> ServerPart | None:
        """The part whose exit took the engine down, if one did (waiting a little for the watcher to see it)."""
        deadline = time.monotonic() + self.PART_EXIT_SECONDS
        while self._exited is None and not self._closing and time.monotonic() < deadline:
            time.sleep(0.2)
        return self._exited

    def restart(self) -> tuple[str, str]:
        """Start the whole engine again on the policy its hosts hold: its new URL and the weights it serves."""
        exited = self._exited
        if self.restarts == ENGINE_RESTARTS:
            raise UserError(
                f"rollout engine {self.number} on {self.name}: its part {exited.where} exited, and the engine was "
                f"restarted {ENGINE_RESTARTS} time(s) in this run already; the run stops (see that log)"
            )
        self.restarts += 1
        stop_parts(self._parts)
        print(
            f"rollout engine {self.number} on {self.name}: restarting the whole engine ({self.restarts} of at most "
            f"{ENGINE_RESTARTS}) on {self._pulled[0]}",
            file=sys.stderr,
        )
        return self._start(self._pulled[1]), self._pulled[1]

    def close(self) -> None:
        self._closing = True
        stop_parts(self._parts)
        for member in self.members:
            member.close()


class MultiNodeServerEngine(ServerEngine):
    """The client of an engine over several hosts: a request the engine failed because a part of it exited is sent
    again once the whole engine is back (`EngineHosts.restart`)."""

    def __init__(self, hosts: EngineHosts, url: str, rollout: RolloutSection, model: str, reports: RankReports | None):
        super().__init__(url, rollout, model, reports)
        self._hosts = hosts
        self._restart_lock = threading.Lock()
        self._starts = 1

    def _post(self, path: str, body: dict | None) -> dict:
        while True:
            starts = self._starts
            try:
                return super()._post(path, body)
            except ServerUnreachable:
                with self._restart_lock:
                    if self._starts == starts:  # the first request to see it restarts the engine, the others wait for it
                        if self._hosts.exited_part() is None:
                            raise
                        self.url, self.model = self._hosts.restart()
                        self._starts += 1
            if body is not None and "model" in body:
                body = {**body, "model": self.model}  # the name the restarted server serves


def engine_command(
    rollout: RolloutSection,
    placement: HostPlacement,
    engine: EnginePlacement,
    *,
    python: str,
    weights: str,
    config: dict,
    seed: int,
    routed_experts: bool,
    tokenizer: bool,
    port: int | str | None,
    head: str = "",
    head_port: int | str = "",
) -> str:
    """The shell command that starts one engine's server (or, on the other hosts of an engine over several hosts,
    its headless ranks: `head`:`head_port` is where they meet) on `placement`'s devices, with every setting a server on
    this machine gets (`config`: the checkpoint's config.json)."""
    options = engine_options(
        weights, config, rollout, placement.devices.kind, seed=seed + engine.number, routed_experts=routed_experts, tokenizer=tokenizer
    )
    env = shlex.join([f"{k}={v}" for k, v in server_env(engine).items()])
    node = multinode_args(engine, rollout.parallelism, head, head_port)
    return f"env {env} {shlex.join([python, '-m', server_guard.MODULE, *server_args(options, port, node)])}"


def on_each(hosts: list[RemoteHost], call: Callable[[RemoteHost], T]) -> list[T]:
    """`call` on every host at once (a thread each); its results in the hosts' order. When it fails on some hosts,
    once every call has ended: one user error naming each of them."""
    with ThreadPoolExecutor(max_workers=len(hosts), thread_name_prefix="rollout-host") as pool:
        futures = [pool.submit(call, host) for host in hosts]
    failed = [(host, future.exception()) for host, future in zip(hosts, futures) if future.exception() is not None]
    bugs = [error for _, error in failed if not isinstance(error, UserError)]
    if bugs:
        raise bugs[0]
    if failed:
        raise UserError(
            "; ".join(str(error) if host.ssh.where in str(error) else f"rollout host {host.ssh.where}: {error}" for host, error in failed)
        )
    return [future.result() for future in futures]


def plan_fleet(recipe: Recipe) -> list[HostPlacement | None]:
    """Every rollout host's placement as far as it is known before anything starts (the recipe's rollout.devices, or
    this machine's own); a user error when engines do not fit a host."""
    rollout = recipe.rollout
    return place_fleet(recipe, {LocalHost.name: local_devices()} if LocalHost.name in rollout.hosts else {})


def rollout_plan(recipe: Recipe) -> list[tuple[str, HostPlacement | None, list[str]]]:
    """For --dry-run: per rollout host, its placement (None where its devices are found only at start: a remote
    host the recipe declares no rollout.devices for) and the commands that start its engines."""
    rollout = recipe.rollout
    placements = plan_fleet(recipe)
    python = rollout.remote_python or sys.executable
    routed = recipe.model.is_moe and recipe.rl.router_replay == "r3"
    # every policy has the starting checkpoint's architecture (its config.json, when it is a directory here)
    starting = Path(recipe.model.checkpoint or "")
    config = checkpoint_config(starting) if (starting / "config.json").is_file() else {}
    plan = []
    for host, placement in zip(rollout.hosts, placements):
        commands = []
        for engine in placement.engines if placement else ():
            head = rollout.hosts[rollout.hosts.index(host) - engine.node_rank]
            commands.append(
                engine_command(
                    rollout,
                    placement,
                    engine,
                    python=python,
                    weights="<weights>",
                    config=config,
                    seed=recipe.train.seed,
                    routed_experts=routed,
                    tokenizer=True,
                    port=None if engine.node_rank else "<port>",
                    head=head,
                    head_port=f"<port on {head}>",
                )
            )
        plan.append((host, placement, commands))
    return plan


def host_placement(name: str, found: HostDevices, recipe: Recipe, *, node_rank: int = 0, engine_base: int = 0) -> HostPlacement:
    """The placement on rollout host `name`, which has `found` (checked against rollout.devices when the recipe declares
    them); `node_rank`, `engine_base`: as `place_host`'s."""
    return place_host(name, planned_devices(recipe.rollout, name, found), recipe, node_rank=node_rank, engine_base=engine_base)


def _store_args(sync: SyncSection, ssh: SSHSection) -> list[str]:
    """How the host's composer reaches the store: an ssh:// store with the recipe's key and known_hosts (paths on that
    host), an s3:// store at its endpoint."""
    return [
        "--store",
        sync.store,
        *(["--endpoint", sync.endpoint] if sync.endpoint else []),
        *(["--ssh-key", ssh.key_file] if ssh.key_file else []),
        *(["--known-hosts", ssh.known_hosts] if ssh.known_hosts else []),
    ]


def open_hosts(recipe: Recipe, files: RLRunFiles) -> list[LocalHost | RemoteHost | EngineHosts]:
    """The recipe's rollout hosts, connected (remote ones over SSH), those of an engine larger than a host together;
    closed again if one cannot be reached or its engines do not fit."""
    hosts: list[LocalHost | RemoteHost] = []
    try:
        for name in recipe.rollout.hosts:
            hosts.append(LocalHost(recipe, files) if name == "localhost" else RemoteHost(name, recipe, files))
        return engine_hosts(hosts)
    except BaseException:
        for host in hosts:
            host.close()
        raise


def engine_hosts(hosts: list[LocalHost | RemoteHost]) -> list[LocalHost | RemoteHost | EngineHosts]:
    """Each host on its own, or, where an engine is larger than a host, consecutive hosts together (`EngineHosts`);
    each host's placement is checked on the devices it has."""
    spans = [host.placement().engines[0].nodes for host in hosts]
    if max(spans) == 1:
        return hosts
    if len(set(spans)) > 1:
        found = ", ".join(f"{host.name}: {len(host.devices().ids)} {host.devices().unit}s" for host in hosts)
        raise UserError(f"rollout.hosts: an engine over several hosts needs hosts alike, but they have different devices ({found})")
    span = spans[0]  # recipes.checks: they split into whole engines, none of them localhost
    return [EngineHosts(hosts[i : i + span], number=i // span) for i in range(0, len(hosts), span)]
