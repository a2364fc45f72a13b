"""Helpers for the processes a run starts: a free local port, and children that end with their parent."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import threading
from pathlib import Path


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


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when the thread that started it ends (torchrun ranks and
    vLLM servers run in sessions of their own, so a kill of the run's process group would not reach them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, sig)
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)
