"""The rollout role of an RL run: follow the newest policy, run groups of episodes, hand them to the learner.

Group n always plays the same task (drawn from a generator seeded by n) and is written once, whole; after a
crash the smallest indices never written are generated first, so no group is lost or made twice. With a
server fleet each engine runs its own groups on its own thread and takes a new policy only between groups,
so every trajectory is made by one policy version.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from recipes.runs import MetricsWriter
from recipes.schema import Recipe
from rl.layout import RLRunFiles
from rl.rollout_hosts import LocalHost, RemoteHost, open_hosts
from rollout.agent import EpisodeRunner, Tokenizer
from rollout.engine import Engine
from rollout.environment import CodingEnvironment
from rollout.tasks import Task
from rollout.trajectories import TrajectoryStore, episode_stats


def group_id(index: int) -> str:
    return f"g{index:07d}"


@dataclass
class EngineSlot:
    """One inference engine, the host it runs on, its agent loop, and the policy version its weights hold."""

    number: int
    host: LocalHost | RemoteHost
    engine: Engine
    runner: EpisodeRunner
    version: int


class RolloutWorker:
    def __init__(self, recipe: Recipe, files: RLRunFiles, on_group: Callable[[str, dict], None] = lambda gid, stats: None):
        self.recipe = recipe
        self.files = files
        self.on_group = on_group
        self.store = TrajectoryStore(files.trajectories)
        self.env = CodingEnvironment(recipe.env, seed=recipe.train.seed, sandbox_root=files.root / "sandbox")
        self.done = {int(g[1:]) for g in self.store.known_groups()}
        self.in_flight: dict[int, int] = {}
        """Group index -> the policy version making it."""
        self.made_with = Counter(self.store.load(g)[0].policy_version for g in self.store.ready_groups())
        self.metrics = MetricsWriter(files.root / "rollout_metrics.jsonl")
        self._groups_lock = threading.Lock()
        self.hosts: list[LocalHost | RemoteHost] = []
        try:
            self.slots = self._start_engines()
        except BaseException:
            self.close()
            raise

    def _start_engines(self) -> list[EngineSlot]:
        policy = self.files.policy()
        # The policy's tokenizer, here, for the agent loop (engines on other hosts read their own copy).
        tokenizer_dir = LocalHost(self.recipe, self.files).pull(policy.store_version)
        routed = self.recipe.model.is_moe and self.recipe.rl.router_replay == "r3"
        self.hosts = open_hosts(self.recipe, self.files)
        slots = []
        for host in self.hosts:
            weights = host.pull(policy.store_version)
            for engine in host.start_engines(weights, seed=self.recipe.train.seed + len(slots), routed_experts=routed):
                # A tokenizer each: HF fast tokenizers are not safe to share between threads.
                runner = EpisodeRunner(engine, Tokenizer(tokenizer_dir), self.env, self.recipe.rollout)
                slots.append(EngineSlot(len(slots), host, engine, runner, policy.version))
        return slots

    def follow_policy(self, slot: EngineSlot) -> None:
        """Bring this engine to the newest policy, between its groups. Pulls and loads on one host share its lock,
        so its receiver never drops a version while an engine there reads it; hosts update in parallel."""
        if self.files.policy().version <= slot.version:
            return
        with slot.host.lock:
            policy = self.files.policy()  # read again: another engine may have brought its host further meanwhile
            slot.host.update(slot.engine, policy.store_version)
            slot.version = policy.version

    def claim(self, version: int) -> int | None:
        """The smallest group index nobody made or is making, or None while enough groups wait for the learner
        (with max_staleness 0, synchronous RL, one step's worth per policy)."""
        rl = self.recipe.rl
        with self._groups_lock:
            if rl.max_staleness == 0:
                if self.made_with[version] + Counter(self.in_flight.values())[version] >= rl.prompts_per_step:
                    return None  # anything more made with this policy would be too stale to train on
            elif len(self.store.ready_groups()) + len(self.in_flight) >= rl.prompts_per_step * (rl.max_staleness + 1):
                return None
            index = 0
            while index in self.done or index in self.in_flight:
                index += 1
            self.in_flight[index] = version
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

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Run groups on every engine until `should_stop` (polled on this thread); the first error of any
        engine stops them all and is raised here."""
        if len(self.slots) == 1:
            return self._engine_loop(self.slots[0], should_stop)
        stop = threading.Event()
        errors: list[BaseException] = []

        def loop(slot: EngineSlot) -> None:
            try:
                self._engine_loop(slot, stop.is_set)
            except BaseException as e:
                errors.append(e)
                stop.set()

        threads = [threading.Thread(target=loop, args=(slot,), name=f"engine-{slot.number}") for slot in self.slots]
        for thread in threads:
            thread.start()
        try:
            while not stop.is_set():
                if should_stop():
                    stop.set()
                stop.wait(0.2)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        if errors:
            raise errors[0]

    def _engine_loop(self, slot: EngineSlot, should_stop: Callable[[], bool]) -> None:
        while not should_stop():
            self.follow_policy(slot)
            index = self.claim(slot.version)
            if index is None:
                time.sleep(0.2)
                continue
            try:
                self.run_one(slot, index)
            finally:
                with self._groups_lock:
                    del self.in_flight[index]

    def run_one(self, slot: EngineSlot, index: int) -> None:
        started = time.monotonic()
        gid = group_id(index)
        trajectories = slot.runner.run_group(self.task_for(index), gid, self.recipe.rl.group_size, slot.version,
                                             seed=self.recipe.train.seed * 1_000_003 + index)
        self.store.put(gid, trajectories)
        with self._groups_lock:
            self.done.add(index)
            self.made_with[slot.version] += 1
        seconds = time.monotonic() - started
        generated = sum(int(s.loss_mask.sum()) for t in trajectories for s in t.segments)
        stats = {
            "policy_version": slot.version,
            "engine": slot.number,
            "host": slot.host.name,
            "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
            "generated_tokens_per_s": generated / max(seconds, 1e-9),
            "group_seconds": seconds,
            **episode_stats(trajectories, self.recipe.rollout.max_context),
        }
        with self._groups_lock:
            self.metrics.write(index, group=gid, **stats)
        self.on_group(gid, stats)

    def close(self) -> None:
        self.metrics.close()
        for host in self.hosts:
            host.close()
