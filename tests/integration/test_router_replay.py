"""Router replay (R3) with real engines: a bf16 vLLM engine samples, an fp32 Megatron learner replays its routes.

The learner's routers are perturbed, so its free routing surely differs from the engine's; replay must make the
routes it uses equal to the engine's on every layer, for tp=1 here and for tp=2 (sequence parallel), ep=2 and both
under torchrun. Batches hold 4 sequences of different lengths, so a sequence-major/batch-major mix-up or a padding
error shows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.recipes.schema import ParallelismSection, RolloutSection, SamplingSection
from composer.trainer.checkpoint_init import init_hf_checkpoint
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.logprobs import pad_micro_batch, token_logprobs
from composer.trainer.model import build_model, forward_logits
from composer.trainer.replay_layout import ReplayLayoutError
from composer.trainer.router_replay import moe_routers, replay_for_micro_batch, replay_metrics, routing, routing_disagreement
from composer.trainer.weights import load_hf_into
from tests.conftest import run_ranks
from tests.helpers.workers.router_replay_worker import perturb_routers

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    [11, 250, 37, 4000, 9, 812],
    [5, 17, 99, 3, 250, 41, 7, 8, 1200],
    [300, 2, 77, 1],
    [64, 128, 77, 1, 400, 33, 2048, 9, 10, 11, 12],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    model = load_recipe(REPO / "recipes/smoke-midtrain.yaml", []).model
    return init_hf_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "tiny", tokenizer_bytes=2**20)


@pytest.fixture(scope="module")
def megatron_ready(checkpoint):
    torch.set_num_threads(1)
    init_distributed(ParallelismSection())
    yield model_section_from_hf(checkpoint)
    shutdown_distributed()


@pytest.fixture(scope="module")
def rollouts(checkpoint, megatron_ready, tmp_path_factory) -> dict:
    """Samples of a bf16 vLLM engine: tokens, per-token engine logprobs and loss masks, routed experts."""
    from composer.rollout.engines.vllm_engine import EmbeddedEngine

    rollout = RolloutSection(max_context=64, kv_cache_gib=0.0625, dtype="bfloat16", sampling=SamplingSection(max_tokens=10))
    engine = EmbeddedEngine(checkpoint, rollout, seed=0, routed_experts=True)
    try:
        completions = [group[0] for group in engine.generate(PROMPTS, seeds=[1, 2, 3, 4])]
    finally:
        del engine
    data = {"tokens": [], "routes": [], "logprobs": [], "masks": []}
    for c in completions:
        n_prompt = len(c.prompt_ids)
        tokens = np.array(c.prompt_ids + c.token_ids)
        data["tokens"].append(tokens)
        data["routes"].append(c.routed_experts)
        data["logprobs"].append(np.concatenate([np.zeros(n_prompt), c.logprobs]).astype(np.float32))
        data["masks"].append(np.arange(len(tokens)) >= n_prompt)
    assert len({len(t) for t in data["tokens"]}) > 1, "sequences of different lengths exercise padding"
    data["path"] = tmp_path_factory.mktemp("rollouts") / "rollouts.pt"
    torch.save({k: data[k] for k in ("tokens", "routes")}, data["path"])
    return data


def learner(m, checkpoint, recompute: bool = False):
    model = build_model(m, ParallelismSection(), recompute_activations=recompute)
    load_hf_into(model, m, checkpoint)
    perturb_routers(model)
    return model.train()


def router_state_is_clear(model) -> bool:
    return all(
        r.router_replay.router_replay_action is None
        and r.router_replay.target_topk_idx is None
        and r.router_replay.recorded_topk_idx is None
        and not r.router_replay.replay_backward_list
        for _, r in moe_routers(model)
    )


def replay_and_backward(model, batch, replay):
    model.zero_grad()
    with routing(model, replay) as used:
        logprobs = token_logprobs(model, batch.tokens)
        logprobs.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return used.routes(), logprobs.detach(), grads


def test_replay_uses_the_engine_routes_and_trains_the_router(checkpoint, megatron_ready, rollouts):
    m = megatron_ready
    model = learner(m, checkpoint)
    batch = pad_micro_batch(rollouts["tokens"])
    routes = rollouts["routes"]

    free_routes, _, _ = replay_and_backward(model, batch, replay_for_micro_batch(model, "off", routes, batch.layout))
    free = routing_disagreement(free_routes, list(range(m.num_layers)), routes, batch.layout)
    assert max(free.values()) > 0, "the perturbed learner must route differently, or replay is not tested"

    replay = replay_for_micro_batch(model, "r3", routes, batch.layout)
    model.zero_grad()
    with routing(model, replay) as replayed:
        token_logprobs(model, batch.tokens).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    used = replayed.routes()
    assert routing_disagreement(used, list(range(m.num_layers)), routes, batch.layout) == {layer: 0.0 for layer in range(m.num_layers)}
    own = routing_disagreement(replayed.preferred(), list(range(m.num_layers)), routes, batch.layout)
    assert max(own.values()) > 0, "the routers' own choice on the replayed inputs still differs from the engine's"
    for layer in range(m.num_layers):
        assert grads[f"decoder.layers.{layer}.mlp.router.weight"].abs().sum() > 0, "gate probabilities must stay differentiable"
    assert router_state_is_clear(model), "no replay state may outlive the micro-batch"

    metrics = replay_metrics(model, batch, routes, rollouts["logprobs"], rollouts["masks"])
    assert all(metrics[f"routing_disagreement_replay/layer{layer}"] == 0.0 for layer in range(m.num_layers))
    assert [metrics[f"routing_disagreement_free/layer{layer}"] for layer in range(m.num_layers)] == list(free.values())
    assert [metrics[f"routing_disagreement_own/layer{layer}"] for layer in range(m.num_layers)] == list(own.values())
    assert metrics["logprob_abs_diff_replay"] < metrics["logprob_abs_diff_free"]


def test_replaying_recorded_routes_is_bitwise_equal_also_with_recompute(checkpoint, megatron_ready, rollouts):
    m = megatron_ready
    model = learner(m, checkpoint)
    batch = pad_micro_batch(rollouts["tokens"])
    with routing(model) as recorded:
        logits = forward_logits(model, batch.tokens)
    own = [recorded.routes()[:, :, i].transpose(0, 1).reshape(-1, m.moe_top_k) for i in range(m.num_layers)]
    with routing(model, own) as replayed:
        assert torch.equal(forward_logits(model, batch.tokens), logits)
    assert torch.equal(replayed.routes(), recorded.routes())
    # the routers' own choice, recomputed beside the replay, is exactly what they chose when routing freely
    assert torch.equal(replayed.preferred(), recorded.routes())
    assert torch.equal(recorded.preferred(), recorded.routes())

    # recompute re-runs the routers in backward: they must replay the forward's routes (engine routes here)
    engine = replay_for_micro_batch(model, "r3", rollouts["routes"], batch.layout)
    _, logprobs, grads = replay_and_backward(model, batch, engine)
    recomputing = learner(m, checkpoint, recompute=True)
    _, logprobs_rc, grads_rc = replay_and_backward(recomputing, batch, engine)
    assert torch.equal(logprobs_rc, logprobs)
    assert grads_rc.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grads_rc[name], grad), name
    assert router_state_is_clear(recomputing)


def test_tensor_and_expert_parallel_replay(checkpoint, megatron_ready, rollouts, tmp_path):
    m = megatron_ready
    model = learner(m, checkpoint)
    reference_batch = pad_micro_batch(rollouts["tokens"])
    replay = replay_for_micro_batch(model, "r3", rollouts["routes"], reference_batch.layout)
    with routing(model, replay):
        reference = token_logprobs(model, reference_batch.tokens, with_grad=False)

    result = run_ranks(2, "tests.helpers.workers.router_replay_worker", str(tmp_path), str(checkpoint), str(rollouts["path"]))
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        for layout, got in torch.load(tmp_path / f"rank{rank}.pt", weights_only=False).items():
            where = f"rank {rank} {layout}"
            assert max(got["free"]["disagreement"].values()) > 0, where
            assert set(got["replay"]["disagreement"].values()) == {0.0}, where
            assert got["free"]["own_disagreement"] == got["free"]["disagreement"], where
            assert max(got["replay"]["own_disagreement"].values()) > 0, where
            assert all(norm > 0 for norm in got["replay"]["router_grad_norms"]), where
            for row, i in enumerate(got["picked"]):
                n = len(rollouts["tokens"][i])
                diff = (got["replay"]["logprobs"][row, : n - 1] - reference[i, : n - 1]).abs().max().item()
                assert diff <= 1e-5, f"{where}: sequence {i} logprobs differ from tp=1 by {diff}"
    assert len(torch.load(tmp_path / "rank0.pt", weights_only=False)["ep2"]["picked"]) == 2, "ep2: two data-parallel ranks"


def test_bad_routes_and_settings_are_clear_errors(checkpoint, megatron_ready, rollouts):
    m = megatron_ready
    model = learner(m, checkpoint)
    batch = pad_micro_batch(rollouts["tokens"])
    good = replay_for_micro_batch(model, "r3", rollouts["routes"], batch.layout)
    rows = batch.seq_len * len(batch.lengths)
    bad = {
        "1 replay tensors for 2 local MoE layers": good[:1],
        rf"replay tensors of \[{rows - 2}, {rows}\] rows for a micro-batch of {rows} router tokens": [good[0][:-2], good[1]],
        r"expected torch.int64 \(tokens, 2\)": [good[0], good[1][:, :1]],
        "outside": [good[0], good[1] + m.num_experts],
        "same expert twice": [good[0], good[1][:, :1].repeat(1, 2)],
        "torch.int32": [good[0].int(), good[1]],
    }
    for match, tensors in bad.items():
        with pytest.raises(ReplayLayoutError, match=match):
            with routing(model, tensors):
                token_logprobs(model, batch.tokens, with_grad=False)
        assert router_state_is_clear(model), match
    with pytest.raises(RuntimeError, match="one forward pass per routing block"):
        with routing(model, good):
            token_logprobs(model, batch.tokens, with_grad=False)
            token_logprobs(model, batch.tokens, with_grad=False)
    assert router_state_is_clear(model)
    # engine routes that do not fit the model
    short = [r[:, :1] for r in rollouts["routes"]]
    with pytest.raises(ReplayLayoutError, match="routes cover 1 layers, the model needs layers up to 1"):
        replay_for_micro_batch(model, "r3", short, batch.layout)
    with pytest.raises(ReplayLayoutError, match="out of range for 8 experts"):
        replay_for_micro_batch(model, "r3", [r.astype(np.int64) + 6 for r in rollouts["routes"]], batch.layout)
    with pytest.raises(UserError, match="carry no routed experts"):
        replay_for_micro_batch(model, "r3", None, batch.layout)
    # settings under which Megatron would silently ignore the replayed routes
    config = model.config
    for field, value, match in (
        ("moe_router_fusion", True, "moe_router_fusion"),
        ("moe_router_load_balancing_type", "sinkhorn", "'sinkhorn' selects experts itself"),
        ("moe_expert_capacity_factor", 1.0, "drops tokens"),
    ):
        original = getattr(config, field)
        setattr(config, field, value)
        try:
            with pytest.raises(UserError, match=match):
                with routing(model, good):
                    pass
        finally:
            setattr(config, field, original)
    # a dense model has nothing to replay
    dense = build_model(
        m.model_copy(update=dict(family="llama", num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0, ffn_hidden_size=256)),
        ParallelismSection(),
    )
    with pytest.raises(UserError, match="needs an MoE model"):
        replay_for_micro_batch(dense, "r3", rollouts["routes"], batch.layout)
    assert replay_for_micro_batch(dense, "off", None, batch.layout) is None
