"""The RL run protocol on synthetic trajectories (no engines): claims, takes, stage moves, staleness, resume
repair after a crash at each stage boundary, two producers, the driver heartbeat, replay."""

import json
import threading
import time

import numpy as np
import pytest

from composer.recipes.errors import UserError
from composer.rl.protocol import (
    Heartbeat,
    LearnerQueue,
    Policy,
    ReplayQueue,
    RLRunFiles,
    RolloutQueue,
    StalenessRule,
    StepGroups,
    driver_silent_for,
    group_id,
)
from composer.rl.trajectories import TrajectoryStore
from composer.rollout.agent.trajectory import Segment, Trajectory

PROMPTS = 2


def group(index: int, version: int, size: int = 2) -> list[Trajectory]:
    segment = Segment(np.arange(6), np.arange(6) >= 3, np.where(np.arange(6) >= 3, -0.5, 0.0))
    return [
        Trajectory(
            f"{group_id(index)}-{i}", group_id(index), "smoke/1", version, float(i), [segment], {"summaries": 0, "summary_tokens": []}
        )
        for i in range(size)
    ]


@pytest.fixture
def run(tmp_path):
    files = RLRunFiles(tmp_path)
    files.publish_policy(Policy(0, "v0"))
    return files


def queues(files: RLRunFiles, max_staleness: int, patience: float = 5.0) -> tuple[RolloutQueue, LearnerQueue]:
    rule = StalenessRule(max_staleness, PROMPTS)
    return RolloutQueue(files, rule), LearnerQueue(files, rule, patience_seconds=patience)


def make(producer: RolloutQueue, version: int) -> int | None:
    index = producer.claim(version)
    if index is not None:
        producer.put(index, group(index, version))
    return index


def step(files: RLRunFiles, learner: LearnerQueue, number: int) -> list[str]:
    """One learner step as rl.learner_main takes it: take, (train), publish, mark trained."""
    taken, _ = learner.take(number)
    files.publish_policy(Policy(number + 1, f"v{number + 1}"))
    learner.trained(taken)
    return taken


def stages(files: RLRunFiles) -> dict[str, list[str]]:
    store = TrajectoryStore(files.trajectories)
    return {stage: store.groups(stage) for stage in store.STAGES}


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_producers_make_only_what_can_still_be_trained(run, max_staleness):
    producer, learner = queues(run, max_staleness)
    made = [make(producer, 0) for _ in range(20)]
    assert made == [*range(PROMPTS * (max_staleness + 1)), *[None] * (20 - PROMPTS * (max_staleness + 1))]
    for number in range(max_staleness + 1):
        step(run, learner, number)  # each group made with policy 0 is trained within its window
    assert stages(run)["dropped"] == [] and stages(run)["ready"] == []
    assert make(producer, 0) is None  # policy 0 is too old for the next step: nothing made only to be dropped
    assert make(producer, max_staleness + 1) is not None


def test_synchronous_rl_trains_each_policy_on_its_own_groups(run):
    producer, learner = queues(run, 0)
    for version in range(3):
        assert [make(producer, version) for _ in range(PROMPTS + 1)] == [2 * version, 2 * version + 1, None]
        assert step(run, learner, version) == [group_id(2 * version), group_id(2 * version + 1)]
        # the engine still holds `version` until it follows the new policy: it may not start anything
        assert make(producer, version) is None


def test_the_learner_drops_groups_older_than_the_window(run):
    producer, learner = queues(run, 1)
    for index, version in enumerate([0, 0, 0, 2, 2]):
        producer.store.put(group_id(index), group(index, version))
    taken, dropped = learner.take(2)
    assert taken == [group_id(3), group_id(4)] and dropped == 3
    assert stages(run)["dropped"] == [group_id(i) for i in range(3)]


def test_claims_of_two_producers_are_unique_and_failed_claims_are_made_again(run):
    producer, _ = queues(run, 50)
    claimed, lock = [], threading.Lock()

    def produce():
        for _ in range(25):
            index = producer.claim(0)
            with lock:
                claimed.append(index)
            producer.put(index, group(index, 0))

    threads = [threading.Thread(target=produce) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(claimed) == list(range(50))
    failed = producer.claim(0)
    producer.release(failed)  # its engine died before writing it
    assert producer.claim(0) == failed


def test_a_restarted_producer_makes_the_groups_in_flight_at_the_crash_first(run):
    producer, _ = queues(run, 5)
    for _ in range(3):
        producer.claim(0)
    producer.put(1, group(1, 0))  # groups 0 and 2 were in flight when the driver died
    restarted, _ = queues(run, 5)
    assert [restarted.claim(0) for _ in range(3)] == [0, 2, 3]


@pytest.mark.parametrize("crash_after", ["take", "publish", "trained", "checkpoint", "consumed"])
def test_resume_repair_loses_and_duplicates_nothing(run, crash_after):
    """Learner steps 1-2 are checkpointed; step 3 crashes after `crash_after` (a checkpoint every 2 steps)."""
    producer, learner = queues(run, 3)
    for index in range(8):
        producer.store.put(group_id(index), group(index, 0))
    checkpointed = step(run, learner, 0) + step(run, learner, 1)
    learner.consumed(checkpointed)
    taken, _ = learner.take(2)
    if crash_after in ("publish", "trained", "checkpoint", "consumed"):
        run.publish_policy(Policy(3, "v3"))
    if crash_after in ("trained", "checkpoint", "consumed"):
        learner.trained(taken)
    if crash_after in ("checkpoint", "consumed"):
        checkpointed = taken  # the step-3 checkpoint covers the groups trained since the last one
    if crash_after == "consumed":
        learner.consumed(taken)
    _, resumed = queues(run, 3)
    resumed.repair(checkpointed)
    after = stages(run)
    every = [g for groups in after.values() for g in groups]
    assert sorted(every) == [group_id(i) for i in range(8)]  # nothing lost, nothing twice
    assert after["trained"] == []
    step3_trained_again = crash_after in ("take", "publish", "trained")
    assert set(taken) <= set(after["ready" if step3_trained_again else "consumed"])


def test_the_learner_waits_for_a_producer_slower_than_its_patience_while_the_driver_beats(run):
    producer, learner = queues(run, 1, patience=1.0)

    def slow_group():
        time.sleep(3.0)  # 3x the learner's patience for one group
        for _ in range(PROMPTS):
            make(producer, 0)

    with Heartbeat(run.heartbeat, interval=0.2):
        threading.Thread(target=slow_group).start()
        taken, _ = learner.take(0)
    assert taken == [group_id(0), group_id(1)]


def test_the_learner_gives_up_on_a_silent_driver(run):
    _, learner = queues(run, 1, patience=0.5)
    with Heartbeat(run.heartbeat, interval=0.1):
        pass  # the driver beat once, then died
    with pytest.raises(UserError, match="driver has been silent"):
        learner.take(0)
    assert driver_silent_for(run.heartbeat) > 0.5


def test_the_other_learner_ranks_train_the_groups_rank_0_took_for_their_step(run):
    producer, learner = queues(run, 1)
    for index in range(4):
        producer.store.put(group_id(index), group(index, 0))
    steps = StepGroups(run)
    first = learner.take(0)
    steps.record(0, *first)
    assert steps.wait(0) == first
    learner.trained(first[0])
    threading.Timer(1.0, lambda: steps.record(1, *learner.take(1))).start()  # rank 0 takes step 1 later
    assert steps.wait(1) == ([group_id(2), group_id(3)], 0)  # not step 0's record, still there meanwhile


def test_a_step_record_left_by_a_crash_is_cleared_and_the_ranks_give_up_on_a_silent_driver(run):
    steps = StepGroups(run, patience_seconds=0.5)
    steps.record(2, [group_id(4), group_id(5)], 0)  # the learner took step 2, then died
    steps.clear()  # its rank 0 on resume, before any rank waits: step 2 is taken again from the repaired queue
    with Heartbeat(run.heartbeat, interval=0.1):
        pass  # the driver beat once, then died
    with pytest.raises(UserError, match="driver has been silent"):
        steps.wait(2)


def test_replay_takes_each_recorded_step_and_writes_nothing(run, tmp_path_factory):
    producer, learner = queues(run, 1)
    for index in range(4):
        producer.store.put(group_id(index), group(index, 0))
    records = [{"step": n + 1, "groups": ",".join(step(run, learner, n))} for n in range(2)]
    learner.consumed(records[0]["groups"].split(","))
    (run.root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    before = sorted((p.relative_to(run.root), p.stat().st_mtime_ns) for p in run.root.rglob("*"))
    replay = ReplayQueue(run.root)
    for n, record in enumerate(records):
        groups, dropped = replay.take(n)
        assert ",".join(groups) == record["groups"] and dropped == 0
        assert [t.group_id for g in replay.load(groups) for t in g[:1]] == groups
        replay.trained(groups)
        replay.consumed(groups)
    with pytest.raises(UserError, match="no learner step 3"):
        replay.take(2)
    assert sorted((p.relative_to(run.root), p.stat().st_mtime_ns) for p in run.root.rglob("*")) == before
    with pytest.raises(UserError, match="not an RL run"):
        ReplayQueue(tmp_path_factory.mktemp("empty"))
