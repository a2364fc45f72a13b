"""Start a run's ranks under torchrun on this host and turn their outcome into one clear result.

Rank 0 writes its live progress to the launcher's terminal; every rank's other output (warnings, tracebacks)
goes to `logs/rank-N.log`. A rank that stops on a UserError writes its message to `logs/error-rank-N.txt` and
exits 2; the launcher raises the lowest rank's message as a UserError of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from recipes.errors import UserError
from recipes.runs import RunDir, atomic_write_text

ERROR_PREFIX = "error-rank-"


class RanksFailed(Exception):
    """The ranks stopped on something that is not a user error (a bug or a crash); the logs tell more."""

    def __init__(self, exit_code: int, logs: Path, with_traceback: list[str], tail: str):
        self.exit_code, self.tail = exit_code, tail
        tracebacks = f"; tracebacks in {', '.join(with_traceback)}" if with_traceback else ""
        super().__init__(f"the ranks failed (torchrun exit code {exit_code}); logs in {logs}/{tracebacks}")


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
    logs = [launcher_log, *(run.logs / f"rank-{r}.log" for r in range(nproc))]
    offsets = {p: p.stat().st_size if p.exists() else 0 for p in logs}  # logs are appended to across resumes
    with launcher_log.open("a") as log:
        process = subprocess.Popen(cmd, env=env, stderr=log)
        try:
            code = process.wait()
        except KeyboardInterrupt:
            code = process.wait()  # torchrun got the same Ctrl-C and stops the ranks
            raise
    if code == 0:
        return
    error = first_rank_error(run)
    if error:
        raise UserError(error)
    written = {p: _read_from(p, offsets[p]) for p in logs}
    summary = written[launcher_log]
    # torchrun's own report names the rank that failed first, and how (exit code or signal)
    cause = summary[summary.rfind("Root Cause") :] if "Root Cause" in summary else "\n".join(summary.splitlines()[-15:])
    raise RanksFailed(code, run.logs, [p.name for p in logs[1:] if "Traceback" in written[p]], cause.strip())


def _read_from(path: Path, offset: int) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
