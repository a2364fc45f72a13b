"""A long-horizon task family (`recall`): facts spread over files of the workspace, read one per turn, all needed for
the final answer, so an episode longer than its context succeeds only if what it keeps of earlier turns (a summary)
still holds them.

Task i (seeded by i, the same on every machine): `parts` files `notes/part_<k>.txt`, each `filler_lines` lines of
log-like filler with numbers in it, `decoys` lines naming revoked codes of the part, and, on a line of its own at a
seeded position, the part's code (a 3-digit number). The `repository` layout holds the same facts in source modules
the agent reads first, `app/part_<k>.py`: short functions and constants around `PART_<k>_CODE = <code>` (decoys
`REVOKED_PART_<k>_CODE = ...`). The three are the difficulty knobs: facts to keep, tokens per
turn (how many turns fit a context, so how far back a fact was read when the context fills), look-alikes to tell
apart. The
policy reads the files with the tools harness's `read_file`, then writes `answer()` in solution.py returning the
codes in order, and calls finish. The hidden tests check the list's type and each code (partial credit per code);
the graded program runs in a fresh sandbox directory without the notes, so only codes the episode kept in its
context can be returned. The codes are the task's `facts`: the agent loop checks each compaction of the context for
them (rollout.agent.loop: compaction error).

A shell command that prints every file at once (`cat notes/*`) gathers the codes in fewer turns; with the
observation budget a file's worth of output at a time, such a read is cut, and the family measures what the prompt
asks for: one file per turn.
"""

from __future__ import annotations

import random

from composer.recipes.env_schema import RecallSettings
from composer.rollout.sandbox.results import AssertionTests
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.functions import Task, TaskSource

RECALL_TASKS = 1000

_FILLER = (
    "{h:02d}:{m:02d}:{s:02d} worker-{w} processed batch {n} in {ms} ms",
    "{h:02d}:{m:02d}:{s:02d} cache hit ratio {p}% over {n} lookups",
    "{h:02d}:{m:02d}:{s:02d} queue depth {w} (limit {n})",
    "{h:02d}:{m:02d}:{s:02d} retry {w} of request {n} after {ms} ms",
    "{h:02d}:{m:02d}:{s:02d} shard {w} holds {n} rows",
)


_MODULE_FILLER = (
    "TIMEOUT_MS_{w} = {n}",
    "def worker_{w}(queue):\n    return queue.take({n})",
    "CACHE_ROWS = {n}  # shard {w}",
    "def retry_{w}(request):\n    return request.again(after_ms={ms})",
    "HIT_RATIO_{w} = {p}  # percent, over {n} lookups",
)


def part_path(k: int, layout: str = "notes") -> str:
    return f"notes/part_{k}.txt" if layout == "notes" else f"app/part_{k}.py"


def _filler_line(rng: random.Random, layout: str) -> str:
    return rng.choice(_FILLER if layout == "notes" else _MODULE_FILLER).format(
        h=rng.randrange(24),
        m=rng.randrange(60),
        s=rng.randrange(60),
        w=rng.randrange(1, 9),
        n=rng.randrange(1000, 99999),
        ms=rng.randrange(5, 900),
        p=rng.randrange(10, 99),
    )


def _code_line(k: int, code: int, layout: str, revoked: bool = False) -> str:
    if layout == "notes":
        return f"{'revoked code' if revoked else 'CODE'} of part {k}: {code}"
    return f"{'REVOKED_' if revoked else ''}PART_{k}_CODE = {code}"


def recall_task(index: int, settings: RecallSettings) -> Task:
    layout = settings.layout
    # tasks of the notes layout without decoys stay what they were before either knob existed
    knobs = (f"/{settings.decoys}" if settings.decoys else "") + (f"/{layout}" if layout != "notes" else "")
    rng = random.Random(f"recall/{index}/{settings.parts}/{settings.filler_lines}{knobs}")
    codes = rng.sample(range(100, 1000), settings.parts)
    others = [n for n in range(100, 1000) if n not in codes]
    files = []
    for k, code in enumerate(codes, 1):
        lines = [_filler_line(rng, layout) for _ in range(settings.filler_lines)]
        for _ in range(settings.decoys):
            lines.insert(rng.randrange(len(lines) + 1), _code_line(k, rng.choice(others), layout, revoked=True))
        lines.insert(rng.randrange(len(lines) + 1), _code_line(k, code, layout))
        files.append((part_path(k, layout), "\n".join(lines) + "\n"))
    n = settings.parts
    first, last = part_path(1, layout), part_path(n, layout)
    if layout == "notes":
        where = f"Your workspace holds {n} files, {first} to {last}. Each holds one line `CODE of part K: NUMBER` among log lines"
        revoked = " (revoked codes do not count)"
    else:
        where = f"Your repository holds {n} modules, {first} to {last}. Each defines `PART_K_CODE = NUMBER` among other code"
        revoked = " (REVOKED_ ones do not count)"
    prompt = (
        f"{where}{revoked if settings.decoys else ''}. Read the files in order, one per turn, with read_file. When your context fills up "
        f"you will be asked to summarize your work: keep every code you have read in the summary. After reading all "
        f"{n} files, write solution.py so that `answer()` returns the list of the {n} codes in order of the parts, "
        f"for example `def answer():\n    return [{', '.join(f'code{k}' for k in range(1, min(n, 3) + 1))}{', ...' if n > 3 else ''}]`, "
        f"then call finish."
    )
    if layout != "notes":  # the graded program runs alone: an import of the modules would fail there
        prompt += " solution.py runs without the other files: write the numbers themselves."
    cases = ("assert isinstance(candidate(), list)", *(f"assert candidate()[{k}] == {code}" for k, code in enumerate(codes)))
    return Task(
        id=f"recall/{n}/{index}" if layout == "notes" else f"recall/{layout}/{n}/{index}",
        family="recall",
        prompt=prompt,
        entry_point="answer",
        tests=AssertionTests(entry_point="answer", setup="", cases=cases),
        continues="def answer():\n    return []\n",
        reference=f"def answer():\n    return {codes!r}\n",
        files=tuple(files),
        facts=tuple(str(c) for c in codes),
    )


class RecallSource(TaskSource):
    name = "recall"

    def __init__(self, settings: RecallSettings):
        self._settings = settings

    def __len__(self) -> int:
        return RECALL_TASKS

    def task(self, index: int, sandbox: Sandbox) -> Task | None:
        return recall_task(index, self._settings)
