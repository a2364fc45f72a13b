"""The RL run protocol: how the rollout role (the driver) and the learner role (torchrun ranks) of a run meet.

They share nothing but files of the run directory, each written atomically:

    trajectories/<stage>/gNNNNNNN.traj   groups of episodes (rl.trajectories); a group's stage is its directory
    policy.json                          the newest policy: learner steps done, and its id in the sync store
    driver.heartbeat                     touched every second by a thread of the driver while the driver lives
    learner_step.json                    the groups of the learner's current step, as its rank 0 took them
    replay.json                          present when the run replays another run's trajectories (no rollouts)
    receiver/  export/  checkpoints/  weights/ (the sync store when the recipe names none)

A group's life, and the one place each move happens:

    claimed (in memory) --RolloutQueue.put--> ready --LearnerQueue.take, step trained, policy published--> trained
    trained --LearnerQueue.consumed, once a checkpoint covers the step--> consumed
    ready --LearnerQueue.take, too stale--> dropped
    after a crash (LearnerQueue.repair): trained or ready groups the newest checkpoint covers -> consumed,
    other trained groups -> ready (trained again); claims in flight were never written and are made again.

The learner's other ranks wait for a step's groups in learner_step.json (`StepGroups`), never inside a collective:
a step may wait for rollouts longer than any collective's timeout. After a crash the step it names is taken again
from the repaired queue, so it is cleared before any rank reads it.

Staleness (`StalenessRule`): a group made with policy v may be trained at learner steps v .. v + max_staleness.
The learner drops what falls outside that window; a producer starts a group only while the groups ahead of it
leave room for it inside its window, so nothing is made only to be dropped.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from composer.recipes.errors import UserError
from composer.recipes.schema import Recipe, RLSection, SyncSection
from composer.rl.trajectories import TrajectoryStore
from composer.rollout.agent.trajectory import Trajectory
from composer.runtime.run_dir import atomic_write_text, read_metrics

DRIVER_PATIENCE_SECONDS = 120.0
"""How long the learner waits on a silent driver before it gives up (the driver beats every second)."""
POLL_SECONDS = 0.2


def group_id(index: int) -> str:
    return f"g{index:07d}"


def group_index(group: str) -> int:
    return int(group[1:])


@dataclass(frozen=True)
class Policy:
    version: int
    """Learner steps done when it was published (0: the starting checkpoint)."""
    store_version: str
    """Its version id in the sync store."""


class RLRunFiles:
    """Where the roles of one run find each other's hand-offs."""

    def __init__(self, root: Path):
        self.root = root
        self.trajectories = root / "trajectories"
        self.policy_file = root / "policy.json"
        self.receiver = root / "receiver"
        self.export = root / "export"
        self.checkpoints = root / "checkpoints"
        self.heartbeat = root / "driver.heartbeat"
        self.replay_file = root / "replay.json"
        self.step_groups = root / "learner_step.json"

    def policy(self) -> Policy | None:
        if not self.policy_file.is_file():
            return None
        data = json.loads(self.policy_file.read_text())
        return Policy(data["version"], data["store_version"])

    def publish_policy(self, policy: Policy) -> None:
        atomic_write_text(self.policy_file, json.dumps({"version": policy.version, "store_version": policy.store_version}))

    def replay_source(self) -> Path | None:
        """The run whose trajectories this run replays, if it is a replay."""
        return Path(json.loads(self.replay_file.read_text())["source"]) if self.replay_file.is_file() else None

    def record_replay_source(self, source: Path) -> None:
        atomic_write_text(self.replay_file, json.dumps({"source": str(source)}))


def sync_section(recipe: Recipe, files: RLRunFiles) -> SyncSection:
    """Where the run's policies go: the recipe's sync store, or one inside the run directory when the recipe names
    none or the run is a replay (its policies reach no engine, and must never enter the recorded run's store)."""
    local = str(files.root / "weights")
    if recipe.sync is None:
        return SyncSection(store=local)
    return recipe.sync.model_copy(update={"store": local}) if files.replay_source() else recipe.sync


@dataclass(frozen=True)
class StalenessRule:
    """The one staleness rule, applied by producers (what they may still start) and the learner (what it may take)."""

    max_staleness: int
    prompts_per_step: int

    @classmethod
    def of(cls, rl: RLSection) -> StalenessRule:
        return cls(rl.max_staleness, rl.prompts_per_step)

    def trainable(self, group_version: int, step: int) -> bool:
        """May a group made with policy `group_version` be trained at learner step `step` (0-based)?"""
        return step - self.max_staleness <= group_version <= step

    def room_for(self, engine_version: int, learner_step: int, pending_versions: list[int]) -> bool:
        """May an engine holding policy `engine_version` start a group while the learner is at `learner_step` and
        groups made with `pending_versions` (ready or in flight) wait? The learner takes `prompts_per_step` groups a
        step, so the group is trained only if the trainable groups ahead of it fit into the steps its window has left."""
        ahead = sum(1 for version in pending_versions if self.trainable(version, learner_step))
        steps_left = engine_version + self.max_staleness - learner_step + 1
        return ahead < steps_left * self.prompts_per_step


class RolloutQueue:
    """The producer side, shared by the driver's engines (one thread each): claim the next group, hand it off.

    Group n is always made once, whole: a claim takes the smallest index nobody wrote or is making, so after a
    crash the groups that were in flight are made first.
    """

    def __init__(self, files: RLRunFiles, rule: StalenessRule):
        self.files, self.rule = files, rule
        self.store = TrajectoryStore(files.trajectories)
        self._lock = threading.Lock()
        self._written = {group_index(g) for g in self.store.known_groups()}
        self._in_flight: dict[int, int] = {}
        """Group index -> the policy version making it."""
        self._ready_versions: dict[str, int] = {}
        """Policy version of each ready group, read once from its header."""

    def claim(self, engine_version: int) -> int | None:
        """A group index to make with `engine_version`, or None while the staleness rule leaves no room."""
        learner_step = self.files.policy().version
        with self._lock:
            pending = [*self._waiting_versions(), *self._in_flight.values()]
            if not self.rule.room_for(engine_version, learner_step, pending):
                return None
            index = next(i for i in itertools.count() if i not in self._written and i not in self._in_flight)
            self._in_flight[index] = engine_version
            return index

    def put(self, index: int, trajectories: list[Trajectory]) -> None:
        """Hand a claimed group to the learner (atomically: the learner sees all of it or nothing)."""
        self.store.put(group_id(index), trajectories)
        with self._lock:
            self._written.add(index)
            del self._in_flight[index]

    def release(self, index: int) -> None:
        """Give up a claim whose group was not written (its engine failed); the index is made again."""
        with self._lock:
            self._in_flight.pop(index, None)

    def _waiting_versions(self) -> list[int]:
        ready = self.store.ready_groups()
        for gone in set(self._ready_versions) - set(ready):
            del self._ready_versions[gone]
        for group in ready:
            if group not in self._ready_versions:
                try:
                    self._ready_versions[group] = self.store.policy_version(group)
                except FileNotFoundError:
                    continue  # the learner took it meanwhile
        return list(self._ready_versions.values())


class LearnerQueue:
    """The consumer side (the learner's rank 0 takes and moves; every rank loads what rank 0 took)."""

    def __init__(self, files: RLRunFiles, rule: StalenessRule, patience_seconds: float = DRIVER_PATIENCE_SECONDS):
        self.files, self.rule, self.patience_seconds = files, rule, patience_seconds
        self.store = TrajectoryStore(files.trajectories)

    def repair(self, checkpointed: list[str]) -> None:
        """After a crash: the groups the newest checkpoint covers are consumed; groups trained by steps after it
        go back to ready, to be trained again."""
        covered = set(checkpointed)
        trained = self.store.groups("trained")
        self.store.move([g for g in trained if g in covered], "trained", "consumed")
        self.store.move([g for g in self.store.ready_groups() if g in covered], "ready", "consumed")
        self.store.move([g for g in trained if g not in covered], "trained", "ready")

    def take(self, step: int) -> tuple[list[str], int]:
        """Wait for `prompts_per_step` ready groups trainable at `step`; the stale ones are dropped on the way.
        Returns (group ids, groups dropped)."""
        need, dropped = self.rule.prompts_per_step, 0
        versions: dict[str, int] = {}  # each header is read once, not on every poll
        while True:
            fresh = []
            for group in self.store.ready_groups():
                if group not in versions:
                    versions[group] = self.store.policy_version(group)
                if self.rule.trainable(versions[group], step):
                    fresh.append(group)
                    if len(fresh) == need:
                        return fresh, dropped
                else:
                    self.store.move([group], "ready", "dropped")
                    dropped += 1
            refuse_silent_driver(self.files.heartbeat, self.patience_seconds)
            time.sleep(POLL_SECONDS)

    def load(self, groups: list[str]) -> list[list[Trajectory]]:
        return [self.store.load(g) for g in groups]

    def trained(self, groups: list[str]) -> None:
        """The step that used `groups` is trained and its policy published."""
        self.store.move(groups, "ready", "trained")

    def consumed(self, groups: list[str]) -> None:
        """A checkpoint covers the steps that used `groups`."""
        self.store.move(groups, "trained", "consumed")


class ReplayQueue:
    """Another run's stored groups, step by step as that run trained them (its metrics.jsonl), for a learner
    without engines. It reads the recorded run and never moves or writes anything there."""

    def __init__(self, source: Path):
        metrics = source / "metrics.jsonl"
        if not metrics.is_file() or not (source / "trajectories").is_dir():
            raise UserError(f"--replay {source}: not an RL run directory (no metrics.jsonl and trajectories/)")
        self.source = source
        self.steps = {record["step"]: record["groups"].split(",") for record in read_metrics(metrics) if "groups" in record}
        self.store = TrajectoryStore(source / "trajectories")

    def repair(self, checkpointed: list[str]) -> None:
        pass  # nothing moves in a recorded run

    def take(self, step: int) -> tuple[list[str], int]:
        if step + 1 not in self.steps:
            raise UserError(f"--replay {self.source}: the recorded run has no learner step {step + 1}")
        return self.steps[step + 1], 0

    def load(self, groups: list[str]) -> list[list[Trajectory]]:
        return [self.store.load(g, self.store.stage_of(g)) for g in groups]

    def trained(self, groups: list[str]) -> None:
        pass

    def consumed(self, groups: list[str]) -> None:
        pass


class StepGroups:
    """The groups of the learner's current step, from its rank 0 (which takes them from the queue) to the other
    ranks, through the run directory that every learner host shares."""

    def __init__(self, files: RLRunFiles, patience_seconds: float = DRIVER_PATIENCE_SECONDS):
        self.files, self.patience_seconds = files, patience_seconds

    def record(self, step: int, groups: list[str], dropped: int) -> None:
        atomic_write_text(self.files.step_groups, json.dumps({"step": step, "groups": groups, "dropped": dropped}))

    def wait(self, step: int) -> tuple[list[str], int]:
        """The groups rank 0 took for `step` (and how many stale ones it dropped), once it has recorded them."""
        while True:
            if self.files.step_groups.is_file():
                record = json.loads(self.files.step_groups.read_text())
                if record["step"] == step:
                    return record["groups"], record["dropped"]
            refuse_silent_driver(self.files.heartbeat, self.patience_seconds)
            time.sleep(POLL_SECONDS)

    def clear(self) -> None:
        """Before the ranks start: a record left by a crash names a step that is taken again."""
        self.files.step_groups.unlink(missing_ok=True)


def learner_queue(files: RLRunFiles, rl: RLSection) -> LearnerQueue | ReplayQueue:
    source = files.replay_source()
    return ReplayQueue(source) if source else LearnerQueue(files, StalenessRule.of(rl))


class Heartbeat:
    """The driver's sign of life for the learner: a file touched every `interval` seconds by a thread of its own,
    so slow rollouts (a long group, engines starting on --resume) never look like a dead driver."""

    def __init__(self, path: Path, interval: float = 1.0):
        self.path, self.interval = path, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="driver-heartbeat", daemon=True)

    def _beat(self) -> None:
        while True:
            self.path.touch()
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Heartbeat:
        self.path.touch()  # before the learner starts: a heartbeat left by a killed run must not count as silence
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def driver_silent_for(heartbeat: Path) -> float:
    return time.time() - heartbeat.stat().st_mtime if heartbeat.exists() else 0.0


def refuse_silent_driver(heartbeat: Path, patience_seconds: float) -> None:
    silent = driver_silent_for(heartbeat)
    if silent > patience_seconds:
        raise UserError(f"no rollouts: the driver has been silent for {silent:.0f} s (over {patience_seconds:.0f} s)")
