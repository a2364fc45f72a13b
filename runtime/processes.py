"""Helpers for the processes a run starts: a free local port, children that end with their parent, and library
output kept in the run's logs instead of the terminal."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A local port free now, for a server that binds it seconds later (vLLM after its imports, torchrun's master).
    It comes from below the kernel's ephemeral range, so no connection or bind(0) in between, such as gloo's,
    can be given it, and it is never handed out twice by this process."""
    low = _ephemeral_low()
    with _handed_out_lock:
        for _ in range(1000):
            port = random.randrange(20000, low) if low > 20100 else _kernel_port()
            if port in _handed_out:
                continue
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    raise OSError("no free local port")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGKILL, forks_too: bool = False) -> None:
    """Have the kernel send `sig` to this process when the thread that started it ends (torchrun ranks and
    vLLM servers run in sessions of their own, so a kill of the run's process group would not reach them).

    With `forks_too`, every process this one forks without exec (Megatron's checkpoint writers, data workers) dies
    with it in turn: the kernel clears the request in a forked child, and such children outlived a killed rank."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, sig)
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)
    if forks_too:
        os.register_at_fork(after_in_child=lambda: die_with_parent(sig))


@contextlib.contextmanager
def output_to_log(log: Path) -> Iterator[TextIO]:
    """While inside, this process's stdout and stderr (file descriptors 1 and 2: Python loggers, C libraries and
    the children it starts alike) append to `log`; yields a line-buffered stream on the terminal they had, for
    composer's own lines. Leaving restores the terminal for composer's last words, and the interpreter's teardown
    goes to `log` again: libraries report there at exit (triton's nanobind "leaked functions"), kept, not shown."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    send_output_to(log)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    try:
        yield terminal
    finally:
        terminal.close()
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in zip((1, 2), saved):
            os.dup2(original, fd)
            os.close(original)
        atexit.register(send_output_to, log)  # runs after composer's own exit message, before the teardown


def send_output_to(log: Path) -> None:
    """Point file descriptors 1 and 2 at `log` (appending)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def resident_bytes() -> tuple[int, int]:
    """(resident set now, its high-water mark) of this process, in bytes (Linux /proc)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak_resident() -> None:
    """Restart the high-water mark from the resident set now (Linux >= 4.0: `echo 5 > /proc/self/clear_refs`), so
    the next `resident_bytes()` peak is that of what ran since."""
    Path("/proc/self/clear_refs").write_text("5")
