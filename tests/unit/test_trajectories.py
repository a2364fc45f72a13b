"""Trajectory files: exact round trip, compact routed experts, corruption refused, durable hand-off."""

import numpy as np
import pytest

from composer.recipes.errors import UserError
from composer.rl.trajectories import TrajectoryStore, decode_group, encode_group
from composer.rollout.agent.trajectory import Segment, Trajectory


def make_trajectory(i: int, tokens: int = 50, layers: int = 3, top_k: int = 8, experts: int = 384, seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed + i)
    ids = rng.integers(0, 1000, tokens)
    mask = np.arange(tokens) >= 20
    logprobs = np.where(mask, -rng.random(tokens), 0.0)
    routes = rng.integers(0, experts, (tokens - 1, layers, top_k))
    seg = Segment(ids, mask, logprobs, routes)
    return Trajectory(
        id=f"g0-{i}", group_id="g0", task_id="smoke/3", policy_version=7, reward=0.5 * i, segments=[seg, seg], info={"finish": "stop"}
    )


def test_round_trip_is_exact_and_routes_are_narrow():
    group = [make_trajectory(i) for i in range(3)]
    back = decode_group(encode_group(group))
    assert [t.id for t in back] == ["g0-0", "g0-1", "g0-2"]
    for a, b in zip(group, back):
        assert (a.reward, a.policy_version, a.info, a.task_id) == (b.reward, b.policy_version, b.info, b.task_id)
        for sa, sb in zip(a.segments, b.segments):
            assert np.array_equal(sa.token_ids, sb.token_ids) and np.array_equal(sa.loss_mask, sb.loss_mask)
            assert np.array_equal(sa.logprobs, sb.logprobs) and np.array_equal(sa.routed_experts, sb.routed_experts)
            assert sb.routed_experts.dtype == np.uint16  # 384 experts do not fit uint8
    small = Segment([1, 2, 3], [0, 1, 1], [0, -1, -2], np.zeros((2, 2, 2), dtype=np.int64))
    assert small.routed_experts.dtype == np.uint8


def test_segment_shapes_are_checked():
    with pytest.raises(ValueError, match="do not cover 3 tokens"):
        Segment([1, 2, 3], [0, 1, 1], [0, -1, -2], np.zeros((3, 2, 2)))
    with pytest.raises(ValueError, match="disagree"):
        Segment([1, 2, 3], [0, 1], [0, -1, -2])


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_files_are_refused(damage):
    data = bytearray(encode_group([make_trajectory(0)]))
    if damage == "flip":
        data[-10] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"hello")
    with pytest.raises(UserError, match="checksum mismatch|not a composer trajectory"):
        decode_group(bytes(data))


def test_store_hands_off_without_loss_or_duplicates(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.put("g0", [make_trajectory(0)])
    store.put("g1", [make_trajectory(1)])
    assert store.ready_groups() == ["g0", "g1"]
    assert store.load("g1")[0].id == "g0-1"
    store.move(["g0", "g1"], "ready", "trained")
    store.move(["g0"], "trained", "consumed")
    reopened = TrajectoryStore(tmp_path)  # as after a restart
    assert reopened.ready_groups() == [] and reopened.groups("trained") == ["g1"]
    assert reopened.known_groups() == {"g0", "g1"}
    assert reopened.load("g0", "consumed")[0].id == "g0-0"
    assert not list(tmp_path.rglob("*.tmp"))
