"""Packed sequences compute what padded ones compute (fp32, both families, real Megatron-Core at world size 1).

- The RL learner (`rl.pack_sequences`): one step on a batch of unequal sequences with prompt, generated and
  tool-output spans, router replay and a KL term gives the same per-token logprobs, loss, statistics and
  gradients packed as padded, the load-balancing loss included (routers leave padding out of it). DeepSeek-V3's
  sequence-level balancing loss (and its expert-bias update) is off for that family: it balances each row, and a
  packed row holds several sequences.
- Mid-training's document attention (`data.attention: document`): every document of a packed sample gets the
  logprobs it gets on its own.
- SFT's packed conversations (`sft.pack`): every conversation of a packed sample gets the losses it gets as a sample
  of its own, the EOS tokens inside it notwithstanding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from composer.recipes.loader import load_recipe
from composer.recipes.schema import OptimSection, ParallelismSection, RLSection, TrainSection
from composer.trainer.checkpoint_init import init_hf_checkpoint
from composer.trainer.hf_config import model_section_from_hf

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parents[2]
LENGTHS = [41, 7, 23, 2, 16, 30]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packing")
    recipes = {"qwen3_moe": "recipes/smoke-midtrain.yaml", "deepseek_v3": "recipes/smoke-deepseek-v3-midtrain.yaml"}
    return {
        family: init_hf_checkpoint(load_recipe(REPO / recipe, ["model.vocab_size=512"]).model, root / family, tokenizer_bytes=2**18)
        for family, recipe in recipes.items()
    }


def learner_sequences(m, seed: int = 0):
    from composer.trainer.rl_learner import LearnerSequence

    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        mask = np.zeros(n, dtype=bool)
        mask[n // 3 :] = True  # a prompt, then generated tokens ...
        mask[n // 2 : n // 2 + 2] = False  # ... with a tool output between them
        routes = (
            np.stack([np.stack([rng.choice(m.num_experts, m.moe_top_k, replace=False) for _ in range(m.num_layers)]) for _ in range(n - 1)])
            if n > 1
            else np.zeros((0, m.num_layers, m.moe_top_k), dtype=np.int64)
        )
        out.append(
            LearnerSequence(
                rng.integers(1, m.vocab_size, n),
                mask,
                rng.uniform(-9, -5, n).astype(np.float32),
                float(rng.normal()),
                routes,
                episode=f"e{i // 2}",
            )
        )
    return out


def learner_step(m, sequences, packed: bool, checkpoints: Path) -> dict:
    from composer.trainer.distributed import shutdown_distributed
    from composer.trainer.logprobs import layout_for, sequence_logprobs
    from composer.trainer.rl_learner import RLLearner
    from composer.trainer.router_replay import replay_for_micro_batch, routing

    rl = RLSection(pack_sequences=packed, kl_coeff=0.05, group_size=2)
    train = TrainSection(steps=2, micro_batch_size=3, global_batch_size=6)
    learner = RLLearner(m, ParallelismSection(), OptimSection(lr=1e-3), train, rl, checkpoints, temperature=0.7)
    try:
        model = learner.core.model
        tokens = [s.tokens for s in sequences]
        layout = layout_for(model, LENGTHS, packed)
        with routing(model, replay_for_micro_batch(model, "r3", [s.routes for s in sequences], layout)):
            logprobs = sequence_logprobs(model, layout, tokens, with_grad=False, temperature=0.7)
        record = learner.train_step(sequences)
        grads = {name: param.main_grad.clone() for name, param in model.named_parameters()}
        return {"logprobs": logprobs, "record": record, "grads": grads, "rows": layout.shape}
    finally:
        shutdown_distributed()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_learner_step_is_the_same_packed_and_padded(checkpoints, tmp_path, family):
    torch.set_num_threads(1)
    m = model_section_from_hf(checkpoints[family])
    if family == "deepseek_v3":
        m = m.model_copy(update={"moe_aux_loss_coeff": 0.0, "moe_router_bias_update_rate": 0.0})
    sequences = learner_sequences(m)
    padded = learner_step(m, sequences, False, tmp_path / "padded")
    packed = learner_step(m, sequences, True, tmp_path / "packed")
    assert padded["rows"] == (len(LENGTHS), max(LENGTHS)) and packed["rows"] == (1, sum(LENGTHS))  # no padding compute
    valid = torch.zeros_like(padded["logprobs"], dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        valid[b, : n - 1] = True
    assert float((padded["logprobs"] - packed["logprobs"]).abs()[valid].max()) <= 1e-6
    one, two = padded["record"], packed["record"]
    assert one["trained_tokens"] == two["trained_tokens"] == sum(int(s.loss_mask[1:].sum()) for s in sequences)  # the same masks
    for key in ("loss", "kl_ref", "entropy", "logprob_abs_diff", "prob_ratio_mean", "grad_norm"):
        assert abs(one[key] - two[key]) <= 1e-6 * max(1.0, abs(one[key])), (key, one[key], two[key])
    assert one["grad_norm"] > 1e-3
    scale = max(float(g.abs().max()) for g in padded["grads"].values())
    for name, grad in padded["grads"].items():
        assert float((grad - packed["grads"][name]).abs().max()) <= 1e-6 * scale, name


def test_document_attention_equals_each_document_alone(checkpoints):
    """Two samples of 24 tokens holding five documents (EOD ends each): packed with attention and positions per
    document, every token's loss equals the loss it gets when its document is the whole input."""
    from composer.trainer.distributed import init_distributed, shutdown_distributed
    from composer.trainer.midtrain import BatchPlacement, _token_losses
    from composer.trainer.model import build_model
    from composer.trainer.weights import load_hf_into

    torch.set_num_threads(1)
    eod = 0
    m = model_section_from_hf(checkpoints["qwen3_moe"])
    rng = np.random.default_rng(1)
    tokens = torch.as_tensor(rng.integers(1, m.vocab_size, (2, 25)))
    tokens[0, [6, 15]] = eod
    tokens[1, [9]] = eod
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(2, 24),
        "position_ids": torch.arange(24).expand(2, 24),
    }
    init_distributed(ParallelismSection())
    try:
        model = build_model(m, ParallelismSection()).eval()
        load_hf_into(model, m, checkpoints["qwen3_moe"])
        placed = BatchPlacement("document", eod)(batch)
        assert placed["layout"].lengths == (7, 9, 8, 10, 14) and torch.equal(placed["loss_mask"], torch.ones(1, 48))
        with torch.no_grad():
            packed = _token_losses(model, placed).flatten()
            alone = []
            for row in range(2):
                bounds = [0, *(torch.nonzero(batch["tokens"][row] == eod).flatten() + 1).tolist(), 24]
                for a, b in zip(bounds, bounds[1:]):
                    piece = {key: batch[key][row : row + 1, a:b] for key in ("tokens", "labels")}
                    piece["position_ids"] = torch.arange(b - a)[None]
                    alone.append(_token_losses(model, piece).flatten())
            causal = _token_losses(model, BatchPlacement("causal", eod)(batch)).flatten()
    finally:
        shutdown_distributed()
    alone = torch.cat(alone)
    assert float((packed - alone).abs().max()) <= 1e-5
    assert float((causal - alone).abs().max()) > 1e-3  # attending across documents is another function


def test_packed_conversations_each_get_the_losses_they_get_alone(checkpoints):
    """SFT's packed samples (`sft.pack`): conversations holding EOS tokens inside, first-fit into three samples of 64
    positions; every token's loss equals its loss when its conversation is a padded sample of its own, and attention
    across the sample (causal rows) is another function."""
    from composer.runtime.sft_examples import TokenizedConversations
    from composer.trainer.distributed import init_distributed, shutdown_distributed
    from composer.trainer.midtrain import BatchPlacement, BatchSource, _token_losses
    from composer.trainer.model import build_model
    from composer.trainer.sft import ConversationSamples
    from composer.trainer.weights import load_hf_into

    torch.set_num_threads(1)
    eos = 0
    m = model_section_from_hf(checkpoints["qwen3_moe"])
    rng = np.random.default_rng(2)
    conversations = []
    for n in (30, 12, 41, 9, 25, 17, 33, 6, 20):
        tokens = rng.integers(1, m.vocab_size, n)
        tokens[rng.choice(n - 1, 2, replace=False)] = eos  # the end of assistant turns inside the conversation
        conversations.append((tokens.tolist(), [True] * n))
    data = TokenizedConversations.of(conversations)
    packed = ConversationSamples(data, 64, eos, seed=0, shuffle=True, pack=True)
    members = [packed.sample_conversations(k) for k in range(3)]
    assert sorted(c for b in members for c in b) == list(range(9))  # one pass in three samples
    alone = ConversationSamples(data, 64, eos, seed=0, shuffle=False, pack=False)  # sample c: conversation c
    init_distributed(ParallelismSection())
    try:
        model = build_model(m, ParallelismSection()).eval()
        load_hf_into(model, m, checkpoints["qwen3_moe"])
        with torch.no_grad():
            placed = BatchSource(packed, 3, 3, 0, 1, BatchPlacement("document", eos)).micro_batches(0)[0]
            layout = placed["layout"]
            assert layout.lengths == tuple(len(conversations[c][0]) - 1 for b in members for c in b)
            got = layout.stream(_token_losses(model, placed))
            want = []
            for c in (c for b in members for c in b):
                single = BatchSource(alone, 1, 1, 0, 1, BatchPlacement("causal", eos)).micro_batches(c)[0]
                want.append(_token_losses(model, single).flatten()[: len(conversations[c][0]) - 1])
            rows = BatchSource(packed, 3, 3, 0, 1, BatchPlacement("causal", eos)).micro_batches(0)[0]
            causal = _token_losses(model, rows)[rows["loss_mask"] > 0]  # every real position is trained here
    finally:
        shutdown_distributed()
    want = torch.cat(want)
    assert float((got - want).abs().max()) <= 1e-5
    assert float((causal - want).abs().max()) > 1e-3
