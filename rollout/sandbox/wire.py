"""The sandbox hosts' wire protocol, the one module both sides import: the fleet's driver (`rollout.sandbox.hosts`,
`rollout.tasks.repository.remote`) and the host's server program (`rollout.sandbox_host`).

The driver starts `python -m <SERVER_MODULE>` once per host over SSH and talks to it over the SSH channel's
stdin/stdout. A frame is a 4-byte big-endian length and a JSON object whose "op" is one of `Op`:

  driver -> server   {"op": "hello", "sandbox": <SandboxSection>, "threads": n}
                     {"op": "run", "id": n, "request": <wire>}
                     repository workspaces (`rollout.tasks.repository.shipping`): {"op": "have", "id", "digest"};
                     {"op": "put", "id", "digest", "data": base64, "last": bool, "relocate_from": path | null} (a
                     tree's archive in chunks); {"op": "ws_open", "id", "task": <wire>}; {"op": "ws", "id",
                     "workspace": n, "name": shell | run_tests | read | write | grade | close, "arguments": {...}};
                     {"op": "tests", "id", "job": <wire>} (a build's survey or validation run)
  server -> driver   {"op": "ready", "cpus": n, "isolation": {...}} or {"op": "refused", "error": "..."}
                     {"op": "started", "id": n}    {"op": "result", "id": n, "result": <wire>}
                     {"op": "reply", "id": n, "value": <wire>}    {"op": "failed", "id": n, "error": "..."}

Requests and results cross as data, never as pickles: dataclasses of an allow-list with their values in
`plain_data`, decoded strictly on each side. Each side passes the allow-list it speaks: `SANDBOX_TYPES` here (runs
and their results), which the repository room extends with its own types (`rollout.tasks.repository.shipping`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

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
from composer.rollout.sandbox.session import MAX_RESULT_BYTES

SERVER_MODULE = "composer.rollout.sandbox_host"
"""The host's server program (`python -m` it): named here, since nothing in sandbox/ may import the program itself."""
_HEADER = struct.Struct(">I")


class Op(StrEnum):
    """What a frame is: its "op"."""

    # driver -> server
    HELLO = "hello"
    RUN = "run"
    HAVE = "have"
    PUT = "put"
    WS_OPEN = "ws_open"
    WS = "ws"
    TESTS = "tests"
    # server -> driver
    READY = "ready"
    REFUSED = "refused"
    STARTED = "started"
    RESULT = "result"
    REPLY = "reply"
    FAILED = "failed"


@dataclass(frozen=True)
class RunRequest:
    """Grade `program` against `tests` (`Sandbox.run`)."""

    program: str
    tests: Tests
    reward: RewardMode = "fraction"


SandboxRequest = RunRequest
"""What a sandbox host is asked to do; each kind is served by `rollout.sandbox.hosts.serve_request`."""

WireTypes = Mapping[str, type]
"""An allow-list of the dataclasses that may cross, by name."""


def wire_types(*classes: type) -> dict[str, type]:
    return {cls.__name__: cls for cls in classes}


SANDBOX_TYPES = wire_types(
    RunRequest, AssertionTests, CallTests, GeneratedCalls, ScriptRun, CaseTests, Call, Statement, SandboxResult, CaseResult, CommandResult
)
"""What a run request and its result are made of."""


class ProtocolError(ValueError):
    """A frame that is not what the protocol allows."""


def to_wire(value, types: WireTypes) -> object:
    """`value` (a dataclass of `types`, a tuple of them, bytes, or plain data) as JSON-ready data."""
    if dataclasses.is_dataclass(value) and type(value).__name__ in types:
        return {"$dc": type(value).__name__, "fields": {f.name: to_wire(getattr(value, f.name), types) for f in dataclasses.fields(value)}}
    if type(value) is tuple and any(dataclasses.is_dataclass(v) for v in value):
        return {"$dcs": [to_wire(v, types) for v in value]}
    if type(value) is bytes:  # a command's report channel
        return {"$b": base64.b64encode(value).decode()}
    return {"$v": plain_data.encode(value)}


def from_wire(node: object, types: WireTypes) -> object:
    """The value `to_wire` made; anything else (a type not in `types`, a stray key) is a ProtocolError."""
    keys = set(node) if isinstance(node, dict) else None
    if keys == {"$v"} and isinstance(node["$v"], str):
        return plain_data.decode(node["$v"])
    if keys == {"$dcs"} and isinstance(node["$dcs"], list):
        return tuple(from_wire(v, types) for v in node["$dcs"])
    if keys == {"$b"} and isinstance(node["$b"], str):
        try:
            return base64.b64decode(node["$b"], validate=True)
        except ValueError:
            raise ProtocolError("bytes that are not base64") from None
    if keys != {"$dc", "fields"}:
        raise ProtocolError("not a wire value")
    cls = types.get(node["$dc"]) if isinstance(node["$dc"], str) else None
    fields = node["fields"]
    if cls is None or not isinstance(fields, dict) or set(fields) - {f.name for f in dataclasses.fields(cls)}:
        raise ProtocolError(f"not an allowed value: {str(node['$dc'])[:60]}")
    try:
        return cls(**{name: from_wire(v, types) for name, v in fields.items()})
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
