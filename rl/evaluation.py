"""Held-out evaluation of an RL run's current policy, by its rollout engines between their groups.

The tasks are those no training group can draw: a trained set's held-out split (`env.tasks[].held_out`, owned by
the task pool) or the whole of a set the run does not train on. Each evaluation runs every task once greedily
(temperature 0: pass@1) and `samples` times with the recipe's sampling (pass@k, unbiased estimator), through the
same agent loop as training. It happens before the first step, every `every` learner steps and after the last;
the results go to `eval_metrics.jsonl` (step = the policy's learner steps) and per task to `eval/vNNNNNN.json`.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recipes.errors import UserError
from recipes.schema import RLEvalSection, TaskSet
from rollout.agent.environment import CodingEnvironment
from rollout.agent.loop import EpisodeRunner
from rollout.agent.trajectory import Trajectory
from rollout.tasks.functions import Task
from rollout.tasks.pool import TaskPool
from runtime.run_dir import MetricsWriter, atomic_write_text, read_metrics

EVAL_SEED = 7_777_777
"""Seeds evaluation sampling apart from training groups (which are seeded by train.seed and the group index)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from `n` samples of which `c` passed: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def bootstrap_interval(values: np.ndarray, confidence: float = 0.95, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-task values (tasks resampled with replacement)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def passed(trajectory: Trajectory) -> bool:
    """Every hidden test passed (an infrastructure failure or a task without tests is no pass)."""
    total = trajectory.info.get("tests_total", 0)
    return total > 0 and trajectory.info.get("tests_passed", 0) == total


@dataclass
class EvalSet:
    name: str
    tasks: list[Task]
    skipped: int
    """Held-out tasks that could not be built (a CodeI/O reference that fails)."""


def held_out_sets(config: RLEvalSection, train_sets: list[TaskSet], env: CodingEnvironment, seed: int) -> list[EvalSet]:
    """The tasks of every evaluated set, checked against the training pool: none of them can be drawn for training."""
    sets = []
    for name in dict.fromkeys(config.tasks):
        trained = [i for i, ts in enumerate(train_sets) if ts.name == name]
        if trained:
            pool, set_index = env.pool, trained[0]
            indices = pool.held_out(set_index)
            overlap = set(indices) & set(pool.indices(set_index))
            if not indices or overlap:
                raise UserError(f"rl.eval: {name} has no held-out split disjoint from its training tasks (env.tasks.{set_index}.held_out)")
        else:
            pool, set_index = TaskPool([TaskSet(name=name)], env.sandbox, seed), 0
            indices = pool.indices(0)
        chosen = indices[: config.limit]
        tasks = [task for i in chosen if (task := pool.task(set_index, i)) is not None]
        sets.append(EvalSet(name, tasks, len(chosen) - len(tasks)))
    return sets


class Evaluator:
    """Decides when an evaluation is due, runs it on the engine that finds it due, and records it.

    Due once per `every` steps (the first policy version an engine holds in each window of `every` versions), for
    the starting policy and for the final one. What eval_metrics.jsonl already holds is not redone on resume.
    """

    def __init__(self, config: RLEvalSection, train_sets: list[TaskSet], env: CodingEnvironment, steps: int,
                 seed: int, root: Path):
        self.config, self.steps = config, steps
        self.sets = held_out_sets(config, train_sets, env, seed)
        self.root = root
        path = root / "eval_metrics.jsonl"
        self._done = {self._window(r["step"]) for r in read_metrics(path)} if path.is_file() else set()
        self._taken: set[object] = set()
        self._lock = threading.Lock()
        self.metrics = MetricsWriter(path)

    def _window(self, version: int) -> object:
        return "final" if version == self.steps else version // self.config.every

    def claim(self, version: int) -> bool:
        """True (once per window) when the policy `version` is to be evaluated by the caller."""
        window = self._window(version)
        with self._lock:
            if window in self._done or window in self._taken:
                return False
            self._taken.add(window)
            return True

    def evaluate(self, runner: EpisodeRunner, version: int) -> dict[str, float]:
        """Evaluate policy `version` (held by `runner`'s engine, claimed first) and record it."""
        started = time.monotonic()
        try:
            record, per_task = self._run(runner, version)
        except BaseException:
            with self._lock:
                self._taken.discard(self._window(version))
            raise
        record["eval_seconds"] = time.monotonic() - started
        atomic_write_text(self.root / "eval" / f"v{version:06d}.json", json.dumps(per_task, indent=1) + "\n")
        with self._lock:
            self.metrics.write(version, **record)
            self._done.add(self._window(version))
        return record

    def _run(self, runner: EpisodeRunner, version: int) -> tuple[dict[str, float], dict]:
        c = self.config
        record: dict[str, float] = {}
        per_task: dict[str, dict] = {}
        for s in self.sets:
            if not s.tasks:
                continue
            greedy = runner.run_tasks(s.tasks, f"eval-v{version}-{s.name}-greedy", 1, version, EVAL_SEED + version, temperature=0.0)
            greedy_pass = np.array([float(passed(g[0])) for g in greedy])
            low, high = bootstrap_interval(greedy_pass)
            record.update({f"eval_{s.name}_greedy_pass@1": float(greedy_pass.mean()), f"eval_{s.name}_greedy_pass@1_low": low,
                           f"eval_{s.name}_greedy_pass@1_high": high, f"eval_{s.name}_tasks": len(s.tasks),
                           f"eval_{s.name}_greedy_reward": float(np.mean([g[0].reward for g in greedy]))})
            correct = [0] * len(s.tasks)
            if c.samples:
                sampled = runner.run_tasks(s.tasks, f"eval-v{version}-{s.name}-sampled", c.samples, version, EVAL_SEED + version + 1)
                correct = [sum(passed(t) for t in group) for group in sampled]
                for k in c.pass_k:
                    record[f"eval_{s.name}_pass@{k}"] = float(np.mean([pass_at_k(c.samples, n_ok, k) for n_ok in correct]))
                record[f"eval_{s.name}_reward"] = float(np.mean([t.reward for group in sampled for t in group]))
            for task, g, n_ok in zip(s.tasks, greedy, correct):
                per_task[task.id] = {"greedy": passed(g[0]), "samples": c.samples, "correct": n_ok}
        return record, per_task

    def close(self) -> None:
        self.metrics.close()


def summary_line(version: int, record: dict[str, float]) -> str:
    """The console's line for one evaluation."""
    parts = []
    for key, value in record.items():
        if key.endswith("_greedy_pass@1"):
            name = key[len("eval_"): -len("_greedy_pass@1")]
            parts.append(f"{name} greedy pass@1 {value:.3f} [{record[key + '_low']:.3f}, {record[key + '_high']:.3f}]")
        elif "_pass@" in key and "greedy" not in key:
            parts.append(f"{key[len('eval_'):]} {value:.3f}")
    return f"eval v{version}: " + ", ".join(parts) + f"  ({record['eval_seconds']:.1f} s)"
