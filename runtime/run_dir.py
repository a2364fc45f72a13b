"""The run directory and the durable-write helpers every loop uses.

Layout of `runs/<name>/`:
    recipe.yaml      the fully resolved recipe of the run (rewritten on every start or resume)
    metrics.jsonl    one JSON object per record: {"step": .., "time": .., "<series>": value, ...}
    logs/            per-process logs; failure.txt when the run last stopped on an error
    checkpoints/     training checkpoints
    .lock            held (flock) by the process driving the run while it lives, kill -9 included
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from composer.recipes.errors import UserError
from composer.recipes.schema import Recipe


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(staged: Path, final: Path) -> None:
    """Make a fully written directory visible under its final name: fsync its files, rename, fsync the parent."""
    for path in staged.iterdir():
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    staged.rename(final)
    fsync_dir(final.parent)


class MetricsWriter:
    """Appends one JSON line per record and flushes it, so a killed run keeps every record written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        _drop_torn_tail(path)
        self._file: IO[str] = path.open("a")

    def write(self, step: int, **values: Any) -> None:
        record = {"step": step, "time": round(time.time(), 3)}
        for key, value in values.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = str(value)  # JSON has no NaN/inf; keep them visible rather than invalid
            record[key] = value
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line left unfinished by a killed writer, so appended records start on their own line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def read_metrics(path: Path) -> Iterator[dict]:
    """Records of a metrics file; a torn last line (killed writer) is skipped."""
    with path.open() as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def drop_records_after(path: Path, step: int) -> None:
    """Remove the records past `step` (written by a killed run after the checkpoint it resumes from)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True) if _step_of(line) is not None and _step_of(line) <= step]
    atomic_write_text(path, "".join(kept))


def _step_of(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None  # a torn line


FAILURE_FILE = "failure.txt"


class RunDir:
    """`<run.dir>/<run.name>/` of a recipe."""

    def __init__(self, root: Path):
        self.root = root
        self._lock_fd: int | None = None

    @classmethod
    def of(cls, recipe: Recipe) -> RunDir:
        # absolute, so every process of the run (ranks, sandboxes) finds it whatever its working directory
        return cls(Path(recipe.run.dir).resolve() / recipe.run.name)

    @property
    def recipe_path(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def prepare(self, recipe_yaml: str, resume: bool) -> None:
        """Create the run directory and save the resolved recipe.

        A fresh start refuses a directory that already holds a run, so nothing is overwritten by accident.
        """
        if not resume and self.metrics_path.exists():
            raise UserError(f"{self.root} already holds a run; pass --resume to continue it, or choose another run.name")
        if resume and not self.root.is_dir():
            raise UserError(f"--resume: no run at {self.root}")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.hold()
        (self.logs / FAILURE_FILE).unlink(missing_ok=True)
        atomic_write_text(self.recipe_path, recipe_yaml)

    @property
    def lock_path(self) -> Path:
        return self.root / ".lock"

    def hold(self) -> None:
        """Take the run's lock for the life of this process (the kernel drops it when the process ends)."""
        if self._lock_fd is not None:
            return
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"{self.root} is in use by another composer process ({self.holder() or 'pid unknown'})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\n".encode())
        self._lock_fd = fd

    def holder(self) -> str | None:
        """'pid N' of the live process driving the run, or None when none holds it."""
        if not self.lock_path.is_file():
            return None
        fd = os.open(self.lock_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return self.lock_path.read_text().strip() or "pid unknown"
        finally:
            os.close(fd)  # also drops the shared lock taken just now
        return None

    @contextlib.contextmanager
    def failures_recorded(self):
        """Inside, an error that stops the run is kept in logs/failure.txt (for `composer runs`); an interrupt is not
        a failure: the run stays resumable."""
        try:
            yield
        except Exception as e:
            atomic_write_text(self.logs / FAILURE_FILE, str(e) or type(e).__name__)
            raise

    def metrics(self) -> MetricsWriter:
        return MetricsWriter(self.metrics_path)
