"""A long-horizon task family (`recall`): facts spread over files of the workspace, read one per turn, all needed for
the final answer, so an episode longer than its context succeeds only if what it keeps of earlier turns (a summary)
still holds them.

Task i (seeded by i, the same on every machine): `parts` files `notes/part_<k>.txt`, each `filler_lines` lines of
log-like filler with numbers in it, `decoys` lines naming revoked codes of the part, and, on a line of its own at a
seeded position, the part's code (a 3-digit number). The three are the difficulty knobs: facts to keep, tokens per
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


def part_path(k: int) -> str:
    return f"notes/part_{k}.txt"


def _filler_line(rng: random.Random) -> str:
    return rng.choice(_FILLER).format(
        h=rng.randrange(24),
        m=rng.randrange(60),
        s=rng.randrange(60),
        w=rng.randrange(1, 9),
        n=rng.randrange(1000, 99999),
        ms=rng.randrange(5, 900),
        p=rng.randrange(10, 99),
    )


def recall_task(index: int, settings: RecallSettings) -> Task:
    decoys = f"/{settings.decoys}" if settings.decoys else ""  # tasks without decoys stay what they were
    rng = random.Random(f"recall/{index}/{settings.parts}/{settings.filler_lines}{decoys}")
    codes = rng.sample(range(100, 1000), settings.parts)
    others = [n for n in range(100, 1000) if n not in codes]
    files = []
    for k, code in enumerate(codes, 1):
        lines = [_filler_line(rng) for _ in range(settings.filler_lines)]
        for _ in range(settings.decoys):
            lines.insert(rng.randrange(len(lines) + 1), f"revoked code of part {k}: {rng.choice(others)}")
        lines.insert(rng.randrange(len(lines) + 1), f"CODE of part {k}: {code}")
        files.append((part_path(k), "\n".join(lines) + "\n"))
    n = settings.parts
    prompt = (
        f"Your workspace holds {n} files, {part_path(1)} to {part_path(n)}. Each holds one line `CODE of part K: "
        f"NUMBER` among log lines{' (revoked codes do not count)' if settings.decoys else ''}. Read the files in order, one per turn, with read_file. When your context fills up "
        f"you will be asked to summarize your work: keep every code you have read in the summary. After reading all "
        f"{n} files, write solution.py so that `answer()` returns the list of the {n} codes in order of the parts, "
        f"for example `def answer():\n    return [{', '.join(f'code{k}' for k in range(1, min(n, 3) + 1))}{', ...' if n > 3 else ''}]`, "
        f"then call finish."
    )
    cases = ("assert isinstance(candidate(), list)", *(f"assert candidate()[{k}] == {code}" for k, code in enumerate(codes)))
    return Task(
        id=f"recall/{n}/{index}",
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
