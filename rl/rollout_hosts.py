"""Where rollout engines run: this host, or remote hosts reached over SSH.

A host turns a policy version in the sync store into a weights directory its engines can load, and starts its
engines. A remote host runs the composer installed there (`rollout.remote_python`) to pull from the store, and
vLLM servers bound to its loopback, reached through SSH port forwards, so their weight-update endpoints are never
exposed on the network. What a remote host starts ends when the SSH connection does: a driver killed with -9
leaves nothing running there.
"""

from __future__ import annotations

import posixpath
import shlex
import sys
import threading
import time
import uuid
from pathlib import Path

from cluster.ssh import SSHHost
from recipes.errors import UserError
from recipes.runs import atomic_write_text
from recipes.schema import Recipe
from rl.layout import RLRunFiles, sync_section
from rollout.engine import EmbeddedEngine, Engine, ServerEngine, VllmServer, server_args, wait_healthy
from sync.receiver import pull
from sync.store import Store

SERVER_START_SECONDS = 300
SERVER_STOP_SECONDS = 30
_FREE_PORT = "from recipes.processes import free_port; print(free_port())"  # run by the host's composer


class LocalHost:
    """This host: the run directory's receiver, an embedded engine or local vLLM servers."""

    name = "localhost"

    def __init__(self, recipe: Recipe, files: RLRunFiles):
        self.recipe = recipe
        self.files = files
        self.lock = threading.Lock()
        """Held by an engine of this host while it pulls and loads a policy."""
        self.servers: list[VllmServer] = []

    def pull(self, store_version: str) -> str:
        with Store.open(sync_section(self.recipe, self.files).store, self.recipe.cluster.ssh) as store:
            pull(store, self.files.receiver, store_version)
        return str((self.files.receiver / "current").resolve())

    def start_engines(self, weights: str, seed: int, routed_experts: bool) -> list[Engine]:
        rollout = self.recipe.rollout
        if rollout.engine == "embedded":
            return [EmbeddedEngine(weights, rollout, seed=seed, routed_experts=routed_experts)]
        # Started from the main thread: each server is told to end when the thread that started it does.
        for number in range(rollout.engines_per_host):
            self.servers.append(VllmServer(weights, rollout, seed=seed + number, routed_experts=routed_experts,
                                           log_path=self.files.root / "logs" / f"vllm-{number}.log"))
        for server in self.servers:
            server.wait_ready(SERVER_START_SECONDS)
        return [ServerEngine(server.url, rollout, model=weights) for server in self.servers]

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
            sync, ssh = sync_section(self.recipe, self.files), self.recipe.cluster.ssh
            # an ssh:// store is reached from the host with the recipe's key and known_hosts (paths on that host)
            credentials = [*(["--ssh-key", ssh.key_file] if ssh.key_file else []), *(["--known-hosts", ssh.known_hosts] if ssh.known_hosts else [])]
            self._composer("sync", "pull", "--store", sync.store, "--to", self.receiver, "--version", store_version, *credentials)
            self._pulled = (store_version, self._run(f"readlink -f {shlex.quote(self.receiver + '/current')}").strip())
        return self._pulled[1]

    def start_engines(self, weights: str, seed: int, routed_experts: bool) -> list[Engine]:
        rollout = self.recipe.rollout
        tokenizer = self._run(f"test -f {shlex.quote(weights + '/tokenizer.json')} && echo yes || echo no").strip() == "yes"
        starting = []
        for number in range(rollout.engines_per_host):
            port = int(self._run(shlex.join([self.python, "-c", _FREE_PORT])))
            args = server_args(weights, rollout, seed=seed + number, routed_experts=routed_experts, port=port, tokenizer=tokenizer)
            log = posixpath.join(self.dir, f"vllm-{number}.log")
            # The server runs until this session's stdin closes: when the driver stops or dies.
            command = (f"cd {shlex.quote(self.dir)} && {{ VLLM_SERVER_DEV_MODE=1 setsid {shlex.join([self.python, '-m', 'rollout.server_guard', *args])} "
                       f"> {shlex.quote(log)} 2>&1 & server=$!; cat > /dev/null; kill $server; wait $server; }}")
            session = self.ssh.conn.client.get_transport().open_session()
            session.exec_command(command)
            self._sessions.append(session)
            starting.append((session, f"http://127.0.0.1:{self.ssh.forward(port)}", log))
        for session, url, log in starting:
            wait_healthy(url, lambda s=session: not s.exit_status_ready(), SERVER_START_SECONDS, f"{self.ssh.where}:{log}")
        return [ServerEngine(url, rollout, model=weights) for _, url, _ in starting]

    def close(self) -> None:
        """Stop the servers (end of their sessions' input) and wait for them, then hang up."""
        for session in self._sessions:
            session.shutdown_write()
        deadline = time.monotonic() + SERVER_STOP_SECONDS
        for session in self._sessions:
            while not session.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.2)
            session.close()
        self.ssh.close()


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
