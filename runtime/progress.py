"""How a long loop reports as it runs: on its terminal a live view when it is one, plain periodic lines when it is
not (CI, a pipe, a file: short, no control codes); and every record's numbers as TensorBoard scalars."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

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


class TensorBoard:
    """The numeric values of each metrics record as TensorBoard scalars in `directory` (a resumed run first hides
    the events a killed run wrote past the step it resumes from)."""

    def __init__(self, directory: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(directory), purge_step=first_step + 1 if first_step else None)

    def write(self, step: int, record: dict) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
