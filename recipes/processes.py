"""Helpers for the processes a run starts: a free local port, and children that end with their parent."""

from __future__ import annotations

import ctypes
import os
import signal
import socket


def free_port() -> int:
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
