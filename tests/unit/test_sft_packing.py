"""SFT's packed conversations (`sft.pack`): first-fit bins of whole conversations, masks at the boundaries, the
sample order a pure function of the sample index, the placement per conversation, and the recipe's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from composer.recipes.loader import RecipeError, load_recipe
from composer.runtime.sft_examples import TokenizedConversations
from composer.trainer.midtrain import BatchPlacement
from composer.trainer.sft import ConversationSamples, first_fit, packing_summary
from tests.conftest import RECIPES

EOS = 2
"""The pad id here too, as in the tiny tokenizer: a conversation holds it at the end of each assistant turn."""


def conversations(count: int, seed: int = 0, longest: int = 60) -> TokenizedConversations:
    """Conversations of distinct tokens per conversation (so a token names its conversation), an EOS inside each."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = int(rng.integers(2, longest + 1))
        tokens = [1000 * (i + 1) + t for t in range(n)]
        tokens[n // 2] = EOS
        out.append((tokens, [bool(x) for x in rng.integers(0, 2, n)]))
    return TokenizedConversations.of(out)


def naive_first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for item, need in enumerate(sizes):
        b = next((b for b, r in enumerate(room) if r >= need), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(capacity)
        bins[b].append(item)
        room[b] -= need
    return bins


def test_first_fit_places_every_item_whole_in_the_first_bin_with_room():
    rng = np.random.default_rng(0)
    for capacity in (1, 7, 64, 1000):
        sizes = rng.integers(1, capacity + 1, 300).tolist()
        bins = first_fit(sizes, capacity)
        assert bins == naive_first_fit(sizes, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in b) <= capacity for b in bins)
    assert first_fit([5, 3, 4, 2, 6, 1], 8) == [[0, 1], [2, 3, 5], [4]]
    with pytest.raises(ValueError, match="exceeds"):
        first_fit([3, 9], 8)


def test_a_packed_sample_holds_whole_conversations_each_with_its_own_labels_masks_and_positions():
    data = conversations(40)
    samples = ConversationSamples(data, 128, EOS, seed=3, shuffle=True, pack=True)
    bins = samples.bins(0)
    assert sorted(c for b in bins for c in b) == list(range(40))  # every conversation once a pass, whole
    assert len(bins) < 40 / 2  # several to a sample (lengths 2..60 in 128 positions)
    for k, members in enumerate(bins):
        sample = samples[k]
        assert all(len(a) == 128 for a in sample.values())
        at = 0
        for j, c in enumerate(members):
            ids, mask = data[c]
            n = len(ids) - 1
            span = slice(at, at + n)
            assert sample["segments"][span].tolist() == [j] * n
            assert sample["tokens"][span].tolist() == ids[:-1].tolist() and sample["labels"][span].tolist() == ids[1:].tolist()
            assert sample["loss_mask"][span].tolist() == mask[1:].astype(float).tolist()
            assert sample["position_ids"][span].tolist() == list(range(n))
            # the last position's label is the conversation's own last token, never the next one's first
            assert sample["labels"][at + n - 1] // 1000 in (c + 1, 0) and sample["labels"][at + n - 1] == ids[-1]
            at += n
        assert (sample["segments"][at:] == -1).all() and not sample["loss_mask"][at:].any()
        # the EOS inside a conversation ends nothing: the segments say where each conversation is
        assert (sample["tokens"][:at] == EOS).sum() >= len(members) - 1


def test_sample_k_is_the_same_computed_fresh_and_every_pass_is_a_new_seeded_packing():
    data = conversations(50, seed=1)
    walked = ConversationSamples(data, 96, EOS, seed=7, shuffle=True, pack=True)
    total = sum(len(walked.bins(p)) for p in range(4))
    in_order = [walked.sample_conversations(k) for k in range(total)]
    assert walked.bins(0) != walked.bins(1)
    rng = np.random.default_rng(0)
    for k in rng.permutation(total)[:25].tolist():  # a resumed run starts at any k, with nothing cached
        fresh = ConversationSamples(data, 96, EOS, seed=7, shuffle=True, pack=True)
        assert fresh.sample_conversations(k) == in_order[k]
        assert all(np.array_equal(a, b) for a, b in zip(fresh[k].values(), walked[k].values()))
    other_seed = ConversationSamples(data, 96, EOS, seed=8, shuffle=True, pack=True)
    assert [other_seed.sample_conversations(k) for k in range(10)] != in_order[:10]


def test_held_out_samples_keep_the_stored_order_every_pass():
    data = conversations(12, seed=2)
    valid = ConversationSamples(data, 100, EOS, seed=7, shuffle=False, pack=True)
    bins = valid.bins(0)
    assert bins == first_fit([len(data[c][0]) - 1 for c in range(12)], 100)  # first-fit in stored order
    n = len(bins)
    assert [valid.sample_conversations(k) for k in range(3 * n)] == bins * 3


def test_unpacked_samples_are_one_conversation_each_in_a_seeded_order_per_pass():
    data = conversations(20, seed=3)
    samples = ConversationSamples(data, 64, EOS, seed=5, shuffle=True, pack=False)
    first = [samples.sample_conversations(k) for k in range(20)]
    assert all(len(b) == 1 for b in first) and sorted(b[0] for b in first) == list(range(20))
    assert first == [[int(c)] for c in np.random.default_rng([5, 0]).permutation(20)]
    assert "segments" not in samples[0] and samples[0]["position_ids"].tolist() == list(range(64))


def test_the_placement_packs_each_conversation_alone_and_leaves_padding_out():
    data = conversations(30, seed=4)
    samples = ConversationSamples(data, 80, EOS, seed=1, shuffle=True, pack=True)
    rows = [samples[k] for k in range(3)]
    batch = {key: torch.stack([torch.as_tensor(r[key]) for r in rows]) for key in rows[0]}
    lengths = [len(data[c][0]) - 1 for k in range(3) for c in samples.sample_conversations(k)]
    for cp_size, multiple in ((1, 1), (2, 1), (1, 2)):
        placed = [BatchPlacement("document", EOS, cp_size, rank, multiple)(batch) for rank in range(cp_size)]
        layout = placed[0]["layout"]
        assert list(layout.lengths) == lengths and layout.packed  # conversations, not EOS-split documents
        assert sum(float(p["loss_mask"].sum()) for p in placed) == float(batch["loss_mask"].sum())
        real = torch.cat([p["tokens"][p["layout"].indices()[0] >= 0] for p in placed])
        assert sorted(real.tolist()) == sorted(batch["tokens"][batch["segments"] >= 0].tolist())  # no padding computed
        positions = torch.cat([p["position_ids"][p["layout"].indices()[0] >= 0] for p in placed])
        assert sorted(positions.tolist()) == sorted(t for n in lengths for t in range(n))


def test_packing_summary_counts_conversations_per_sample_and_the_real_share():
    data = conversations(40)
    real = int(sum(len(data[i][0]) - 1 for i in range(40)))
    packed, unpacked = packing_summary(data, 128, 3, True), packing_summary(data, 128, 3, False)
    assert unpacked == {
        "samples": 40,
        "conversations_per_sample": 1.0,
        "real_share": round(real / (40 * 128), 4),
        "real_share_unpacked": round(real / (40 * 128), 4),
    }
    assert packed["samples"] == len(ConversationSamples(data, 128, EOS, 3, True, True).bins(0)) < 20
    assert packed["real_share"] == round(real / (packed["samples"] * 128), 4) > 2 * unpacked["real_share"]


def test_pack_with_pipeline_parallelism_or_local_attention_is_refused_by_name():
    base = ["parallelism.ep=1", "model.checkpoint=/nonexistent"]
    assert load_recipe(RECIPES / "smoke-sft.yaml", base).sft.pack is True  # packed by default
    with pytest.raises(RecipeError) as info:
        load_recipe(RECIPES / "smoke-sft.yaml", [*base, "parallelism.pp=2"])
    assert [str(p) for p in info.value.problems] == [
        "sft.pack: packed conversations with pipeline parallelism (pp=2) are not built; set sft.pack: false or pp=1"
    ]
    assert load_recipe(RECIPES / "smoke-sft.yaml", [*base, "parallelism.pp=2", "sft.pack=false"]).parallelism.pp == 2
    with pytest.raises(RecipeError, match="sft.pack need attention sdpa"):
        load_recipe(RECIPES / "smoke-sft.yaml", [*base, "model.kernels.attention=local"])


def test_a_run_started_before_packing_resumes_only_unpacked(tmp_path):
    """A run whose recipe.yaml has no `sft.pack` trained one conversation a sample: resuming it packed would change
    its data order, so it is refused with the setting that resumes it."""
    import yaml

    from composer.recipes.errors import UserError
    from composer.runtime.run_dir import RunDir
    from composer.trainer.sft import check_resume

    recipe = load_recipe(RECIPES / "smoke-sft.yaml")
    run = RunDir(tmp_path / "run")
    run.root.mkdir(parents=True)
    saved = recipe.model_dump(mode="json")
    del saved["sft"]["pack"]
    run.recipe_path.write_text(yaml.safe_dump(saved))
    with pytest.raises(UserError, match=r"pack=False.* -> .*pack=True"):
        check_resume(run, recipe)
    check_resume(run, load_recipe(RECIPES / "smoke-sft.yaml", ["sft.pack=false"]))
