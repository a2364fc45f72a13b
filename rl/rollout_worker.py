"""The rollout role of an RL run: engines follow the newest policy and make groups of episodes for the learner.

Each engine loops: follow the policy -> evaluate it on held-out tasks when due (rl.evaluation) -> claim a group
(rl.protocol: what the staleness rule still allows) -> generate it -> hand it off -> log. Group n always plays the
same task (drawn from a generator seeded by n). With a server fleet each engine runs its own groups on its own
thread and takes a new policy only between groups, so every trajectory is made by one policy version.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from composer.recipes.env_schema import EnvSection
from composer.recipes.schema import RLEvalSection, RolloutSection, SSHSection
from composer.rl.evaluation import Evaluator
from composer.rl.protocol import POLL_SECONDS, RLRunFiles, RolloutQueue, group_id
from composer.rl.rollout_hosts import EngineHosts, LocalHost, RemoteHost
from composer.rl.trajectories import episode_stats
from composer.rollout.agent.environment import CodingEnvironment
from composer.rollout.agent.harness import Tokenizer
from composer.rollout.agent.loop import EpisodeRunner
from composer.rollout.agent.trajectory import Trajectory
from composer.rollout.engines.vllm_engine import Engine
from composer.runtime.run_dir import MetricsWriter


@dataclass
class EngineSlot:
    """One inference engine, the host it runs on, its agent loop, and the policy version its weights hold."""

    number: int
    host: LocalHost | RemoteHost | EngineHosts
    engine: Engine
    runner: EpisodeRunner
    version: int
    update_seconds: float | None = None
    """How long its last move to a new policy took (its hosts' pulls and the reload), until its next group logs it."""


class RolloutWorker:
    """The driver's engines on every rollout host, making groups of `group_size` episodes into `queue`."""

    def __init__(
        self,
        rollout: RolloutSection,
        env: EnvSection,
        group_size: int,
        seed: int,
        routed_experts: bool,
        hosts: list[LocalHost | RemoteHost | EngineHosts],
        tokenizer_dir: str,
        queue: RolloutQueue,
        files: RLRunFiles,
        on_group: Callable[[str, dict], None] = lambda gid, stats: None,
        evaluation: RLEvalSection | None = None,
        steps: int = 0,
        on_eval: Callable[[int, dict], None] = lambda version, record: None,
        ssh: SSHSection | None = None,
        trust_remote_code: bool = False,
    ):
        self.rollout, self.group_size, self.seed = rollout, group_size, seed
        self.trust_remote_code = trust_remote_code
        self.queue, self.files, self.on_group, self.on_eval = queue, files, on_group, on_eval
        self.env = CodingEnvironment(env, seed=seed, sandbox_root=files.root / "sandbox", ssh=ssh)
        try:
            self.evaluator = Evaluator(evaluation, env.tasks, self.env, steps, seed, files.root) if evaluation else None
            self.slots = self._start_engines(hosts, tokenizer_dir, routed_experts)
        except BaseException:
            self.env.close()  # its sandbox hosts' connections
            raise
        self.metrics = MetricsWriter(files.root / "rollout_metrics.jsonl")
        self._metrics_lock = threading.Lock()

    def _start_engines(
        self, hosts: list[LocalHost | RemoteHost | EngineHosts], tokenizer_dir: str, routed_experts: bool
    ) -> list[EngineSlot]:
        policy = self.files.policy()
        slots = []
        for host in hosts:
            weights = host.pull(policy.store_version)
            for engine in host.start_engines(weights, seed=self.seed + len(slots), routed_experts=routed_experts):
                # A tokenizer each: HF fast tokenizers are not safe to share between threads.
                runner = EpisodeRunner(engine, Tokenizer(tokenizer_dir, self.trust_remote_code), self.env, self.rollout)
                slots.append(EngineSlot(len(slots), host, engine, runner, policy.version))
        return slots

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
                stop.wait(POLL_SECONDS)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        if errors:
            raise errors[0]

    def _engine_loop(self, slot: EngineSlot, should_stop: Callable[[], bool]) -> None:
        while not should_stop():
            self.follow_policy(slot)
            self.evaluate_if_due(slot)
            index = self.queue.claim(slot.version)
            if index is None:
                time.sleep(POLL_SECONDS)
                continue
            started = time.monotonic()
            try:
                trajectories = self.generate(slot, index)
                self.queue.put(index, trajectories)
            finally:
                self.queue.release(index)
            self.log(slot, index, trajectories, time.monotonic() - started)

    def follow_policy(self, slot: EngineSlot) -> None:
        """Bring this engine to the newest policy, between its groups. Pulls and loads on one host share its lock,
        so its receiver never drops a version while an engine there reads it; hosts update in parallel."""
        if self.files.policy().version <= slot.version:
            return
        started = time.monotonic()
        with slot.host.lock:
            policy = self.files.policy()  # read again: another engine may have brought its host further meanwhile
            slot.host.update(slot.engine, policy.store_version)
            slot.version = policy.version
        slot.update_seconds = time.monotonic() - started

    def evaluate_if_due(self, slot: EngineSlot) -> None:
        """Held-out evaluation of the policy this engine holds, when one is due (between groups)."""
        if self.evaluator and self.evaluator.claim(slot.version):
            self.on_eval(slot.version, self.evaluator.evaluate(slot.runner, slot.version))

    def final_evaluation(self) -> None:
        """After the learner's last step: the first engine takes the final policy and evaluates it."""
        if self.evaluator:
            self.follow_policy(self.slots[0])
            self.evaluate_if_due(self.slots[0])

    def generate(self, slot: EngineSlot, index: int) -> list[Trajectory]:
        task = self.env.pool.draw(random.Random(f"{self.seed}/{index}"))
        return slot.runner.run_group(task, group_id(index), self.group_size, slot.version, seed=self.seed * 1_000_003 + index)

    def log(self, slot: EngineSlot, index: int, trajectories: list[Trajectory], seconds: float) -> None:
        generated = sum(int(s.loss_mask.sum()) for t in trajectories for s in t.segments)
        stats = {
            "policy_version": slot.version,
            "engine": slot.number,
            "host": slot.host.name,
            "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
            "generated_tokens_per_s": generated / max(seconds, 1e-9),
            "group_seconds": seconds,
            **({"policy_update_seconds": slot.update_seconds} if slot.update_seconds is not None else {}),
            **episode_stats(trajectories, self.rollout.max_context),
            **self.env.sandbox.metrics(),
        }
        slot.update_seconds = None
        with self._metrics_lock:
            self.metrics.write(index, group=group_id(index), **stats)
        self.on_group(group_id(index), stats)

    def close(self) -> None:
        self.metrics.close()
        if self.evaluator:
            self.evaluator.close()
        self.env.close()
