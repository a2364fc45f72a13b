"""Grouped-GEMM experts and fused SDPA attention compute what SequentialMLP and Megatron's local attention compute.

Both families (the tiny Qwen3-MoE of recipes/smoke-midtrain.yaml and the DeepSeek-V3 twin with MLA, shared experts,
a biased sigmoid router), fp32 on CPU: logprobs and every parameter's gradient within 1e-5, the same free routing,
and router replay with grouped experts uses exactly the replayed routes; at world size 1 and under tp/ep on 2 gloo
ranks (tests/helpers/workers/kernel_parity_worker.py). Also: the recipe key, its refusals and the GPU benchmark's --tiny run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.recipes.schema import KernelsSection, ParallelismSection
from composer.trainer.checkpoint_init import init_hf_checkpoint
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.kernels import check_kernels_installed, resolve_kernels
from composer.trainer.model import build_model
from tests.conftest import run_ranks
from tests.helpers.workers.kernel_parity_worker import kernel_parity

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kernels")
    return {
        family: init_hf_checkpoint(load_recipe(REPO / recipe, []).model, root / family, tokenizer_bytes=2**20)
        for family, recipe in (("qwen3_moe", "recipes/smoke-midtrain.yaml"), ("deepseek_v3", "recipes/smoke-deepseek-v3-midtrain.yaml"))
    }


def assert_parity(got: dict, where) -> None:
    assert got["logprob_max_diff"] <= TOLERANCE, (where, got)
    assert got["grad_max_diff"] <= TOLERANCE * max(1.0, got["grad_max"]), (where, got)  # fp32 rounding scales with the gradient
    assert got["grad_max"] > 1e-3, (where, got)  # gradients that reach the weights, not all zero
    assert got["free_route_mismatches"] == 0, (where, got)
    assert got["replayed_route_mismatches"] == 0 and got["routes_compared"] > 0, (where, got)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_grouped_experts_and_sdpa_match_the_local_modules(checkpoints, family):
    torch.set_num_threads(1)
    m = model_section_from_hf(checkpoints[family])
    tokens = torch.randint(1, m.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    init_distributed(ParallelismSection())
    try:
        assert_parity(kernel_parity(m, ParallelismSection(), checkpoints[family], tokens), family)
    finally:
        shutdown_distributed()


def test_parity_under_tensor_and_expert_parallelism(checkpoints, tmp_path):
    """tp=2 with sequence parallel, ep=2 and tp=2 x ep=2, both families, on each of the 2 ranks."""
    result = run_ranks(2, "tests.helpers.workers.kernel_parity_worker", str(tmp_path), *map(str, checkpoints.values()))
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert sorted(results) == ["deepseek_v3", "qwen3_moe"]
        for family, layouts in results.items():
            assert sorted(layouts) == ["ep2", "tp2_sp", "tp2_sp_ep2"]
            for layout, got in layouts.items():
                assert_parity(got, (rank, family, layout))


def test_auto_picks_the_fast_kernels_and_the_choice_is_logged(checkpoints, capsys, monkeypatch):
    import composer.trainer.model as model_module

    monkeypatch.setattr(model_module, "_logged_kernels", set())  # as in a fresh process (other tests built models)
    m = model_section_from_hf(checkpoints["qwen3_moe"])
    assert m.kernels == KernelsSection(experts="auto", attention="auto")
    init_distributed(ParallelismSection())
    try:
        model = build_model(m, ParallelismSection())
        build_model(m, ParallelismSection())  # a second build (e.g. the RL reference copy) logs nothing new
    finally:
        shutdown_distributed()
    assert (model.kernels.experts, model.kernels.attention) == ("grouped", "sdpa")
    assert type(model.decoder.layers[0].mlp.experts).__name__ == "GroupedGemmExperts"
    assert type(model.decoder.layers[0].self_attention.core_attention).__name__ == "SDPAttention"
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model kernels:")]
    assert logged == ["model kernels: experts=grouped (asked auto), attention=sdpa (asked auto)"]


def test_a_torch_without_grouped_mm_refuses_grouped_and_falls_back_under_auto(monkeypatch):
    from composer.trainer import kernels

    monkeypatch.delattr(F, "grouped_mm")
    monkeypatch.delattr(torch, "_grouped_mm")
    kernels.grouped_mm_runs.cache_clear()
    try:
        with pytest.raises(UserError, match="model.kernels.experts=grouped: torch .* has no grouped_mm"):
            check_kernels_installed(KernelsSection(experts="grouped"))
        from composer.trainer.midtrain import check_recipe

        with pytest.raises(UserError, match="has no grouped_mm"):  # at recipe check, before anything launches
            check_recipe(load_recipe(REPO / "recipes/smoke-midtrain.yaml", ["model.kernels.experts=grouped"]))
        check_recipe(load_recipe(REPO / "recipes/smoke-midtrain.yaml", []))  # auto falls back instead
        with pytest.raises(UserError, match="cannot run grouped_mm"):
            resolve_kernels(KernelsSection(experts="grouped"), torch.float32, "cpu")
        assert resolve_kernels(KernelsSection(), torch.float32, "cpu").experts == "sequential"
    finally:
        monkeypatch.undo()
        kernels.grouped_mm_runs.cache_clear()


def test_the_recipe_key_is_strict():
    recipe = REPO / "recipes/smoke-midtrain.yaml"
    assert load_recipe(recipe, ["model.kernels.experts=sequential"]).model.kernels.experts == "sequential"
    for override, message in (("model.kernels.experts=fused", "experts"), ("model.kernels.flash=true", "flash")):
        with pytest.raises(UserError, match=message):
            load_recipe(recipe, [override])


def test_gpu_benchmark_runs_tiny_on_cpu():
    """benchmarks/gpu_bench.py --tiny: every section runs and prints its ratio against the baseline of the same run."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/gpu_bench.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    for needle in ("qwen3_moe", "deepseek_v3", "tokens/s", "speedup x", "parity", "sync encode", "peak memory"):
        assert needle in out, (needle, out)


def test_bf16_training_keeps_fp32_master_weights_and_gradients():
    """model.dtype=bfloat16: bf16 parameters, fp32 gradient buffers and fp32 master weights in the optimizer, and
    the loss of a few steps within bf16 noise of the same steps in fp32 (the fast kernels in both)."""
    from composer.recipes.schema import OptimSection
    from composer.trainer.logprobs import token_logprobs
    from composer.trainer.optimizer import TrainOptimizer, wrap_data_parallel

    torch.set_num_threads(1)
    m = load_recipe(REPO / "recipes/smoke-midtrain.yaml", []).model
    tokens = torch.randint(1, m.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    p = ParallelismSection()
    losses = {}
    for dtype in ("float32", "bfloat16"):
        init_distributed(p)
        try:
            torch.manual_seed(0)
            model = build_model(m.model_copy(update={"dtype": dtype}), p)
            ddp = wrap_data_parallel(model, p)
            optimizer = TrainOptimizer(ddp, OptimSection(lr=1e-3), p, 4, getattr(torch, dtype))
            losses[dtype] = []
            for _ in range(4):
                optimizer.zero_grad()
                loss = -token_logprobs(ddp, tokens).mean()
                loss.backward()
                optimizer.step()
                losses[dtype].append(float(loss))
            masters = {q.dtype for inner in optimizer._inner_optimizers() for group in inner.param_groups for q in group["params"]}
            assert {q.dtype for q in model.parameters()} == {getattr(torch, dtype)}
            assert {q.main_grad.dtype for q in model.parameters()} == {torch.float32}
            assert masters == {torch.float32}
        finally:
            shutdown_distributed()
    assert losses["float32"][-1] < losses["float32"][0] - 0.1  # it learns (the same batch each step)
    assert max(abs(a - b) for a, b in zip(losses["float32"], losses["bfloat16"])) < 0.05


@pytest.mark.parametrize("counts", [[7, 0, 3, 0, 12, 1, 0, 9], [0] * 8], ids=["uneven_with_empty_experts", "no_tokens"])
def test_grouped_experts_module_matches_the_loop_on_uneven_and_empty_groups(counts):
    """The experts module alone, as the dispatcher calls it: tokens sorted by expert, some experts (or all) empty."""
    torch.set_num_threads(1)
    m = load_recipe(REPO / "recipes/smoke-midtrain.yaml", []).model
    tokens_per_expert = torch.tensor(counts)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(sum(counts), m.hidden_size, generator=generator)
    probs = torch.rand(sum(counts), generator=generator)
    results = {}
    init_distributed(ParallelismSection())
    try:
        for name in ("sequential", "grouped"):
            torch.manual_seed(0)
            model = build_model(m.model_copy(update={"kernels": KernelsSection(experts=name)}), ParallelismSection())
            module = model.decoder.layers[0].mlp.experts
            assert type(module).__name__ == {"sequential": "SequentialMLP", "grouped": "GroupedGemmExperts"}[name]
            x = hidden.clone().requires_grad_()
            out, bias = module(x, tokens_per_expert, probs)
            # a plain sum: its gradient is a broadcast (zero-stride) tensor, the case grouped_mm rejects unhelped
            (out.sum() + sum(p.sum() * 0 for p in module.parameters())).backward()
            results[name] = (out.detach(), x.grad, [p.grad for p in module.parameters()])
            assert bias is None and out.shape == hidden.shape
    finally:
        shutdown_distributed()
    (out_s, dx_s, dw_s), (out_g, dx_g, dw_g) = results["sequential"], results["grouped"]
    if sum(counts):
        assert (out_s - out_g).abs().max() <= TOLERANCE and (dx_s - dx_g).abs().max() <= TOLERANCE
    for index, (a, b) in enumerate(zip(dw_s, dw_g)):
        assert (a - b).abs().max() <= TOLERANCE, index
    # parameters in order: expert e's linear_fc1, linear_fc2; an expert that got no token gets zero gradient
    assert [bool(g.abs().max() > 0) for g in dw_g] == [c > 0 for c in counts for _ in ("fc1", "fc2")]
