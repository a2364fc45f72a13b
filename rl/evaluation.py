"""Held-out evaluation: episodes of a policy on task sets, graded, and the figures they give.

Used by an RL run (`Evaluator`: its rollout engines evaluate the policy they hold between their groups) and by
`composer eval` (rl.checkpoint_eval: any checkpoint), through the same agent loop as training. Each evaluation runs
every task once greedily (temperature 0: pass@1) and `samples` times with the recipe's sampling (pass@k, unbiased
estimator), in batches of tasks; each batch's graded episodes are appended to a log as it ends, so an evaluation
that is stopped keeps them and, started again, runs only what is left. Episodes are seeded by their task's number
and a fixed seed, so every policy is sampled with the same random numbers (a paired comparison sees less noise).

In an RL run it happens before the first step, every `every` learner steps and after the last; the results go to
`eval_metrics.jsonl` (step = the policy's learner steps) and per task to `eval/vNNNNNN.json`.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from composer.recipes.env_schema import TaskSet
from composer.recipes.errors import UserError
from composer.recipes.schema import RLEvalSection
from composer.rollout.agent.environment import CodingEnvironment
from composer.rollout.agent.loop import EpisodeRunner
from composer.rollout.agent.trajectory import Trajectory
from composer.rollout.tasks.functions import Task
from composer.rollout.tasks.pool import TaskPool
from composer.runtime.run_dir import MetricsWriter, atomic_write_text, read_metrics

EVAL_SEED = 7_777_777
"""Seeds evaluation episodes apart from training groups (which are seeded by train.seed and the group index)."""
EVAL_BATCH_TASKS = 32
"""Tasks per batch of greedy episodes (a batch of sampled ones holds as many episodes)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from `n` samples of which `c` passed: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def bootstrap_interval(values: np.ndarray, confidence: float = 0.95, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-task values (tasks resampled with replacement); given
    per-task differences of two policies on the same tasks, the paired bootstrap interval of the difference."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def passed(trajectory: Trajectory) -> bool:
    """Every hidden test passed and no guard took the reward (an infrastructure failure, a task without tests or a
    flagged pass is no pass)."""
    total = trajectory.info.get("tests_total", 0)
    return total > 0 and trajectory.info.get("tests_passed", 0) == total and trajectory.reward > 0


def task_kind(task_id: str) -> str:
    """A task's kind within its set, from its id: `rgym/chain_sum/3` -> `rgym/chain_sum`, `repo/networkx/bug/..`
    -> `repo/networkx/bug`, `smoke/3` -> `smoke`."""
    return task_id.rsplit("/", 1)[0]


@dataclass
class EvalSet:
    name: str
    tasks: list[Task]
    skipped: int
    """Held-out tasks that could not be built (a CodeI/O reference that fails)."""


def held_out_sets(
    config: RLEvalSection, train_sets: list[TaskSet], env: CodingEnvironment, seed: int, allow_training_tasks: bool = False
) -> list[EvalSet]:
    """The tasks of every evaluated set: a trained set's held-out split, checked against the training pool (none of
    them can be drawn for training), or the whole of a set not trained on. With `allow_training_tasks` (`composer
    eval`), a trained set that holds nothing out is evaluated on the tasks it trains on."""
    sets = []
    for name in dict.fromkeys(config.tasks):
        trained = [i for i, ts in enumerate(train_sets) if ts.name == name]
        if trained:
            pool, set_index = env.pool, trained[0]
            indices = pool.held_out(set_index)
            overlap = set(indices) & set(pool.indices(set_index))
            if allow_training_tasks and not indices:
                indices = pool.indices(set_index)
            elif not indices or overlap:
                raise UserError(f"rl.eval: {name} has no held-out split disjoint from its training tasks (env.tasks.{set_index}.held_out)")
        else:
            pool, set_index = TaskPool([TaskSet(name=name)], env.sandbox, seed), 0
            indices = pool.indices(0)
        chosen = indices[: config.limit]
        tasks = [task for i in chosen if (task := pool.task(set_index, i)) is not None]
        sets.append(EvalSet(name, tasks, len(chosen) - len(tasks)))
    return sets


# --- episodes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradedEpisode:
    """What an evaluation keeps of one episode."""

    set: str
    task: str
    mode: str
    """`greedy` or `sampled`."""
    sample: int
    passed: bool
    reward: float
    tests_passed: int
    tests_total: int
    flags: list[str]
    infra_failure: bool
    end_reason: str
    turns: int
    summaries: int
    summary_tokens: list[int]
    compaction_errors: list[float] = field(default_factory=list)
    """Per compaction of the context, the share of the facts still needed later that it dropped (tasks that know
    their facts: `Task.facts`)."""
    tool_calls: int = 0
    """Tool calls the policy wrote (tools harness), parsed or not."""
    malformed_calls: int = 0
    """Of those, the ones the harness could not parse or that its schemas refuse."""
    tests_run: int = 0
    """Times the policy ran the tests (run_tests)."""
    tokens: int = 0
    """Tokens of the episode's context windows together (every segment, when compacted): what it cost to run."""
    generated_tokens: int = 0
    """Of those, the policy's own (replies and summaries)."""

    @property
    def key(self) -> tuple[str, str, str, int]:
        return self.set, self.task, self.mode, self.sample

    @classmethod
    def of(cls, set_name: str, mode: str, sample: int, t: Trajectory) -> GradedEpisode:
        i = t.info
        return cls(
            set_name,
            t.task_id,
            mode,
            sample,
            passed(t),
            t.reward,
            i.get("tests_passed", 0),
            i.get("tests_total", 0),
            list(i.get("flags", ())),
            bool(i.get("infra_failure")),
            i.get("end_reason", ""),
            i.get("turns", 0),
            i.get("summaries", 0),
            list(i.get("summary_tokens", ())),
            list(i.get("compaction_errors", ())),
            i.get("tool_calls", 0),
            i.get("malformed_calls", 0),
            i.get("tests_run", 0),
            t.num_tokens,
            sum(int(s.loss_mask.sum()) for s in t.segments),
        )


class GradedLog:
    """The graded episodes of one evaluation, one JSON line each, appended (and flushed) as each batch ends: a
    killed evaluation keeps every batch it finished. No path: kept in memory only."""

    def __init__(self, path: Path | None):
        self.path = path
        self.episodes: dict[tuple, GradedEpisode] = {}
        if path is not None and path.is_file():
            for record in read_metrics(path):
                record.pop("step", None)
                record.pop("time", None)
                episode = GradedEpisode(**record)
                self.episodes[episode.key] = episode
        self._writer = MetricsWriter(path) if path is not None else None
        self._lock = threading.Lock()

    def add(self, episodes: list[GradedEpisode]) -> None:
        with self._lock:
            for e in episodes:
                self.episodes[e.key] = e
                if self._writer:
                    self._writer.write(len(self.episodes), **asdict(e))

    def has(self, set_name: str, task_id: str, mode: str, samples: int) -> bool:
        return all((set_name, task_id, mode, s) in self.episodes for s in range(samples))

    def close(self) -> None:
        if self._writer:
            self._writer.close()


@dataclass(frozen=True)
class _Batch:
    set: str
    mode: str
    numbered: list[tuple[int, Task]]
    """The tasks and their numbers within the set (what seeds their episodes)."""

    @property
    def size(self) -> int:
        return len(self.numbered)


def episode_batches(sets: list[EvalSet], samples: int, log: GradedLog, batch_tasks: int = EVAL_BATCH_TASKS) -> list[_Batch]:
    """The batches still to run: per set its greedy episodes, then its sampled ones, less what `log` holds."""
    batches = []
    for s in sets:
        for mode, per_task in (("greedy", 1), ("sampled", samples)) if samples else (("greedy", 1),):
            todo = [(n, t) for n, t in enumerate(s.tasks) if not log.has(s.name, t.id, mode, per_task)]
            size = max(1, batch_tasks // per_task)
            batches += [_Batch(s.name, mode, todo[i : i + size]) for i in range(0, len(todo), size)]
    return batches


def run_episodes(
    runners: list[EpisodeRunner],
    sets: list[EvalSet],
    samples: int,
    log: GradedLog,
    policy_version: int,
    label: str,
    batch_tasks: int = EVAL_BATCH_TASKS,
    on_batch: Callable[[int, int], None] = lambda done, total: None,
) -> None:
    """Run what `log` does not hold yet, each runner taking the next batch (one engine each), into `log`;
    `on_batch(episodes done, episodes in all)` after each batch. The first error stops every runner and is raised."""
    batches = episode_batches(sets, samples, log, batch_tasks)
    total = sum(len(s.tasks) * (1 + samples) for s in sets)
    work: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
    for b in batches:
        work.put(b)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def serve(runner: EpisodeRunner) -> None:
        while not errors:
            try:
                b = work.get_nowait()
            except queue.Empty:
                return
            per_task = 1 if b.mode == "greedy" else samples
            numbers, tasks = [n for n, _ in b.numbered], [t for _, t in b.numbered]
            try:
                groups = runner.run_tasks(
                    tasks,
                    f"{label}-{b.set}-{b.mode}",
                    per_task,
                    policy_version,
                    EVAL_SEED + (b.mode == "sampled"),
                    temperature=0.0 if b.mode == "greedy" else None,
                    task_numbers=numbers,
                )
            except BaseException as e:
                errors.append(e)
                return
            log.add([GradedEpisode.of(b.set, b.mode, i, t) for group in groups for i, t in enumerate(group)])
            with lock:
                on_batch(len(log.episodes), total)

    if len(runners) == 1:
        serve(runners[0])
    else:
        threads = [threading.Thread(target=serve, args=(r,), name=f"eval-{n}") for n, r in enumerate(runners)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]


# --- figures -----------------------------------------------------------------------------------


def set_episodes(s: EvalSet, log: GradedLog, samples: int) -> tuple[list[GradedEpisode], list[list[GradedEpisode]]]:
    """A set's greedy episode per task and its sampled episodes per task, in task order."""
    greedy = [log.episodes[(s.name, t.id, "greedy", 0)] for t in s.tasks]
    sampled = [[log.episodes[(s.name, t.id, "sampled", i)] for i in range(samples)] for t in s.tasks] if samples else []
    return greedy, sampled


def set_record(name: str, greedy: list[GradedEpisode], sampled: list[list[GradedEpisode]], pass_k: list[int]) -> dict[str, float]:
    """The `eval_<set>_*` figures of one set (what eval_metrics.jsonl records)."""
    greedy_pass = np.array([float(g.passed) for g in greedy])
    low, high = bootstrap_interval(greedy_pass)
    record = {
        f"eval_{name}_greedy_pass@1": float(greedy_pass.mean()),
        f"eval_{name}_greedy_pass@1_low": low,
        f"eval_{name}_greedy_pass@1_high": high,
        f"eval_{name}_tasks": len(greedy),
        f"eval_{name}_greedy_reward": float(np.mean([g.reward for g in greedy])),
    }
    if sampled:
        samples = len(sampled[0])
        for k in pass_k:
            record[f"eval_{name}_pass@{k}"] = float(np.mean([pass_at_k(samples, sum(e.passed for e in group), k) for group in sampled]))
        record[f"eval_{name}_reward"] = float(np.mean([e.reward for group in sampled for e in group]))
    errors = [x for e in greedy for x in e.compaction_errors]
    lengths = [n for e in greedy for n in e.summary_tokens]
    if lengths:
        record[f"eval_{name}_summary_tokens"] = float(np.mean(lengths))
    if errors:
        record[f"eval_{name}_compaction_error"] = float(np.mean(errors))
    return record


def per_task_results(greedy: list[GradedEpisode], sampled: list[list[GradedEpisode]], samples: int) -> dict[str, dict]:
    """Per task: greedy pass, samples run and how many passed (eval/vNNNNNN.json, `composer eval`'s results)."""
    correct = [sum(e.passed for e in group) for group in sampled] if sampled else [0] * len(greedy)
    return {g.task: {"greedy": g.passed, "samples": samples, "correct": n} for g, n in zip(greedy, correct)}


# --- an RL run's evaluations -------------------------------------------------------------------


class Evaluator:
    """Decides when an evaluation is due, runs it on the engine that finds it due, and records it.

    Due once per `every` steps (the first policy version an engine holds in each window of `every` versions), for
    the starting policy and for the final one. What eval_metrics.jsonl already holds is not redone on resume, nor
    the batches of an evaluation a stop interrupted (eval/vNNNNNN.partial.jsonl).
    """

    def __init__(self, config: RLEvalSection, train_sets: list[TaskSet], env: CodingEnvironment, steps: int, seed: int, root: Path):
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
        partial = self.root / "eval" / f"v{version:06d}.partial.jsonl"
        log = GradedLog(partial)
        try:
            run_episodes([runner], self.sets, self.config.samples, log, version, f"eval-v{version}")
        except BaseException:
            with self._lock:
                self._taken.discard(self._window(version))
            raise
        finally:
            log.close()
        record: dict[str, float] = {}
        per_task: dict[str, dict] = {}
        for s in self.sets:
            if s.tasks:
                greedy, sampled = set_episodes(s, log, self.config.samples)
                record.update(set_record(s.name, greedy, sampled, self.config.pass_k))
                per_task.update(per_task_results(greedy, sampled, self.config.samples))
        record["eval_seconds"] = time.monotonic() - started
        atomic_write_text(self.root / "eval" / f"v{version:06d}.json", json.dumps(per_task, indent=1) + "\n")
        with self._lock:
            self.metrics.write(version, **record)
            self._done.add(self._window(version))
        partial.unlink(missing_ok=True)
        return record

    def close(self) -> None:
        self.metrics.close()


def summary_line(version: int, record: dict[str, float]) -> str:
    """The console's line for one evaluation."""
    parts = []
    for key, value in record.items():
        if key.endswith("_greedy_pass@1"):
            name = key[len("eval_") : -len("_greedy_pass@1")]
            parts.append(f"{name} greedy pass@1 {value:.3f} [{record[key + '_low']:.3f}, {record[key + '_high']:.3f}]")
        elif "_pass@" in key and "greedy" not in key:
            parts.append(f"{key[len('eval_') :]} {value:.3f}")
        elif key.endswith("_compaction_error"):
            parts.append(f"{key[len('eval_') :]} {value:.2f}")
    return f"eval v{version}: " + ", ".join(parts) + f"  ({record['eval_seconds']:.1f} s)"
