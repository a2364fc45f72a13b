"""Where a micro-batch's tokens sit on each rank (trainer.packing): the padding rules, the zigzag split, and the
round trip stream -> rank inputs -> stream."""

import numpy as np
import pytest
import torch

from composer.trainer.packing import (
    SequenceLayout,
    context_parallel_layout,
    document_lengths,
    next_token_labels,
    stream_of,
    zigzag_positions,
)


def test_padding_rules():
    lengths = [5, 3, 6]
    assert SequenceLayout.build(lengths, packed=True).spans == (5, 3, 6)  # no padding at all
    assert SequenceLayout.build(lengths, packed=True, multiple=4).spans == (5, 3, 8)  # the stream to a multiple of tp
    assert SequenceLayout.build(lengths, packed=True, cp_size=2).spans == (8, 4, 8)  # each sequence to 2*cp
    assert SequenceLayout.build(lengths, packed=True, cp_size=2, multiple=2).spans == (8, 4, 12)  # stream to 2*cp*tp
    assert SequenceLayout.build(lengths, packed=False).spans == (6, 6, 6)
    assert SequenceLayout.build(lengths, packed=False, cp_size=2, multiple=2).spans == (8, 8, 8)
    # the same answer on every rank, also where a rank's own share holds no padding
    assert not SequenceLayout.build([4, 8], packed=True, cp_size=2).has_padding
    assert all(SequenceLayout.build([5, 8], packed=True, cp_size=2, cp_rank=r).has_padding for r in (0, 1))
    with pytest.raises(ValueError, match="at least one token"):
        SequenceLayout.build([4, 0], packed=True)


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    covered = torch.cat([zigzag_positions(24, 3, r) for r in range(3)])
    assert sorted(covered.tolist()) == list(range(24))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_every_token_sits_on_exactly_one_rank_and_comes_back(packed, cp):
    lengths = [7, 1, 12, 4]
    stream = torch.arange(100, 100 + sum(lengths))
    layouts = [SequenceLayout.build(lengths, packed, cp_size=cp, cp_rank=r, multiple=2) for r in range(cp)]
    seen = []
    for layout in layouts:
        local = layout.local(stream, fill=-1)
        source, positions = layout.indices()
        assert local.shape == layout.shape == positions.shape
        assert torch.equal(local[source >= 0], stream[source[source >= 0]])
        assert bool((local[source < 0] == -1).all())
        for offset, n, _row in zip(layout.offsets, lengths, range(len(lengths))):
            mine = (source >= offset) & (source < offset + n)
            assert torch.equal(positions[mine], source[mine] - offset)  # positions restart per sequence
        seen += source[source >= 0].tolist()
    assert sorted(seen) == list(range(sum(lengths)))
    if cp == 1:
        assert torch.equal(layouts[0].stream(layouts[0].local(stream)), stream)
        rows = layouts[0].padded(stream)
        assert rows.shape == (4, 12) and rows[1].tolist() == [107] + [0] * 11


def test_ring_layout_names_each_token_by_position_and_sequence():
    layout = context_parallel_layout([4, 8], cp_size=2, packed=True)
    positions, ids = layout[1]
    assert positions.tolist() == [1, 2, 2, 3, 4, 5] and ids.tolist() == [0, 0, 1, 1, 1, 1]
    assert [p.tolist() for p, _ in context_parallel_layout([8, 8], 2, packed=False)] == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_documents_end_at_their_eod_token_and_labels_stay_inside_each_sequence():
    eod = 0
    samples = torch.tensor([[5, 6, 0, 7, 8, 9], [0, 4, 4, 0, 3, 2]])
    assert document_lengths(samples, eod) == [3, 3, 1, 3, 2]
    labels = next_token_labels([np.array([1, 2, 3]), np.array([4, 5])])
    assert labels.tolist() == [2, 3, 3, 5, 5]
    assert stream_of([np.array([1, 2]), np.array([3])]).tolist() == [1, 2, 3]


def test_packing_needs_the_sdpa_attention_and_no_pipeline():
    from composer.recipes.errors import UserError
    from composer.recipes.loader import load_recipe
    from tests.conftest import RECIPES

    with pytest.raises(UserError, match="model.kernels.attention: rl.pack_sequences need attention sdpa"):
        load_recipe(RECIPES / "smoke-rl.yaml", ["model.kernels.attention=local"])
    load_recipe(RECIPES / "smoke-rl.yaml", ["model.kernels.attention=local", "rl.pack_sequences=false"])
    with pytest.raises(UserError, match="data.attention: document attention with pipeline parallelism"):
        load_recipe(RECIPES / "smoke-midtrain.yaml", ["data.attention=document", "parallelism.pp=2"])
