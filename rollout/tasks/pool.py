"""The task pool: the recipe's task sets (function task sources and built repository task sets), their held-out
splits, and seeded, weighted draws (canaries included)."""

from __future__ import annotations

import random
import threading

from composer.recipes.env_schema import TaskSet
from composer.recipes.errors import UserError
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.functions import (
    CodeIOSource,
    HumanEvalSource,
    ReasoningGymSource,
    SmokeSource,
    Task,
    TaskSource,
    canary_of,
)
from composer.rollout.tasks.recall import RecallSource
from composer.rollout.tasks.repository.task_set import load_tasks, repo_tests


class RepoSource(TaskSource):
    """The validated tasks of a built repository task set (`composer env build`)."""

    name = "repo"

    def __init__(self, task_set: TaskSet):
        self._settings = task_set.repo
        self._records = load_tasks(task_set.repo)

    def __len__(self) -> int:
        return len(self._records)

    def task(self, index: int, sandbox: Sandbox) -> Task | None:
        record = self._records[index]
        return Task(id=record["id"], family="repo", prompt=record["prompt"], entry_point="", tests=repo_tests(record, self._settings))


def build_task_source(task_set: TaskSet) -> TaskSource:
    name = task_set.name
    if name == "humaneval":
        return HumanEvalSource()
    if name == "codeio":
        return CodeIOSource()
    if name == "rgym":
        return ReasoningGymSource()
    if name == "smoke":
        return SmokeSource()
    if name == "repo":
        return RepoSource(task_set)
    if name == "recall":
        return RecallSource(task_set.recall)
    raise UserError(f"env.tasks: unknown task set {name!r} (humaneval, codeio, rgym, smoke, repo, recall)")


def held_out_split(task_set: TaskSet, size: int) -> tuple[list[int], list[int]]:
    """(training, held-out) indices of a set of `size` tasks: its first `limit`, of which `held_out` chosen by a
    generator seeded by the set's name alone, so every run (any train.seed) holds out the same tasks."""
    in_use = list(range(min(size, task_set.limit or size)))
    if task_set.held_out >= len(in_use):
        raise UserError(
            f"env.tasks: {task_set.name} holds out {task_set.held_out} of its {len(in_use)} tasks in use; leave some to train on"
        )
    held_out = set(random.Random(f"held-out/{task_set.name}").sample(in_use, task_set.held_out))
    return [i for i in in_use if i not in held_out], sorted(held_out)


class TaskPool:
    """Draws tasks from the recipe's task sets by weight; the same seed draws the same tasks.

    A set with `limit` uses its first `limit` tasks, less the `held_out` ones kept for evaluation (`held_out`); a share
    `canaries` of draws is a canary of the drawn task. Tasks are built once and cached; a CodeI/O row whose
    reference fails is dropped and counted in `skipped`. Safe to call from several threads.
    """

    def __init__(self, task_sets: list[TaskSet], sandbox: Sandbox, seed: int, canaries: float = 0.0):
        self._sandbox = sandbox
        self._canaries = canaries
        self._rng = random.Random(seed)
        self._sets = [(ts, build_task_source(ts)) for ts in task_sets]
        self._indices, self._held_out = [], []
        for ts, src in self._sets:
            training, held_out = held_out_split(ts, len(src))
            self._indices.append(training)
            self._held_out.append(held_out)
        self._cache: dict[tuple[int, int], Task | None] = {}
        self._lock = threading.Lock()
        self.skipped: dict[str, int] = {ts.name: 0 for ts, _ in self._sets}

    @property
    def task_sets(self) -> list[TaskSet]:
        return [ts for ts, _ in self._sets]

    def indices(self, set_index: int) -> list[int]:
        """The task indices of a set that are in use (its first `limit`, minus those skipped so far)."""
        with self._lock:
            return list(self._indices[set_index])

    def held_out(self, set_index: int) -> list[int]:
        """The task indices of a set held out for evaluation (`held_out`): never drawn, never in `indices`."""
        return list(self._held_out[set_index])

    def task(self, set_index: int, index: int) -> Task | None:
        """Task `index` of task set `set_index` (built and cached on first use); None when it was skipped."""
        key = (set_index, index)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        # Built outside the lock so threads build different CodeI/O tasks at once; a task built twice
        # by a race comes out the same (its tests are seeded by its id).
        ts, source = self._sets[set_index]
        task = source.task(index, self._sandbox)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = task
                if task is None:
                    self.skipped[ts.name] += 1
                    if index in self._indices[set_index]:
                        self._indices[set_index].remove(index)
            return self._cache[key]

    def draw(self, rng: random.Random | None = None) -> Task:
        """A task drawn with `rng` (the pool's own seeded generator when None)."""
        rng = rng or self._rng
        while True:
            with self._lock:
                live = [i for i, indices in enumerate(self._indices) if indices]
                if not live:
                    raise UserError("env.tasks: every task of every set was skipped (their reference programs fail)")
                set_index = rng.choices(live, weights=[self._sets[i][0].weight for i in live])[0]
                index = rng.choice(self._indices[set_index])
            task = self.task(set_index, index)
            if task is not None and self._canaries:
                with self._lock:
                    wants_canary = self._rng.random() < self._canaries
                if wants_canary:
                    return canary_of(task) or task
            if task is not None:
                return task
