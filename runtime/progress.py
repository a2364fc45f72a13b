"""How a long loop reports as it runs: on its terminal a live view when it is one, plain periodic lines when it is
not (CI, a pipe, a file: short, no control codes); and every record's numbers to the experiment trackers: TensorBoard
always, Weights & Biases and MLflow when installed and configured."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from composer.runtime.run_dir import atomic_write_text

log = logging.getLogger("composer.trackers")

PLAIN_EVERY_SECONDS = 60.0
"""The least time between two plain progress lines (the first and the last step are always printed)."""


@dataclass
class StepClock:
    """Steps done since this process started and the estimate of the time left."""

    total: int
    start_step: int
    started: float = field(default_factory=time.monotonic)
    _last_plain: float | None = None

    def eta_seconds(self, done: int) -> float | None:
        made = done - self.start_step
        if made <= 0:
            return None
        return (time.monotonic() - self.started) / made * (self.total - done)

    def eta_text(self, done: int) -> str:
        return duration_text(self.eta_seconds(done))

    def plain_due(self, done: int, now_anyway: bool = False) -> bool:
        """Whether a plain line for step `done` is due: one every PLAIN_EVERY_SECONDS, the first, the last, and
        when the caller has news (`now_anyway`: an evaluation)."""
        now = time.monotonic()
        if self._last_plain is None or done >= self.total or now_anyway or now - self._last_plain >= PLAIN_EVERY_SECONDS:
            self._last_plain = now
            return True
        return False


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _numbers(record: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k not in ("step", "time")
    }


class TensorBoard:
    """The numeric values of each metrics record as TensorBoard scalars in `directory` (a resumed run first hides
    the events a killed run wrote past the step it resumes from)."""

    def __init__(self, directory: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(directory), purge_step=first_step + 1 if first_step else None)

    def write(self, step: int, record: dict) -> None:
        for key, value in _numbers(record).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbRun:
    """A Weights & Biases run of the run directory (its files under RUN/wandb/), resumed under the same id."""

    def __init__(self, run_root: Path, name: str, run_id: str):
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "composer"), name=name, id=run_id, dir=str(run_root), resume="allow")

    def write(self, step: int, record: dict) -> None:
        self._run.log(_numbers(record), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowRun:
    """An MLflow run of the run directory in the tracking store of MLFLOW_TRACKING_URI (a file store, a server),
    resumed under the same id."""

    def __init__(self, name: str, run_id: str | None):
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient()
        if run_id is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "composer")
            found = self._client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
            run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        self.run_id = run_id

    def write(self, step: int, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in _numbers(record).items()]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class Trackers:
    """Every metrics record of a run goes to TensorBoard (`RUN/tensorboard/`), and to Weights & Biases when `wandb` is
    installed and WANDB_MODE (`offline` included) or WANDB_API_KEY is set, and to MLflow when `mlflow` is installed
    and MLFLOW_TRACKING_URI is set. Neither is required; one that fails to start is logged and left out. A resumed run
    logs into the same W&B and MLflow runs (their ids are kept in RUN/trackers.json)."""

    def __init__(self, run_root: Path, name: str, first_step: int):
        self._sinks: list = [TensorBoard(run_root / "tensorboard", first_step)]
        ids_path = run_root / "trackers.json"
        ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        if (os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY")) and importlib.util.find_spec("wandb"):
            ids.setdefault("wandb", uuid.uuid4().hex[:16])
            self._start("wandb", lambda: WandbRun(run_root, name, ids["wandb"]))
        if os.environ.get("MLFLOW_TRACKING_URI") and importlib.util.find_spec("mlflow"):
            if run := self._start("mlflow", lambda: MlflowRun(name, ids.get("mlflow"))):
                ids["mlflow"] = run.run_id
        if ids:
            atomic_write_text(ids_path, json.dumps(ids) + "\n")

    def _start(self, tracker: str, start):
        try:
            sink = start()
        except Exception as e:  # a tracker is a convenience: the run goes on without it
            log.warning("%s: not logging there: %s: %s", tracker, type(e).__name__, e)
            return None
        self._sinks.append(sink)
        return sink

    def write(self, step: int, record: dict) -> None:
        for sink in self._sinks:
            sink.write(step, record)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def print_whole_table(console, table) -> None:
    """Print a rich table with nothing cut: on a terminal it fits the terminal (long text folds onto more lines);
    written to a pipe or a file, which has no width to fit, it is printed at its natural width."""
    if console.is_terminal:
        console.print(table)
        return
    from rich.console import Console
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update(width=100_000), table).maximum
    Console(file=console.file, width=max(natural, console.width), no_color=console.no_color).print(table)
