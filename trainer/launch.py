"""The rank side of a launch (`cluster/launch.py` starts the ranks and reads what they leave here).

Rank 0 writes its live progress to the launcher's terminal; every rank's other output (libraries, warnings,
tracebacks) goes to `logs/rank-N.log`. A rank that stops on a UserError writes its message to
`logs/error-rank-N.txt` and exits 2; the launcher raises the lowest rank's message as a UserError of its own.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from composer.cluster.launch import ERROR_PREFIX
from composer.runtime.processes import send_output_to
from composer.runtime.run_dir import RunDir, atomic_write_text


def redirect_rank_output(run: RunDir, rank: int) -> TextIO | None:
    """Send this rank's stdout and stderr (libraries included) to logs/rank-N.log; rank 0 gets back a stream on the
    launcher's terminal for its progress."""
    run.logs.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(1), "w", buffering=1) if rank == 0 else None
    send_output_to(run.logs / f"rank-{rank}.log")
    return terminal


def record_rank_error(run: RunDir, rank: int, message: str) -> None:
    atomic_write_text(run.logs / f"{ERROR_PREFIX}{rank}.txt", message)
