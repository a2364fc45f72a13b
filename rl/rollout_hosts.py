"""Where rollout engines run: this host, or remote hosts reached over SSH.

A host turns a policy version in the sync store into a weights directory its engines can load, and starts its
engines, and moves an engine to a new version: in place from the delta (only the layers whose tensors changed
are reloaded, read from the receiver's copy, which is patched where it differs) whenever the engine holds an
earlier version of the same tensors, else by a full reload. A remote host runs the composer installed there (`rollout.remote_python`) to pull from the store, and
vLLM servers bound to its loopback, reached through SSH port forwards, so their weight-update endpoints are never
exposed on the network. What a remote host starts ends when the SSH connection does: a driver killed with -9
leaves nothing running there.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import sys
import threading
import time
import uuid
from pathlib import Path

from cluster.placement import (
    PROBE,
    EnginePlacement,
    HostDevices,
    HostPlacement,
    local_devices,
    place_fleet,
    place_host,
    planned_devices,
)
from cluster.ssh import SSHHost
from recipes.errors import UserError
from recipes.schema import Recipe, RolloutSection, SSHSection, SyncSection
from rl.protocol import RLRunFiles, sync_section
from rollout.engines import server_guard
from rollout.engines.vllm_engine import (
    SERVER_START_SECONDS,
    Engine,
    ServerEngine,
    VllmServer,
    build_engines,
    engine_options,
    multinode_args,
    server_args,
    wait_healthy,
)
from runtime.run_dir import atomic_write_text
from sync.receiver import pull, update_in_place
from sync.store import Store

SERVER_STOP_SECONDS = 30
_FREE_PORT = "from runtime.processes import free_port; print(free_port())"  # run by the host's composer


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

    def placement(self) -> HostPlacement:
        """Which devices this host's engines (and learner ranks) get; refused before anything starts if they do not fit."""
        return host_placement(self.name, local_devices(), self.recipe)

    def start_engines(self, weights: str, seed: int, routed_experts: bool) -> list[Engine]:
        engines, self.servers = build_engines(self.recipe.rollout, weights, self.placement(), seed=seed,
                                              routed_experts=routed_experts, log_dir=self.files.root / "logs")
        self.engine_versions.started(engines, self._pulled)
        return engines

    def close(self) -> None:
        for server in self.servers:
            server.stop()


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
        self._sessions: list = []
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
            raise UserError(f"rollout host {self.ssh.where} does not see the sync store {store} (a directory on this machine); "
                            "set sync.store to a directory every rollout host mounts, or to an ssh:// store they can reach")

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
        return self._run(shlex.join([self.python, "-m", "cli", *args]))

    def pull(self, store_version: str) -> str:
        if self._pulled is None or self._pulled[0] != store_version:
            sync = sync_section(self.recipe, self.files)
            self._composer("sync", "pull", *_store_args(sync, self.recipe.cluster.ssh), "--to", self.receiver, "--version", store_version)
            self._pulled = (store_version, self._run(f"readlink -f {shlex.quote(self.receiver + '/current')}").strip())
        return self._pulled[1]

    def update(self, engine: Engine, store_version: str) -> None:
        """Bring one of this host's engines to `store_version`: the host's receiver is patched in place by its
        composer, the engine reloads what changed from it (call with `lock` held)."""
        sync = sync_section(self.recipe, self.files)
        if self._pulled is None or self._pulled[0] != store_version:
            self._composer("sync", "pull", *_store_args(sync, self.recipe.cluster.ssh), "--to", self.receiver, "--version", store_version, "--in-place")
            self._pulled = (store_version, self._run(f"readlink -f {shlex.quote(self.receiver + '/current')}").strip())
        with Store.open(sync.store, self.recipe.cluster.ssh, endpoint=sync.endpoint) as store:
            self.engine_versions.move(engine, store, store_version, self._pulled[1])

    def placement(self) -> HostPlacement:
        """As `LocalHost.placement`, with the devices the host reports (its own Python asked over SSH)."""
        return host_placement(self.name, HostDevices.from_probe(self._run(shlex.join([self.python, "-c", PROBE]))), self.recipe)

    def start_engines(self, weights: str, seed: int, routed_experts: bool) -> list[Engine]:
        rollout = self.recipe.rollout
        placement = self.placement()
        tokenizer = self._run(f"test -f {shlex.quote(weights + '/tokenizer.json')} && echo yes || echo no").strip() == "yes"
        starting = []
        for engine in placement.engines:
            port = int(self._run(shlex.join([self.python, "-c", _FREE_PORT])))
            server = engine_command(rollout, placement, engine, python=self.python, weights=weights, seed=seed,
                                    routed_experts=routed_experts, tokenizer=tokenizer, port=port)
            log = posixpath.join(self.dir, f"vllm-{engine.number}.log")
            # The server runs until this session's stdin closes: when the driver stops or dies.
            command = (f"cd {shlex.quote(self.dir)} && {{ setsid {server} "
                       f"> {shlex.quote(log)} 2>&1 & server=$!; cat > /dev/null; kill $server; wait $server; }}")
            session = self.ssh.conn.client.get_transport().open_session()
            session.exec_command(command)
            self._sessions.append(session)
            self._logs.append(log)
            starting.append((session, f"http://127.0.0.1:{self.ssh.forward(port)}", log))
        for session, url, log in starting:
            wait_healthy(url, lambda s=session: not s.exit_status_ready(), SERVER_START_SECONDS, f"{self.ssh.where}:{log}")
        engines: list[Engine] = [ServerEngine(url, rollout, model=weights) for _, url, _ in starting]
        self.engine_versions.started(engines, self._pulled[0])
        return engines

    def close(self) -> None:
        """Stop the servers (end of their sessions' input) and wait for them, then hang up."""
        for session in self._sessions:
            session.shutdown_write()
        deadline = time.monotonic() + SERVER_STOP_SECONDS
        for session in self._sessions:
            while not session.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.2)
            session.close()
        for log in self._logs:
            local = self.files.root / "logs" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', self.name)}-{posixpath.basename(log)}"
            try:
                self.ssh.conn.get(log, local=str(local))
            except Exception as e:  # the host may be gone; its log stays there
                print(f"rollout host {self.ssh.where}: could not copy {log}: {e}", file=sys.stderr)
        self.ssh.close()


def engine_command(rollout: RolloutSection, placement: HostPlacement, engine: EnginePlacement, *, python: str, weights: str,
                   seed: int, routed_experts: bool, tokenizer: bool, port: int | str | None, head: str = "",
                   head_port: int | str = "") -> str:
    """The shell command that starts one engine's server (or, on the other hosts of an engine over several hosts,
    its headless ranks: `head`:`head_port` is where they meet) on `placement`'s devices."""
    options = engine_options(weights, rollout, placement.devices.kind, seed=seed + engine.number,
                             routed_experts=routed_experts, tokenizer=tokenizer)
    env = shlex.join([f"{k}={v}" for k, v in {"VLLM_SERVER_DEV_MODE": "1", **engine.env()}.items()])
    node = multinode_args(engine, rollout.parallelism, head, head_port)
    return f"env {env} {shlex.join([python, '-m', server_guard.MODULE, *server_args(options, port, node)])}"


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
    plan = []
    for host, placement in zip(rollout.hosts, placements):
        commands = []
        for engine in placement.engines if placement else ():
            head = rollout.hosts[rollout.hosts.index(host) - engine.node_rank]
            commands.append(engine_command(rollout, placement, engine, python=python, weights="<weights>", seed=recipe.train.seed,
                                           routed_experts=routed, tokenizer=True, port=None if engine.node_rank else "<port>", head=head,
                                           head_port=f"<port on {head}>"))
        plan.append((host, placement, commands))
    return plan


def host_placement(name: str, found: HostDevices, recipe: Recipe) -> HostPlacement:
    """The placement on rollout host `name`, which has `found` (checked against rollout.devices when the recipe declares
    them); engines over several hosts are refused."""
    return refuse_engines_over_hosts(place_host(name, planned_devices(recipe.rollout, name, found), recipe), recipe.rollout)


def refuse_engines_over_hosts(placement: HostPlacement | None, rollout: RolloutSection) -> HostPlacement | None:
    """Engines larger than a host are planned (--dry-run prints their vLLM multi-node commands) but not started."""
    if placement is not None and placement.engines and placement.engines[0].nodes > 1:
        raise UserError(f"rollout.parallelism: an engine of {rollout.parallelism.devices} devices spans {placement.engines[0].nodes} "
                        "rollout hosts; composer plans it in vLLM's multi-node modes (`composer train rl --dry-run` prints the "
                        "commands) but does not start it yet; use engines that fit one host")
    return placement


def _store_args(sync: SyncSection, ssh: SSHSection) -> list[str]:
    """How the host's composer reaches the store: an ssh:// store with the recipe's key and known_hosts (paths on that
    host), an s3:// store at its endpoint."""
    return ["--store", sync.store, *(["--endpoint", sync.endpoint] if sync.endpoint else []),
            *(["--ssh-key", ssh.key_file] if ssh.key_file else []), *(["--known-hosts", ssh.known_hosts] if ssh.known_hosts else [])]


def open_hosts(recipe: Recipe, files: RLRunFiles) -> list[LocalHost | RemoteHost]:
    """The recipe's rollout hosts, connected (remote ones over SSH); closed again if one cannot be reached."""
    hosts: list[LocalHost | RemoteHost] = []
    try:
        for name in recipe.rollout.hosts:
            hosts.append(LocalHost(recipe, files) if name == "localhost" else RemoteHost(name, recipe, files))
    except BaseException:
        for host in hosts:
            host.close()
        raise
    return hosts
