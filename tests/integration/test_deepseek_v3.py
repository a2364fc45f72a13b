"""The DeepSeek-V3 / Kimi-K2 family with real engines: transformers, Megatron-Core (tp/ep splits) and vLLM agree.

The model is the tiny twin of recipes/kimi-k2-rl.yaml (recipes/base/tiny-deepseek-v3.yaml): MLA with a query
low-rank projection and decoupled RoPE, a dense first layer, 16 routed experts top-4 in 4 groups (2 used per
token) + 1 shared expert, sigmoid router with a random expert bias, routed scaling 2.5. Norm weights are
randomised and every batch has 2 sequences; the checks below also show that the bias and the group limit change
the routing, so an unmapped bias or a wrong group rule cannot pass.
"""

from __future__ import annotations

import json
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
from composer.trainer.router_replay import replay_for_micro_batch, routing, routing_disagreement
from composer.trainer.weights import export_hf, load_hf_into
from tests.conftest import run_ranks
from tests.integration.test_model_engines import assert_same_weights

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parents[2]
TWIN = REPO / "recipes/smoke-deepseek-v3-midtrain.yaml"
BATCH, SEQ = 2, 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return init_hf_checkpoint(load_recipe(TWIN, []).model, tmp_path_factory.mktemp("ckpt") / "tiny-dsv3", tokenizer_bytes=2**20)


@pytest.fixture(scope="module")
def megatron(checkpoint):
    torch.set_num_threads(1)
    m = model_section_from_hf(checkpoint)
    init_distributed(ParallelismSection())
    model = build_model(m, ParallelismSection())
    load_hf_into(model, m, checkpoint)
    yield m, model.eval()
    shutdown_distributed()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(1, 4096, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def hf_router_choices(hf, tokens) -> list[dict[str, torch.Tensor]]:
    """Per MoE layer: HF's top-k [B*S, K] and the scores it chose from (sigmoid, bias, group mask)."""
    found = []

    def capture(router, args, output):
        hidden = args[0].reshape(-1, router.hidden_dim)
        scores = torch.sigmoid(hidden.float() @ router.weight.float().T)
        found.append({"topk": output[2], "scores": scores, "biased": scores + router.e_score_correction_bias})

    handles = [layer.mlp.gate.register_forward_hook(capture) for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        logits = hf(tokens).logits
    for h in handles:
        h.remove()
    return logits, found


def test_model_section_round_trips_through_config_json(checkpoint, megatron):
    m, _ = megatron
    twin = load_recipe(TWIN, []).model
    assert m == twin.model_copy(update={"checkpoint": str(checkpoint)})
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    # vLLM builds the expert bias only for noaux_tc; transformers does not write these two
    assert (config["topk_method"], config["scoring_func"], config["rope_interleave"]) == ("noaux_tc", "sigmoid", True)


def test_megatron_matches_transformers_routing_included(checkpoint, megatron, tokens):
    from transformers import AutoModelForCausalLM

    m, model = megatron
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    hf_logits, choices = hf_router_choices(hf, tokens)
    with routing(model) as used:
        with torch.no_grad():
            logits = forward_logits(model, tokens)
    assert (logits - hf_logits).abs().max().item() <= 1e-4
    assert used.layers == m.moe_layers == [1, 2]
    for i, (layer, hf_choice) in enumerate(zip(used.layers, choices)):
        ours = used.routes()[:, :, i]  # [B, S, K] sorted
        theirs = hf_choice["topk"].view(BATCH, SEQ, -1).sort(-1).values
        assert torch.equal(ours, theirs), f"layer {layer}: expert choices differ"
        unbiased = hf_choice["scores"].topk(m.moe_top_k, -1).indices.sort(-1).values.view(BATCH, SEQ, -1)
        assert not torch.equal(unbiased, theirs), f"layer {layer}: the expert bias must change some choices"
        groups = hf_choice["biased"].topk(m.moe_top_k, -1).indices.sort(-1).values.view(BATCH, SEQ, -1)
        assert not torch.equal(groups, theirs), f"layer {layer}: the group limit must change some choices"
        assert margins(hf_choice["biased"], m) > 1e-5, f"layer {layer}: routing too close to call for this comparison"
    dense = model.decoder.layers[0].mlp
    assert not hasattr(dense, "router") and dense.linear_fc1.weight.shape[0] == 2 * m.ffn_hidden_size


def margins(biased: torch.Tensor, m) -> float:
    """Smallest gap, over tokens, between the chosen and the next group and between the k-th and (k+1)-th expert."""
    groups = biased.view(len(biased), m.moe_router_groups, -1).topk(2, -1).values.sum(-1).sort(-1, descending=True).values
    group_gap = groups[:, m.moe_router_group_top_k - 1] - groups[:, m.moe_router_group_top_k]
    allowed = groups[:, m.moe_router_group_top_k - 1 : m.moe_router_group_top_k]
    per_group = biased.view(len(biased), m.moe_router_groups, -1)
    group_sums = per_group.topk(2, -1).values.sum(-1)
    kept = torch.where((group_sums >= allowed)[..., None], per_group, torch.tensor(float("-inf"))).flatten(1)
    ranked = kept.sort(-1, descending=True).values
    expert_gap = ranked[:, m.moe_top_k - 1] - ranked[:, m.moe_top_k]
    return min(group_gap.min().item(), expert_gap.min().item())


def test_import_export_round_trip_is_bit_exact(checkpoint, megatron, tmp_path):
    m, model = megatron
    export_hf(model, m, tmp_path / "export", tokenizer_dir=checkpoint, max_shard_bytes=2 * 2**20)
    assert len(set((tmp_path / "export").glob("*.safetensors"))) > 1
    assert_same_weights(checkpoint, tmp_path / "export")  # expert bias (fp32 buffer) included
    assert model_section_from_hf(tmp_path / "export") == m.model_copy(update={"checkpoint": str(tmp_path / "export")})


@pytest.fixture(scope="module")
def served(checkpoint, megatron, tokens, tmp_path_factory) -> dict:
    """The fp32 embedded engine (CPU_MLA backend): teacher-forced logprobs of `tokens` and 2 sampled continuations
    with their routed experts (saved for the torchrun replay worker too)."""
    from composer.rollout.engines.vllm_engine import EmbeddedEngine

    rollout = RolloutSection(max_context=64, kv_cache_gib=0.0625, dtype="float32", sampling=SamplingSection(max_tokens=8))
    engine = EmbeddedEngine(checkpoint, rollout, seed=0, routed_experts=True)
    try:
        logprobs = engine.prompt_logprobs([row.tolist() for row in tokens])
        samples = [group[0] for group in engine.generate([row[:10].tolist() for row in tokens], seeds=[1, 2])]
    finally:
        del engine
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.pt"
    torch.save({"tokens": [np.array(s.prompt_ids + s.token_ids) for s in samples], "routes": [s.routed_experts for s in samples]}, path)
    return {"logprobs": logprobs, "samples": samples, "path": path}


def test_vllm_serves_it_and_router_replay_of_its_routes_agrees(megatron, tokens, served):
    """Teacher-forced logprobs equal Megatron's; the experts vLLM reports per token are the learner's own
    bias-corrected, group-limited choices, and replaying them uses exactly them."""
    m, model = megatron
    with torch.no_grad():
        ours = torch.log_softmax(forward_logits(model, tokens).double(), -1)
    for b in range(BATCH):
        expected = ours[b, torch.arange(SEQ - 1), tokens[b, 1:]]
        assert (torch.tensor(served["logprobs"][b], dtype=torch.float64) - expected).abs().max().item() <= 1e-4

    samples = served["samples"]
    sequences = [np.array(s.prompt_ids + s.token_ids) for s in samples]
    routes = [s.routed_experts for s in samples]
    for s, r in zip(samples, routes):
        assert r.shape == (len(s.prompt_ids) + len(s.token_ids) - 1, m.num_layers, m.moe_top_k)  # dense layer 0 has a row
    batch = pad_micro_batch(sequences)
    for mode in ("off", "r3"):
        with routing(model, replay_for_micro_batch(model, mode, routes, batch.layout)) as used:
            learner = token_logprobs(model, batch.tokens, with_grad=False)
        assert routing_disagreement(used.routes(), used.layers, routes, batch.layout) == {1: 0.0, 2: 0.0}, mode
    for row, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        generated = learner[row, start : start + len(s.token_ids)]
        assert (generated - torch.tensor(s.logprobs)).abs().max().item() <= 1e-4


def test_router_replay_under_tensor_and_expert_parallelism(checkpoint, served, tmp_path):
    """tp=2 (sequence parallel), ep=2 and both: with the learner's routers perturbed, free routing departs from
    vLLM's routes and replay restores them on every MoE layer (tests/helpers/workers/router_replay_worker.py)."""
    result = run_ranks(2, "tests.helpers.workers.router_replay_worker", str(tmp_path), str(checkpoint), str(served["path"]))
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        for layout, got in torch.load(tmp_path / f"rank{rank}.pt", weights_only=False).items():
            assert max(got["free"]["disagreement"].values()) > 0, (rank, layout)
            assert got["replay"]["disagreement"] == {1: 0.0, 2: 0.0}, (rank, layout)
            assert all(norm > 0 for norm in got["replay"]["router_grad_norms"]), (rank, layout)


def test_tensor_and_expert_parallel_match_single_process(checkpoint, tmp_path):
    """tp=2 (sequence parallel), ep=2 (both dispatchers) and tp=2 x ep=2 against tp=1: logits, the loss before and
    after one SGD step, the updated weights and the expert bias Megatron moved from the step's expert loads."""
    result = run_ranks(2, "tests.helpers.workers.model_parallel_worker", str(tmp_path), str(checkpoint))
    assert result.returncode == 0, result.stderr[-4000:]
    splits = torch.load(tmp_path / "results.pt")["deepseek_v3"]
    reference = splits.pop("tp1")
    assert reference["loss_before"] - reference["loss_after"] > 1e-2
    # Megatron's aux-loss-free rule: after one step every bias has moved by +-moe_router_bias_update_rate or not at all
    from safetensors import safe_open

    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        moved = (reference["weights_after"][bias] - f.get_tensor(bias)).abs() / 1e-3
    assert ((moved - 1).abs() < 1e-3).sum() > 0 and torch.all(((moved - 1).abs() < 1e-3) | (moved < 1e-3))
    for name, got in splits.items():
        assert (got["logits"] - reference["logits"]).abs().max().item() <= 1e-5, name
        assert abs(got["loss_before"].item() - reference["loss_before"].item()) <= 1e-5, name
        assert abs(got["loss_after"].item() - reference["loss_after"].item()) <= 1e-5, name
        for tensor, weight in reference["weights_after"].items():
            assert (got["weights_after"][tensor] - weight).abs().max().item() <= 1e-6, f"{name}: {tensor}"
    for export in sorted(tmp_path.glob("export-*")):
        assert_same_weights(checkpoint, export)


def test_layouts_and_shapes_the_provider_cannot_build_are_refused(checkpoint, megatron, tmp_path):
    import shutil

    from composer.rollout.engines.vllm_engine import checkpoint_config, cpu_attention_backend
    from composer.trainer.model import check_supported

    m, _ = megatron
    with pytest.raises(UserError, match="parallelism.tp: 3 does not divide model.num_attention_heads=4"):
        check_supported(m, ParallelismSection(tp=3, sequence_parallel=True))
    for update, message in (
        ({"norm_topk_prob": False}, "model.norm_topk_prob: must be true"),
        ({"moe_router_group_top_k": 1}, "model.moe_router_group_top_k: must be model.moe_top_k / 2"),
        ({"num_shared_experts": 0}, "model.num_shared_experts: deepseek_v3 layers always have shared experts"),
        ({"head_dim": 64}, "model.head_dim: must be qk_nope_head_dim \\+ qk_rope_head_dim = 96"),
    ):
        with pytest.raises(UserError, match=message):
            check_supported(m.model_copy(update=update), ParallelismSection())
    with pytest.raises(UserError, match="model.kv_lora_rank: is a deepseek_v3 setting; model.family is 'qwen3_moe'"):
        check_supported(m.model_copy(update={"family": "qwen3_moe", "num_shared_experts": 0}), ParallelismSection())
    changed = shutil.copytree(checkpoint, tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    for key, value, message in (
        ("rope_interleave", False, "rope_interleave"),
        ("scoring_func", "softmax", "scoring_func"),
        (
            "rope_parameters",
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "attention_factor": 1.2},
            "attention_factor",
        ),
    ):
        (changed / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(UserError, match=f"unsupported setting\\(s\\) for the Megatron provider: .*{message}"):
            model_section_from_hf(changed)
    (changed / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 256}))
    with pytest.raises(UserError, match="vLLM cannot serve .* on CPU: .*kv_lora_rank=256 \\(needs 512\\)"):
        cpu_attention_backend(checkpoint_config(changed), "float32", str(changed))
    config = checkpoint_config(checkpoint)
    assert cpu_attention_backend(config, "float32", str(checkpoint)) == "CPU_MLA" and cpu_attention_backend(config, "bfloat16", "") is None


# --- the twin's whole chain: model init, midtrain, RL with router replay, sync --------------------------------


def composer_ok(*args: str) -> str:
    from tests.conftest import run_composer

    result = run_composer(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    from composer.runtime.run_dir import read_metrics

    root = tmp_path_factory.mktemp("chain")
    composer_ok("model", "init", str(root / "init"), "--recipe", str(TWIN))
    composer_ok(
        "train",
        "midtrain",
        str(TWIN),
        *sum(
            (
                ["--set", kv]
                for kv in (
                    f"run.dir={root / 'runs'}",
                    f"model.checkpoint={root / 'init'}",
                    f"data.cache_dir={root / 'cache'}",
                    "train.steps=12",
                    "train.eval_every=6",
                    "train.eval_batches=2",
                    "train.checkpoint_every=12",
                    "train.global_batch_size=8",
                    "optim.warmup_steps=2",
                    "data.split=[90,10,0]",
                    'data.sources.0.paths=["{stdlib}/email/**/*.py"]',
                )
            ),
            [],
        ),
    )
    midtrain = root / "runs/smoke-deepseek-v3-midtrain"
    composer_ok(
        "train",
        "rl",
        str(REPO / "recipes/smoke-deepseek-v3-rl.yaml"),
        *sum(
            (
                ["--set", kv]
                for kv in (
                    f"run.dir={root / 'runs'}",
                    f"model.checkpoint={midtrain / 'export'}",
                    f"sync.store={root / 'store'}",
                    "train.steps=3",
                    "rl.prompts_per_step=2",
                    "rl.group_size=4",
                    "train.global_batch_size=8",
                )
            ),
            [],
        ),
    )
    composer_ok("sync", "pull", "--store", str(root / "store"), "--to", str(root / "receiver"))
    rl = root / "runs/smoke-deepseek-v3-rl"
    return {
        "root": root,
        "midtrain": list(read_metrics(midtrain / "metrics.jsonl")),
        "rl": list(read_metrics(rl / "metrics.jsonl")),
        "midtrain_export": midtrain / "export",
        "pulled": root / "receiver/current",
    }


def test_twin_midtrains_and_the_expert_bias_balances(chain):
    evals = [r["eval_loss"] for r in chain["midtrain"] if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.5, evals
    assert all(r["moe_aux_loss"] > 0 for r in chain["midtrain"][1:])
    from safetensors import safe_open

    from composer.trainer.weights import hf_weight_files

    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    tensors = []
    for ckpt in (chain["root"] / "init", chain["midtrain_export"]):
        path = hf_weight_files(ckpt)[name]
        with safe_open(path, "pt") as f:
            tensors.append(f.get_tensor(name))
    steps = (tensors[1] - tensors[0]) / 1e-3  # 12 optimizer steps of +-rate each
    assert steps.abs().max() <= 12 + 1e-3 and torch.allclose(steps, steps.round(), atol=1e-2) and steps.abs().sum() > 0


def test_twin_rl_replays_the_engine_routes_and_ships_its_policy(chain):
    first = chain["rl"][0]
    assert first["logprob_abs_diff"] < 1e-5  # same fp32 weights in vLLM (CPU_MLA) and Megatron
    assert first["routing_disagreement_layer1"] == 0.0 and first["routing_disagreement_layer2"] == 0.0
    assert "routing_disagreement_layer0" not in first  # the dense layer has no router
    assert [r["step"] for r in chain["rl"]] == [1, 2, 3]
    pulled = chain["pulled"]
    assert model_section_from_hf(pulled).family == "deepseek_v3"
    assert json.loads((pulled / "config.json").read_text())["topk_method"] == "noaux_tc"


def test_twin_rl_replayed_with_fp8_policies_ships_fp8_deltas(chain):
    """The same learner steps (--replay of the run above, no engines) with rollout.dtype fp8: every policy goes out
    in block fp8 (starting policy converted, the learner's exports quantized), as sparse deltas, and pulls back as a
    checkpoint composer reads."""
    from composer.runtime.run_dir import read_metrics
    from composer.trainer.hf_checkpoint import CheckpointLayout
    from composer.trainer.weights import expected_hf_names

    root = chain["root"]
    composer_ok(
        "train",
        "rl",
        str(REPO / "recipes/smoke-deepseek-v3-rl.yaml"),
        "--replay",
        str(root / "runs/smoke-deepseek-v3-rl"),
        *sum(
            (
                ["--set", kv]
                for kv in (
                    f"run.dir={root / 'runs'}",
                    "run.name=replay-fp8",
                    f"model.checkpoint={chain['midtrain_export']}",
                    "rollout.dtype=fp8",
                    "train.steps=3",
                    "rl.prompts_per_step=2",
                    "rl.group_size=4",
                    "train.global_batch_size=8",
                )
            ),
            [],
        ),
    )
    records = list(read_metrics(root / "runs/replay-fp8/metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 < r["sync_changed_fraction"] < 1 and r["sync_ratio"] > 1 for r in records)
    composer_ok(
        "sync", "pull", "--store", str(root / "runs/replay-fp8/weights"), "--to", str(root / "receiver-fp8")
    )  # a replay's own store
    pulled = root / "receiver-fp8/current"
    layout = CheckpointLayout.of(pulled)
    m = model_section_from_hf(pulled)
    assert layout.quantization.method == "fp8" and layout.is_quantized("model.layers.1.mlp.experts.3.down_proj.weight")
    assert layout.problems(m, expected_hf_names(m)) == []
