"""What every benchmark prints first: the machine its figures were measured on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's word for it."""
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.is_file() else []:
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()
