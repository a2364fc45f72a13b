"""A sandbox host's server program: `python -m composer.rollout.sandbox_host`, which the fleet
(`rollout.sandbox.hosts`) starts once per host over SSH, with the composer installed there, speaking the protocol of
`rollout.sandbox.wire` over the SSH channel's stdin/stdout.

It runs the real `Sandbox` on its host, so grading stays trusted there, and the repository workspaces the driver
opens there (`rollout.tasks.repository.shipping`); it runs the requests it is sent concurrently (the fleet keeps them
within the host's limit) and exits when its stdin closes, i.e. when the driver's SSH connection ends (the sandbox's
fork server then kills the runs still going). It sits above both tasks/ and sandbox/, which it serves.

The server lives in a mount namespace of its own (as root): the workspaces' views and tmpfs mounts end with it, so
a driver killed with -9 leaves nothing mounted on the host.
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.hosts import serve_request
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.sandbox.wire import (
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
from composer.rollout.tasks.repository.shipping import WIRE_TYPES, ShippedTask, ShippedTests, Store, WorkspaceService

MODULE = __spec__.name


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
        send({"op": Op.REFUSED, "error": f"{type(e).__name__}: {e}"[:2000]})
        return
    threads = hello.get("threads")
    cpus = len(os.sched_getaffinity(0))  # those it may use: a SLURM step bound to some of the node's CPUs has only those
    send({"op": Op.READY, "cpus": cpus, "isolation": dataclasses.asdict(sandbox.isolation)})
    # the fleet sends at most `threads` runs at once, and a health probe may come on top
    workers = ThreadPoolExecutor(max_workers=(threads if isinstance(threads, int) and threads > 0 else cpus) + 1)

    def run(number: int, request: SandboxRequest) -> None:
        send({"op": Op.STARTED, "id": number})
        try:
            reply = {"op": Op.RESULT, "id": number, "result": to_wire(serve_request(sandbox, request), WIRE_TYPES)}
        except Exception as e:
            reply = {"op": Op.FAILED, "id": number, "error": f"{type(e).__name__}: {e}"[:2000]}
        send(reply)

    store = Store(sandbox.root)
    workspaces = WorkspaceService(sandbox, store)

    def answer(number: int, work) -> None:
        try:
            reply = {"op": Op.REPLY, "id": number, "value": to_wire(work(), WIRE_TYPES)}
        except Exception as e:
            reply = {"op": Op.FAILED, "id": number, "error": f"{type(e).__name__}: {e}"[:2000]}
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
        if op == Op.HAVE:
            answer(number, lambda: store.have(str(message.get("digest"))))
        elif op == Op.PUT:
            try:
                put(message)
            except Exception as e:
                send({"op": Op.FAILED, "id": number, "error": f"{type(e).__name__}: {e}"[:2000]})
        elif op == Op.WS_OPEN:
            task = message.get("task")
            workers.submit(answer, number, lambda task=task: workspaces.open(_decoded(task, ShippedTask)))
        elif op == Op.TESTS:
            job = message.get("job")
            workers.submit(answer, number, lambda job=job: workspaces.test(_decoded(job, ShippedTests)))
        elif op == Op.WS:
            call = (message.get("workspace"), str(message.get("name")), message.get("arguments") or {})
            workers.submit(answer, number, lambda call=call: workspaces.call(*call))
        elif op == Op.RUN:
            try:
                request = from_wire(message.get("request"), WIRE_TYPES)
                if not isinstance(request, RunRequest):
                    raise ProtocolError("not a request")
            except (ProtocolError, ValueError) as e:
                send({"op": Op.FAILED, "id": number, "error": f"bad request: {e}"})
                continue
            workers.submit(run, number, request)
    # The driver hung up: end now; the sandbox's fork server kills the runs still going as its socket closes, and the
    # workspaces' mounts end with this mount namespace.
    sys.stderr.flush()
    os._exit(0)


def _decoded(node: object, kind: type):
    value = from_wire(node, WIRE_TYPES)
    if not isinstance(value, kind):
        raise ProtocolError(f"not a {kind.__name__}")
    return value


if __name__ == "__main__":
    main()
