"""The rank side of a launch (`cluster/launch.py` starts the ranks and reads what they leave here).

Rank 0 writes its live progress to the launcher's output; every rank's other output (warnings, tracebacks)
goes to `logs/rank-N.log`. A rank that stops on a UserError writes its message to `logs/error-rank-N.txt` and
exits 2; the launcher raises the lowest rank's message as a UserError of its own.
"""

from __future__ import annotations

import os
import sys

from cluster.launch import ERROR_PREFIX
from recipes.runs import RunDir, atomic_write_text


def redirect_rank_output(run: RunDir, rank: int) -> None:
    """Send this rank's stderr (and its stdout, except rank 0's progress) to logs/rank-N.log."""
    run.logs.mkdir(parents=True, exist_ok=True)
    log = os.open(run.logs / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 2)
    if rank != 0:
        os.dup2(log, 1)
    os.close(log)


def record_rank_error(run: RunDir, rank: int, message: str) -> None:
    atomic_write_text(run.logs / f"{ERROR_PREFIX}{rank}.txt", message)
