"""What `composer train rl` shows while it runs: one live view on a terminal, a plain line now and then elsewhere.

The rollout figures come from this process (each group as an engine hands it off); the step figures from the
learner's metrics.jsonl, read as it grows (the learner is another process).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from composer.runtime.progress import StepClock, duration_text

RECENT_SECONDS = 60.0
"""Generated tokens/s is measured over the groups of the last minute."""
CLIP_FRACTION_ALARM = 0.2


def alarms(record: dict) -> list[str]:
    """What in a learner step's record needs a look (the README's RL section says what each means)."""
    found = []
    if not all(math.isfinite(_number(record.get(key, 0.0))) for key in ("loss", "grad_norm")):
        found.append("loss or grad norm not finite")
    if record.get("dropped_stale", 0) > 0:
        found.append(f"{record['dropped_stale']} stale group(s) dropped")
    if _number(record.get("is_clip_fraction", 0.0)) > CLIP_FRACTION_ALARM:
        found.append(f"importance-sampling clip fraction {record['is_clip_fraction']:.2f}")
    found += [key.removeprefix("alarm_") for key, value in record.items() if key.startswith("alarm_") and value]
    return found


def sandbox_line(stats: dict) -> str:
    """The sandbox fleet in one line: hosts up, latency tails, what failed."""
    failures = ", ".join(f"{cause} {n}" for cause, n in sorted(stats["sandbox_failures"].items())) or "none"
    return (
        f"hosts {stats['sandbox_hosts_up']}/{stats['sandbox_hosts']} up   queue wait p95 {stats['sandbox_queue_wait_p95']:.2f} s   "
        f"start p95 {stats['sandbox_start_p95']:.3f} s   retries {stats['sandbox_retries']}   "
        f"infra {stats['sandbox_infra_failures']}   failures {failures}"
    )


def _number(value: object) -> float:
    if isinstance(value, str):  # MetricsWriter records nan/inf as strings
        return float(value) if value in ("nan", "inf", "-inf") else 0.0
    return float(value) if isinstance(value, (int, float)) else 0.0


class MetricsTail:
    """The records appended to a metrics.jsonl since the last read (a line still being written waits). A file
    replaced meanwhile (a resuming learner drops the records past its checkpoint) is read again from its start."""

    def __init__(self, path: Path):
        self.path, self.offset, self.inode = path, 0, None
        self.restarted = False
        """Whether the last read started over on a replaced file."""

    def new_records(self) -> list[dict]:
        self.restarted = False
        try:
            with self.path.open("rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self.inode or os.fstat(f.fileno()).st_size < self.offset:
                    self.restarted, self.inode, self.offset = self.offset > 0, inode, 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        records = []
        for line in complete.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # not a record: the learner writes whole lines, a crash may have left half of one
        return records


class RLConsole:
    """The run's view; `group` is called by engine threads, everything else by the driver's thread."""

    def __init__(self, console: Console, name: str, steps: int, metrics: Path, verbose: bool):
        self.console, self.name, self.steps, self.verbose = console, name, steps, verbose
        self.tail = MetricsTail(metrics)
        self.live = console.is_terminal
        self.phase = "starting"
        self.last: dict = {}
        self.held_out: dict = {}
        self.step = 0
        self.clock: StepClock | None = None
        self.groups = 0
        self._sandboxes: dict = {}
        """The sandbox fleet's figures, as of the newest group."""
        self._recent: deque[tuple[float, float]] = deque()
        """(time, generated tokens) of the groups of the last RECENT_SECONDS."""
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._printed_step = -1
        self._view: Live | None = None

    def __enter__(self) -> RLConsole:
        for record in self.tail.new_records():  # a resumed run starts from the steps already done
            self._take(record)
        self.clock = StepClock(self.steps, self.step)
        if self.live:
            # stdout and stderr stay the log's: Live would otherwise show what the libraries print above the view
            self._view = Live(
                get_renderable=self.render,
                console=self.console,
                refresh_per_second=2,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._view.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.poll()
        if self._view:
            self._view.stop()
        elif self.step and self.step != self._printed_step:  # the last step seen, whatever the period
            self._print_plain()

    def note(self, phase: str) -> None:
        """What the run does now (publishing the first policy, starting engines, ...)."""
        self.phase = phase
        if not self.live:
            self.console.print(f"rl: {phase}", highlight=False)

    def evaluation(self, line: str) -> None:
        """A held-out evaluation's result: a line of its own, above the live view."""
        self.console.print(f"[bold]{escape(line)}[/]", highlight=False)

    def group(self, group: str, stats: dict) -> None:
        with self._lock:
            self.groups += 1
            if "sandbox_hosts" in stats:
                self._sandboxes = stats
            now = time.monotonic()
            self._recent.append((now, stats["generated_tokens_per_s"] * stats["group_seconds"]))
            while self._recent and self._recent[0][0] < now - RECENT_SECONDS:
                self._recent.popleft()
        if self.verbose:
            self.console.print(
                f"[dim]{group}[/] engine {stats['engine']} ({escape(stats['host'])})  policy v{stats['policy_version']}  "
                f"reward {stats['reward_mean']:.3f}  {stats['generated_tokens_per_s']:.0f} tok/s",
                highlight=False,
            )

    def poll(self) -> None:
        """Take the learner's new steps; print a plain line when one is due (not on a terminal)."""
        with self._poll_lock:
            new = self.tail.new_records()
            if self.tail.restarted:
                self.step, self.last = 0, {}
            for record in new:
                self._take(record)
        if new and not self.live and self.clock.plain_due(self.step):
            self._print_plain()

    def _print_plain(self) -> None:
        self._printed_step = self.step
        self.console.print(self.plain_line(), highlight=False)

    def _take(self, record: dict) -> None:
        self.step = max(self.step, int(record.get("step", 0)))
        self.last = record
        held_out = {k: v for k, v in record.items() if k.startswith("eval_") and isinstance(v, (int, float))}
        if held_out:
            self.held_out = held_out

    def generated_tokens_per_s(self) -> float:
        with self._lock:
            if not self._recent:
                return 0.0
            window = min(RECENT_SECONDS, max(time.monotonic() - self.clock.started, 1e-9))
            return sum(tokens for _, tokens in self._recent) / window

    def figures(self) -> list[tuple[str, str]]:
        r = self.last

        def value(key: str, spec: str) -> str:  # a figure the learner's record lacks shows as "-"
            return format(_number(r[key]), spec) if key in r else "-"

        rows = []
        if r:
            rows.append(("reward", f"{value('reward_mean', '.3f')}   pass rate {value('pass_rate', '.3f')}"))
            if self.held_out:
                rows.append(("held-out", "   ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in self.held_out.items())))
            rows.append(("staleness", f"mean {value('staleness_mean', '.2f')}   max {value('staleness_max', '.0f')}"))
        trained = f"   trained {value('trained_tokens_per_s', '.0f')}" if r else ""
        rows.append(("tokens/s", f"generated {self.generated_tokens_per_s():.0f}{trained}"))
        if "sync_seconds" in r:
            size = "nothing changed" if r.get("sync_bytes") == 0 else f"ratio {value('sync_ratio', '.1f')}x"
            rows.append(("last sync", f"v{self.step}   {size}   {value('sync_seconds', '.2f')} s"))
        waiting = f"   waiting {value('wait_seconds', '.1f')} s of the last step" if r else ""
        rows.append(("groups", f"{self.groups} made here{waiting}"))
        if self._sandboxes:
            rows.append(("sandboxes", sandbox_line(self._sandboxes)))
        found = alarms(r) if r else []
        rows.append(("alarms", ", ".join(found) if found else "none"))
        return rows

    def render(self) -> Group:
        self.poll()
        done = self.step
        header = Text.assemble((f"rl {self.name}", "bold"), f"  step {done}/{self.steps}  ")
        bar = ProgressBar(total=self.steps, completed=done, width=30)
        timing = Text(f"  elapsed {duration_text(time.monotonic() - self.clock.started)}  eta {self.clock.eta_text(done)}  ({self.phase})")
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        for label, value in self.figures():
            table.add_row(label, value)
        line = Table.grid()
        line.add_row(header, bar, timing)
        return Group(line, table)

    def plain_line(self) -> str:
        figures = "  ".join(f"{label} {value}" for label, value in self.figures() if label not in ("groups", "sandboxes"))
        return f"rl step {self.step}/{self.steps}  eta {self.clock.eta_text(self.step)}  " + " ".join(figures.split())
