"""Start a run's ranks under torchrun on this host and turn their outcome into one clear result.

Rank 0 writes its live progress to the launcher's terminal; every rank's other output (libraries, warnings,
tracebacks) goes to `logs/rank-N.log`. A rank that stops on a UserError writes its message to `logs/error-rank-N.txt` and
exits 2; the launcher raises the lowest rank's message as a UserError of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TextIO

from recipes.errors import RunFailed, UserError
from recipes.processes import send_output_to
from recipes.runs import RunDir, atomic_write_text

ERROR_PREFIX = "error-rank-"


EXPLAIN_LINES = 6
"""Lines of a failed rank's traceback shown on the console (the log keeps all of it)."""


class RanksFailed(RunFailed):
    """The ranks stopped on something that is not a user error (a bug or a crash): the end of the first traceback
    (or torchrun's report of a rank that died) and where the logs are."""

    def __init__(self, who: str, exit_code: int, logs: Path, with_traceback: list[Path], tail: str):
        where = f"traceback in {with_traceback[0]}" if with_traceback else f"logs in {logs}/"
        super().__init__(f"{who} failed (torchrun exit code {exit_code}); {where}\n{tail}")


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


def first_rank_error(run: RunDir) -> str | None:
    """The user error of the lowest rank that recorded one, if any."""
    errors = sorted(run.logs.glob(f"{ERROR_PREFIX}*.txt"), key=lambda p: int(p.stem.removeprefix(ERROR_PREFIX)))
    return errors[0].read_text() if errors else None


def clear_rank_errors(run: RunDir) -> None:
    for stale in run.logs.glob(f"{ERROR_PREFIX}*.txt"):
        stale.unlink()


def torchrun_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """`python -m module args...` as `nproc` ranks on this host."""
    from recipes.processes import free_port

    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args,
    ]


def rank_environment() -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", **os.environ}  # one thread per rank is faster than ranks sharing cores
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")) if p)
    return env


def launch_ranks(run: RunDir, nproc: int, module: str, args: list[str]) -> None:
    """Run `python -m module args...` as `nproc` ranks on this host; returns when all succeeded.

    Raises UserError with a rank's message, or RanksFailed for anything else.
    """
    run.logs.mkdir(parents=True, exist_ok=True)
    clear_rank_errors(run)
    cmd, env = torchrun_command(nproc, module, args), rank_environment()
    launcher_log = run.logs / "torchrun.log"
    offsets = log_offsets(run, nproc, launcher_log)
    with launcher_log.open("a") as log:
        process = subprocess.Popen(cmd, env=env, stderr=log)
        try:
            code = process.wait()
        except KeyboardInterrupt:
            code = process.wait()  # torchrun got the same Ctrl-C and stops the ranks
            raise
    if code != 0:
        raise ranks_failure(run, code, offsets, "the ranks")


def log_offsets(run: RunDir, nproc: int, launcher_log: Path) -> dict[Path, int]:
    """Where the launcher's and the ranks' logs end now (they are appended to across resumes)."""
    logs = [launcher_log, *(run.logs / f"rank-{r}.log" for r in range(nproc))]
    return {p: p.stat().st_size if p.exists() else 0 for p in logs}


def ranks_failure(run: RunDir, code: int, offsets: dict[Path, int], who: str) -> UserError:
    """Why ranks started when the logs had `offsets` ended with `code`: the lowest rank's user error, or the end
    of the first traceback they wrote, or torchrun's report."""
    error = first_rank_error(run)
    if error:
        return UserError(error)
    launcher_log, *rank_logs = offsets
    written = {p: _read_from(p, offsets[p]) for p in offsets}
    with_traceback = [p for p in rank_logs if "Traceback" in written[p]]
    if with_traceback:
        tail = written[with_traceback[0]].strip().splitlines()[-EXPLAIN_LINES:]
    else:
        summary = written[launcher_log]
        # torchrun's own report names the rank that failed first, and how (exit code or signal)
        tail = (summary[summary.rfind("Root Cause"):] if "Root Cause" in summary else summary).strip().splitlines()[-15:]
    return RanksFailed(who, code, run.logs, with_traceback, "\n".join("  " + line for line in tail))


def _read_from(path: Path, offset: int) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
