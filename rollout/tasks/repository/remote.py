"""Repository workspaces on the fleet's sandbox hosts, seen from the driver.

`open_repo_workspace` places an episode on the host of `env.sandbox.hosts` with the fewest open workspaces for its
capacity: this machine (a `RepoWorkspace` here) or a remote host, where a `RemoteRepoWorkspace` ships what the task
needs (by digest, once per host: `rollout.tasks.repository.shipping`), opens the view there and forwards every tool
call and the grading; observations and the verdict come back as data. A host lost in the middle of an episode is an
infrastructure failure, not a score: the workspace is opened again on another remote host, the episode's changes so
far (its journal of commands and written files) replayed there, and the call retried (`env.sandbox.infra_retries`
times); past them the call ends as `infra_failure`.
"""

from __future__ import annotations

import base64
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from composer.rollout.sandbox.fleet import Failure
from composer.rollout.sandbox.hosts import LOCALHOST, RemoteSandboxHost, SandboxFleet
from composer.rollout.sandbox.results import CommandResult, RewardMode, RunEnvironment, SandboxResult
from composer.rollout.sandbox.wire import Op, from_wire, to_wire
from composer.rollout.tasks.repository.grading_policy import Scope
from composer.rollout.tasks.repository.shipping import CHUNK_BYTES, WIRE_TYPES, ShippedTask, ShippedTests, ShippedTrees, pack
from composer.rollout.tasks.repository.workspace import RepoTests, RepoWorkspace, TestReport
from composer.rollout.tasks.workspace import Workspace

log = logging.getLogger("composer.workspace")

SHIP_SECONDS = 600.0
OPEN_SECONDS = 120.0


def open_repo_workspace(fleet: SandboxFleet, tests: RepoTests, reward: RewardMode) -> Workspace:
    """A fresh episode view of a repository task on the least loaded host (close it when the episode ends)."""
    hosts = _by_load(fleet)
    if not hosts:
        raise OSError("no sandbox host is up for a repository workspace")
    if hosts[0] == LOCALHOST:
        workspace = RepoWorkspace(tests, fleet.local, fleet.local.root / "workspaces", reward)
        return _Counted(workspace, fleet, LOCALHOST)
    return RemoteRepoWorkspace(fleet, tests, reward)


def _by_load(fleet: SandboxFleet, exclude: tuple[str, ...] = (), remote_only: bool = False) -> list[str]:
    names = []
    for name, host in fleet.provider.by_name.items():
        if name in exclude or (remote_only and name == LOCALHOST):
            continue
        if isinstance(host, RemoteSandboxHost) and not host.connected:
            continue
        names.append(name)
    return sorted(names, key=lambda n: (fleet.open_workspaces[n] / max(fleet.capacities[n], 1), names.index(n)))


class _Counted(Workspace):
    """A workspace on this machine, counted among the fleet's open ones while it is open."""

    def __init__(self, inner: RepoWorkspace, fleet: SandboxFleet, host: str):
        self.inner, self.root = inner, inner.root
        self._fleet, self._host = fleet, host
        fleet.open_workspaces[host] += 1

    def shell(self, command: str, timeout_s: float) -> CommandResult:
        return self.inner.shell(command, timeout_s)

    def run_tests(self) -> CommandResult:
        return self.inner.run_tests()

    def grade(self) -> SandboxResult:
        return self.inner.grade()

    def close(self) -> None:
        if self._host:
            self._fleet.open_workspaces[self._host] -= 1
            self._host = ""
        self.inner.close()


@dataclass(frozen=True)
class _Tree:
    digest: str
    archive: Path
    relocate_from: str | None = None


class _HostLost(Exception):
    pass


class RemoteRepoWorkspace(Workspace):
    """An episode's view of a repository task on a remote sandbox host (see the module docstring)."""

    def __init__(self, fleet: SandboxFleet, tests: RepoTests, reward: RewardMode):
        self.fleet, self.tests = fleet, tests
        self.retries = fleet.config.infra_retries
        grading = pack(tests.grading_base)
        layer = pack(tests.layer)
        self._trees = [_Tree(*grading), _Tree(*layer)]
        env_tree, prefixes = _environment_tree(tests.environment)
        environment = ""
        if env_tree is not None:
            self._trees.append(env_tree)
            environment = env_tree.digest
        trees = ShippedTrees(
            project=Path(tests.packages[0]).name,
            ready_made=bool(tests.hidden),
            grading=grading[0],
            environment=environment,
            prefixes=prefixes,
        )
        self._task = ShippedTask(tests=tests.plan, trees=trees, layer=layer[0], reward=reward)
        self._journal: list[tuple[str, dict]] = []
        self._host: RemoteSandboxHost | None = None
        self._number = 0
        self.hosts_used: list[str] = []
        try:
            self._attach(exclude=())
        except _HostLost as e:
            raise OSError(f"no sandbox host could open the episode's workspace ({e})") from None

    @property
    def host(self) -> str:
        return self._host.name if self._host else ""

    def _attach(self, exclude: tuple[str, ...]) -> None:
        """Open the workspace on the least loaded remote host not in `exclude`, shipping what it lacks and replaying
        the journal; _HostLost when no host can take it."""
        for name in _by_load(self.fleet, exclude, remote_only=True):
            host = self.fleet.provider.by_name[name]
            try:
                for tree in self._trees:
                    _ship(self.fleet, host, tree)
                number = _ask(host, {"op": Op.WS_OPEN, "task": to_wire(self._task, WIRE_TYPES)}, OPEN_SECONDS)
                self._host, self._number = host, int(number)
                self.fleet.open_workspaces[name] += 1
                self.hosts_used.append(name)
                for operation, arguments in self._journal:
                    _ask(host, self._message(operation, arguments), _seconds(operation, arguments))
                return
            except _HostLost as e:
                log.warning("workspace: host %s could not take the episode's workspace (%s)", name, e)
                self._detach()
                exclude = (*exclude, name)
        raise _HostLost("no remote sandbox host can take the workspace")

    def _detach(self) -> None:
        if self._host is not None:
            self.fleet.open_workspaces[self._host.name] -= 1
            self._host, self._number = None, 0

    def _message(self, operation: str, arguments: dict) -> dict:
        return {"op": Op.WS, "workspace": self._number, "name": operation, "arguments": arguments}

    def _call(self, operation: str, arguments: dict):
        """The operation on the episode's host; on another one, the journal replayed, when that host is lost."""
        failed_on: tuple[str, ...] = ()
        for _ in range(self.retries + 1):
            try:
                if self._host is None:
                    self._attach(failed_on)
                value = _ask(self._host, self._message(operation, arguments), _seconds(operation, arguments))
            except _HostLost as e:
                if self._host is not None:
                    log.warning("workspace: lost host %s in the middle of an episode (%s); moving the workspace", self.host, e)
                    failed_on = (*failed_on, self._host.name)
                self._detach()
                continue
            if operation in ("shell", "write"):
                self._journal.append((operation, arguments))
            return value
        raise _HostLost(f"every attempt failed (hosts tried: {', '.join(failed_on) or 'none up'})")

    @property
    def root(self) -> Path:
        return Path(f"{self.host}:/sandbox")

    def read_file(self, path: str) -> str:
        return _file_reply(self._file_call("read", {"path": path}))["text"]

    def write_file(self, path: str, text: str) -> None:
        _file_reply(self._file_call("write", {"path": path, "text": text}))

    def _file_call(self, operation: str, arguments: dict) -> dict:
        try:
            return self._call(operation, arguments)
        except _HostLost as e:
            raise OSError(f"the workspace's host is gone ({e})") from None

    def shell(self, command: str, timeout_s: float) -> CommandResult:
        try:
            return self._call("shell", {"command": command, "timeout_s": timeout_s})
        except _HostLost as e:
            return CommandResult(None, "infra", f"[the sandbox host was lost: {e}]", 0.0, infra_failure=True)

    def run_tests(self) -> CommandResult:
        try:
            return self._call("run_tests", {})
        except _HostLost as e:
            return CommandResult(None, "infra", f"[the sandbox host was lost: {e}]", 0.0, infra_failure=True)

    def grade(self) -> SandboxResult:
        try:
            return self._call("grade", {})
        except _HostLost as e:
            return SandboxResult(0.0, 0, 0, "infra", f"the sandbox host was lost: {e}", "", "", 0.0, infra_failure=True)

    def close(self) -> None:
        if self._host is not None:
            try:
                _ask(self._host, self._message("close", {}), OPEN_SECONDS)
            except _HostLost:
                pass  # the host is gone, and its workspaces with it
            self._detach()


def _ask(host: RemoteSandboxHost, message: dict, timeout_s: float):
    reply = host.request(message, timeout_s)
    if isinstance(reply, Failure):
        raise _HostLost(f"{reply.cause}: {reply.detail}")
    return from_wire(reply.get("value"), WIRE_TYPES)


_shipping_locks: dict[tuple[str, str], threading.Lock] = {}
_shipping_guard = threading.Lock()


def _ship(fleet: SandboxFleet, host: RemoteSandboxHost, tree: _Tree) -> None:
    """`tree` onto `host` unless it holds it already (one sender per host and tree: concurrent episodes wait)."""
    with _shipping_guard:
        lock = _shipping_locks.setdefault((host.name, tree.digest), threading.Lock())
    with lock:
        if _ask(host, {"op": Op.HAVE, "digest": tree.digest}, OPEN_SECONDS):
            return
        data = tree.archive.read_bytes()
        chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
        for index, chunk in enumerate(chunks[:-1]):
            if not host.send({"op": Op.PUT, "id": 0, "digest": tree.digest, "first": index == 0, "data": base64.b64encode(chunk).decode()}):
                raise _HostLost(f"{host.where}: the connection was lost while shipping")
        _ask(
            host,
            {
                "op": Op.PUT,
                "digest": tree.digest,
                "first": len(chunks) == 1,
                "last": True,
                "relocate_from": tree.relocate_from,
                "data": base64.b64encode(chunks[-1]).decode(),
            },
            SHIP_SECONDS,
        )
        fleet.shipped_bytes[host.name] += len(data)


def _environment_tree(environment: RunEnvironment | None) -> tuple[_Tree | None, tuple[str, ...]]:
    """A project environment's tree (its bin/ is first on its PATH) and the interpreter's installation it needs."""
    if environment is None:
        return None, ()
    venv = Path(environment.path[0]).parent
    return _Tree(*pack(venv), relocate_from=str(venv)), tuple(environment.read_only[1:])


def remote_test_run(
    fleet: SandboxFleet,
    host_name: str,
    project: str,
    grading_base: Path,
    environment: RunEnvironment | None,
    pytest_args: tuple[str, ...],
    ready_made: bool,
    packages: tuple[str, ...],
    scope: tuple[Scope, ...] = (),
):
    """A build's test run on a remote host (`rollout.tasks.repository.surveys.TestRun`, or with `scope` its `AcrossRun`:
    across the grading boundary there): the grading base and the environment shipped there first (once), the report
    back as data; a lost host's run is an infrastructure failure."""
    host = fleet.provider.by_name[host_name]

    def run(changes: dict[str, str], test_files: tuple[str, ...], timeout_s: float) -> TestReport:
        grading = _Tree(*pack(grading_base))
        env_tree, prefixes = _environment_tree(environment)
        trees = ShippedTrees(
            project=project,
            ready_made=ready_made,
            grading=grading.digest,
            environment=env_tree.digest if env_tree else "",
            prefixes=prefixes,
        )
        job = ShippedTests(
            trees=trees,
            packages=packages,
            changes=tuple(sorted(changes.items())),
            test_files=test_files,
            pytest_args=pytest_args,
            timeout_s=timeout_s,
            scope=scope,
        )
        try:
            for tree in (grading, env_tree):
                if tree is not None:
                    _ship(fleet, host, tree)
            return _ask(host, {"op": Op.TESTS, "job": to_wire(job, WIRE_TYPES)}, 2 * timeout_s + 1800.0)
        except _HostLost as e:
            return TestReport({}, False, (), f"the sandbox host was lost: {e}", "", "infra", 0.0, 0.0, infra_failure=True)

    return run


def _seconds(operation: str, arguments: dict) -> float:
    """How long to wait for an answer: well past the sandbox's own limits, which the host enforces (a lost host is
    noticed at once, by its connection)."""
    return 2 * float(arguments.get("timeout_s", 0)) + 1800.0 if operation in ("shell", "run_tests", "grade") else OPEN_SECONDS


def _file_reply(reply: dict) -> dict:
    if "refused" in reply:
        raise (FileNotFoundError if reply.get("missing") else OSError)(reply["refused"])
    return reply
