"""A sandbox host's server, and the framed protocol the fleet (`rollout.sandbox.fleet`) speaks to it over SSH.

The fleet starts `python -m composer.rollout.sandbox.server` once per host over SSH, with the composer installed there, and
talks to it over the SSH channel's stdin/stdout. The server runs the real `Sandbox` on its host, so grading stays
trusted there; it runs the requests it is sent concurrently (the fleet keeps them within the host's limit) and
exits when its stdin closes, i.e. when the driver's SSH connection ends (the sandbox's fork server then kills the
runs still going). A frame is a 4-byte big-endian length and a JSON object:

  driver -> server   {"op": "hello", "sandbox": <SandboxSection>, "threads": n}
                     {"op": "run", "id": n, "request": <wire>}
                     repository workspaces (`rollout.tasks.shipping`): {"op": "have", "id", "digest"};
                     {"op": "put", "id", "digest", "data": base64, "last": bool, "relocate_from": path | null} (a
                     tree's archive in chunks); {"op": "ws_open", "id", "task": <wire>}; {"op": "ws", "id",
                     "workspace": n, "name": shell | run_tests | read | write | grade | close, "arguments": {...}};
                     {"op": "tests", "id", "job": <wire>} (a build's survey or validation run)
  server -> driver   {"op": "ready", "cpus": n, "isolation": {...}} or {"op": "refused", "error": "..."}
                     {"op": "started", "id": n}    {"op": "result", "id": n, "result": <wire>}
                     {"op": "reply", "id": n, "value": <wire>}    {"op": "failed", "id": n, "error": "..."}

The server lives in a mount namespace of its own (as root): the workspaces' views and tmpfs mounts end with it, so
a driver killed with -9 leaves nothing mounted on the host.

Requests and results cross as data, never as pickles: dataclasses of an allow-list (`WIRE_TYPES`) with their
values in `plain_data`, decoded strictly on each side.
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import json
import os
import struct
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox import plain_data
from composer.rollout.sandbox.results import (
    AssertionTests,
    Call,
    CallTests,
    CaseResult,
    CaseTests,
    CommandResult,
    GeneratedCalls,
    RewardMode,
    SandboxResult,
    ScriptRun,
    Statement,
    Tests,
)
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.sandbox.session import MAX_RESULT_BYTES
from composer.rollout.tasks.shipping import ShippedTask, ShippedTests, Store, WorkspaceService
from composer.rollout.tasks.workspace import TestReport

MODULE = __spec__.name
_HEADER = struct.Struct(">I")


@dataclass(frozen=True)
class RunRequest:
    """Grade `program` against `tests` (`Sandbox.run`)."""

    program: str
    tests: Tests
    reward: RewardMode = "fraction"


SandboxRequest = RunRequest
"""What a sandbox host is asked to do; each kind is served by `serve_request`."""


def serve_request(sandbox: Sandbox, request: SandboxRequest) -> SandboxResult:
    """Run `request` in `sandbox` (on whichever host holds it)."""
    return sandbox.run(request.program, request.tests, request.reward)


# --- the wire codec ------------------------------------------------------------------------------

WIRE_TYPES = {cls.__name__: cls for cls in (RunRequest, AssertionTests, CallTests, GeneratedCalls, ScriptRun, CaseTests,
                                            Call, Statement, SandboxResult, CaseResult, CommandResult, ShippedTask,
                                            ShippedTests, TestReport)}


class ProtocolError(ValueError):
    """A frame that is not what the protocol allows."""


def to_wire(value) -> object:
    """`value` (an allow-listed dataclass, a tuple of them, bytes, or plain data) as JSON-ready data."""
    if dataclasses.is_dataclass(value) and type(value).__name__ in WIRE_TYPES:
        return {"$dc": type(value).__name__, "fields": {f.name: to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if type(value) is tuple and any(dataclasses.is_dataclass(v) for v in value):
        return {"$dcs": [to_wire(v) for v in value]}
    if type(value) is bytes:  # a command's report channel
        return {"$b": base64.b64encode(value).decode()}
    return {"$v": plain_data.encode(value)}


def from_wire(node: object) -> object:
    """The value `to_wire` made; anything else (another type, a stray key) is a ProtocolError."""
    keys = set(node) if isinstance(node, dict) else None
    if keys == {"$v"} and isinstance(node["$v"], str):
        return plain_data.decode(node["$v"])
    if keys == {"$dcs"} and isinstance(node["$dcs"], list):
        return tuple(from_wire(v) for v in node["$dcs"])
    if keys == {"$b"} and isinstance(node["$b"], str):
        try:
            return base64.b64decode(node["$b"], validate=True)
        except ValueError:
            raise ProtocolError("bytes that are not base64") from None
    if keys != {"$dc", "fields"}:
        raise ProtocolError("not a wire value")
    cls = WIRE_TYPES.get(node["$dc"]) if isinstance(node["$dc"], str) else None
    fields = node["fields"]
    if cls is None or not isinstance(fields, dict) or set(fields) - {f.name for f in dataclasses.fields(cls)}:
        raise ProtocolError(f"not an allowed value: {str(node['$dc'])[:60]}")
    try:
        return cls(**{name: from_wire(v) for name, v in fields.items()})
    except TypeError as e:
        raise ProtocolError(str(e)) from None


def frame_bytes(message: dict) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(data)) + data


def read_frame(read_exactly) -> dict | None:
    """The next message, read with `read_exactly(n)` (which returns fewer bytes only at the end); None at the end."""
    header = read_exactly(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_RESULT_BYTES:
        raise ProtocolError(f"a frame of {size} bytes (at most {MAX_RESULT_BYTES})")
    data = read_exactly(size)
    if len(data) < size:
        return None
    try:
        message = json.loads(data)
    except ValueError as e:
        raise ProtocolError(f"a frame that is not JSON ({e})") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("a frame without an op")
    return message


def exact_reader(read: Callable[[int], bytes]) -> Callable[[int], bytes]:
    """`read(n)` (a stream's read, a channel's recv) made to return exactly n bytes, or fewer only at the end."""
    def read_exactly(n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = read(left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    return read_exactly


# --- the server ------------------------------------------------------------------------------------


CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 16384, 1 << 18


def _own_mount_namespace() -> None:
    """Mounts made from here on (workspaces, their caps) are this process's and its children's: they end with it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() == 0 and libc.unshare(CLONE_NEWNS) == 0:
        libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)


def main() -> None:
    _own_mount_namespace()  # before any thread: unshare refuses a threaded process
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the channel
    read = exact_reader(stdin.read)
    write_lock = threading.Lock()

    def send(message: dict) -> None:
        with write_lock:
            stdout.write(frame_bytes(message))
            stdout.flush()

    hello = read_frame(read)
    if hello is None:
        return
    try:
        # The fleet retries infrastructure failures itself, on any host.
        config = SandboxSection.model_validate(hello.get("sandbox")).model_copy(update={"infra_retries": 0})
        sandbox = Sandbox(config)
    except Exception as e:  # a composer there that refuses these settings, or a sandbox that cannot run
        send({"op": "refused", "error": f"{type(e).__name__}: {e}"[:2000]})
        return
    threads = hello.get("threads")
    send({"op": "ready", "cpus": os.cpu_count() or 1, "isolation": dataclasses.asdict(sandbox.isolation)})
    # the fleet sends at most `threads` runs at once, and a health probe may come on top
    workers = ThreadPoolExecutor(max_workers=(threads if isinstance(threads, int) and threads > 0 else os.cpu_count() or 1) + 1)

    def run(number: int, request: SandboxRequest) -> None:
        send({"op": "started", "id": number})
        try:
            reply = {"op": "result", "id": number, "result": to_wire(serve_request(sandbox, request))}
        except Exception as e:
            reply = {"op": "failed", "id": number, "error": f"{type(e).__name__}: {e}"[:2000]}
        send(reply)

    store = Store(sandbox.root)
    workspaces = WorkspaceService(sandbox, store)

    def answer(number: int, work) -> None:
        try:
            reply = {"op": "reply", "id": number, "value": to_wire(work())}
        except Exception as e:
            reply = {"op": "failed", "id": number, "error": f"{type(e).__name__}: {e}"[:2000]}
        send(reply)

    def put(message: dict) -> None:
        """A chunk of a tree's archive (in order, on the reading thread); the last one has it checked and unpacked."""
        digest = str(message.get("digest"))
        if message.get("first"):
            store.begin(digest)
        store.chunk(digest, base64.b64decode(message.get("data", "")))
        if message.get("last"):
            relocate = message.get("relocate_from")
            workers.submit(answer, message.get("id"), lambda: store.receive(digest, relocate if isinstance(relocate, str) else None))

    while True:
        try:
            message = read_frame(read)
        except ProtocolError as e:
            print(f"sandbox server: {e}; closing", file=sys.stderr)
            break
        if message is None:
            break
        number = message.get("id")
        op = message["op"]
        if op == "have":
            answer(number, lambda: store.have(str(message.get("digest"))))
        elif op == "put":
            try:
                put(message)
            except Exception as e:
                send({"op": "failed", "id": number, "error": f"{type(e).__name__}: {e}"[:2000]})
        elif op == "ws_open":
            task = message.get("task")
            workers.submit(answer, number, lambda task=task: workspaces.open(_decoded(task, ShippedTask)))
        elif op == "tests":
            job = message.get("job")
            workers.submit(answer, number, lambda job=job: workspaces.test(_decoded(job, ShippedTests)))
        elif op == "ws":
            call = (message.get("workspace"), str(message.get("name")), message.get("arguments") or {})
            workers.submit(answer, number, lambda call=call: workspaces.call(*call))
        elif message["op"] == "run":
            try:
                request = from_wire(message.get("request"))
                if not isinstance(request, RunRequest):
                    raise ProtocolError("not a request")
            except (ProtocolError, ValueError) as e:
                send({"op": "failed", "id": number, "error": f"bad request: {e}"})
                continue
            workers.submit(run, number, request)
    # The driver hung up: end now; the sandbox's fork server kills the runs still going as its socket closes, and the
    # workspaces' mounts end with this mount namespace.
    sys.stderr.flush()
    os._exit(0)


def _decoded(node: object, kind: type):
    value = from_wire(node)
    if not isinstance(value, kind):
        raise ProtocolError(f"not a {kind.__name__}")
    return value


if __name__ == "__main__":
    main()
