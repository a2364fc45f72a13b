"""The rollout role of an RL run: follow the newest policy, run groups of episodes, hand them to the learner.

Group n always plays the same task (drawn from a generator seeded by n) and is written once, whole; after a
crash the smallest indices never written are generated first, so no group is lost or made twice.
"""

from __future__ import annotations

import random
from collections import Counter
import time
from collections.abc import Callable

from recipes.runs import MetricsWriter
from recipes.schema import Recipe
from rl.layout import RLRunFiles, sync_section
from rollout.agent import EpisodeRunner, Tokenizer
from rollout.engine import EmbeddedEngine
from rollout.environment import CodingEnvironment
from rollout.tasks import Task
from rollout.trajectories import TrajectoryStore, episode_stats
from sync.receiver import pull
from sync.store import Store


def group_id(index: int) -> str:
    return f"g{index:07d}"


class RolloutWorker:
    def __init__(self, recipe: Recipe, files: RLRunFiles, on_group: Callable[[str, dict], None] = lambda gid, stats: None):
        self.recipe = recipe
        self.files = files
        self.on_group = on_group
        self.store = TrajectoryStore(files.trajectories)
        self.env = CodingEnvironment(recipe.env, seed=recipe.train.seed, sandbox_root=files.root / "sandbox")
        self.version = self._pull_newest()
        weights = files.receiver / "current"
        self.engine = EmbeddedEngine(weights, recipe.rollout, seed=recipe.train.seed,
                                     routed_experts=recipe.model.is_moe and recipe.rl.router_replay == "r3")
        self.runner = EpisodeRunner(self.engine, Tokenizer(str(weights)), self.env, recipe.rollout)
        self.done = {int(g[1:]) for g in self.store.known_groups()}
        self.made_with = Counter(self.store.load(g)[0].policy_version for g in self.store.ready_groups())
        self.metrics = MetricsWriter(files.root / "rollout_metrics.jsonl")

    def _pull_newest(self) -> int:
        policy = self.files.policy()
        with Store.open(sync_section(self.recipe, self.files).store, self.recipe.cluster.ssh) as store:
            pull(store, self.files.receiver, policy.store_version)
        return policy.version

    def follow_policy(self) -> None:
        policy = self.files.policy()
        if policy.version > self.version:
            self._pull_newest()
            self.engine.load_weights(self.files.receiver / "current")
            self.version = policy.version

    def next_index(self) -> int:
        index = 0
        while index in self.done:
            index += 1
        return index

    def task_for(self, index: int) -> Task:
        pool = self.env.pool
        rng = random.Random(f"{self.recipe.train.seed}/{index}")
        while True:
            live = [i for i in range(len(pool.task_sets)) if pool.indices(i)]
            set_index = rng.choices(live, weights=[pool.task_sets[i].weight for i in live])[0]
            task = pool.task(set_index, rng.choice(pool.indices(set_index)))
            if task is not None:
                return task

    def should_wait(self) -> bool:
        """Enough groups wait for the learner; with max_staleness 0 (synchronous RL) one step's worth per policy."""
        rl = self.recipe.rl
        if rl.max_staleness == 0 and self.made_with[self.version] >= rl.prompts_per_step:
            return True  # anything more made with this policy would be too stale to train on
        return len(self.store.ready_groups()) >= rl.prompts_per_step * (rl.max_staleness + 1)

    def run(self, should_stop: Callable[[], bool]) -> None:
        while not should_stop():
            self.follow_policy()
            if self.should_wait():
                time.sleep(0.2)
                continue
            self.run_one(self.next_index())

    def run_one(self, index: int) -> None:
        started = time.monotonic()
        gid = group_id(index)
        trajectories = self.runner.run_group(self.task_for(index), gid, self.recipe.rl.group_size, self.version,
                                             seed=self.recipe.train.seed * 1_000_003 + index)
        self.store.put(gid, trajectories)
        self.done.add(index)
        self.made_with[self.version] += 1
        seconds = time.monotonic() - started
        generated = sum(int(s.loss_mask.sum()) for t in trajectories for s in t.segments)
        stats = {
            "policy_version": self.version,
            "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
            "generated_tokens_per_s": generated / max(seconds, 1e-9),
            "group_seconds": seconds,
            **episode_stats(trajectories, self.recipe.rollout.max_context),
        }
        self.metrics.write(index, group=gid, **stats)
        self.on_group(gid, stats)

    def close(self) -> None:
        self.metrics.close()

