"""Engine routes -> Megatron RouterReplay layout: order, sharding and validation."""

import numpy as np
import pytest

from composer.trainer.packing import SequenceLayout
from composer.trainer.replay_layout import ReplayLayoutError, replay_tensors


def padded(lengths, width=None):
    return SequenceLayout.build(lengths, packed=False, multiple=width or 1)


def routes_for(lengths, layers=3, top_k=2, experts=8, seed=0):
    rng = np.random.default_rng(seed)
    return [np.stack([np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)]) for _ in range(n - 1)]) for n in lengths]


def test_sequence_major_order_and_layers():
    lengths = [5, 3]
    routes = routes_for(lengths)
    out = replay_tensors(routes, lengths, padded(lengths, 6), num_experts=8, layers=range(1, 3))
    assert len(out) == 2 and out[0].shape == (12, 2) and str(out[0].dtype) == "torch.int64"
    for i, layer in enumerate((1, 2)):
        for b, n in enumerate(lengths):
            for s in range(n - 1):
                assert out[i][s * 2 + b].tolist() == routes[b][s, layer].tolist()
            assert out[i][(n - 1) * 2 + b].tolist() == routes[b][n - 2, layer].tolist()  # last token repeats
            assert out[i][5 * 2 + b].tolist() == [0, 1]  # padding: a fixed valid choice


def test_sequence_parallel_shards():
    lengths = [8, 8]
    routes = routes_for(lengths)
    full = replay_tensors(routes, lengths, padded(lengths), 8, range(3))
    parts = [replay_tensors(routes, lengths, padded(lengths), 8, range(3), tp_rank=r, tp_size=2, sequence_parallel=True) for r in (0, 1)]
    for layer in range(3):
        assert np.array_equal(np.concatenate([parts[0][layer], parts[1][layer]]), full[layer].numpy())


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r, n: ([r[0][:-1], r[1]], n), "routed positions for 5 tokens"),
        (lambda r, n: ([r[0] + 8, r[1]], n), "out of range for 8 experts"),
        (lambda r, n: ([r[0].astype(np.int64) - 8, r[1]], n), "expert id -8 out of range"),
        (lambda r, n: ([r[0], r[1][:, :2]], n), "expected"),
        (lambda r, n: (r, [5]), "route arrays for 1 sequences"),
        (lambda r, n: (r, [5, 4]), r"routes for sequences of \[5, 4\] tokens, the micro-batch holds \[5, 3\]"),
    ],
)
def test_mismatches_are_errors(mutate, match):
    lengths = [5, 3]
    routes, lens = mutate(routes_for(lengths), lengths)
    with pytest.raises(ReplayLayoutError, match=match):
        replay_tensors(routes, lens, padded(lengths), 8, range(3))


def test_a_subset_of_layers():
    """A rank holding only some MoE layers (pipeline stages) gets exactly those, in its order."""
    lengths = [4, 4]
    routes = routes_for(lengths)
    full = replay_tensors(routes, lengths, padded(lengths), 8, range(3))
    subset = replay_tensors(routes, lengths, padded(lengths), 8, [0, 2])
    assert [t.tolist() for t in subset] == [full[0].tolist(), full[2].tolist()]
    with pytest.raises(ReplayLayoutError, match="routes cover 3 layers, the model needs layers up to 3"):
        replay_tensors(routes, lengths, padded(lengths), 8, [1, 3])


def test_packed_and_context_parallel_rows_follow_the_stream():
    """A packed micro-batch gets one row per stream token (each sequence's last token repeating its last route);
    under cp=2 each rank's rows are its zigzag chunks of every sequence, padded to a multiple of 4."""
    lengths = [5, 3, 6]
    routes = routes_for(lengths)
    stream = np.concatenate([np.concatenate([r, r[-1:]]) for r in routes])  # [14, layers, top_k]
    packed = replay_tensors(routes, lengths, SequenceLayout.build(lengths, packed=True), 8, range(3))
    assert [t.tolist() for t in packed] == [stream[:, layer].tolist() for layer in range(3)]
    for rank in (0, 1):
        layout = SequenceLayout.build(lengths, packed=True, cp_size=2, cp_rank=rank)
        assert layout.spans == (8, 4, 8)
        source = layout.indices()[0][0]
        local = replay_tensors(routes, lengths, layout, 8, range(3))
        for layer in range(3):
            for row, index in enumerate(source.tolist()):
                expected = stream[index, layer] if index >= 0 else [0, 1]  # padding: the fixed filler
                assert local[layer][row].tolist() == list(expected)
