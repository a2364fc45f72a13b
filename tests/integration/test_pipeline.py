"""Pipeline parallelism through Megatron's schedules on gloo: a pp=2 training step equals the pp=1 step.

Two real gloo processes (torchrun): the tiny DeepSeek-V3 twin with 4 layers (a dense first layer on stage 0,
MoE layers on both stages) and the tiny Qwen3-MoE. The step has 3 micro-batches (1F1B warm-up, steady phase and
cool-down) with a padded tail; the HF export gathered from both stages must be the imported checkpoint, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer.recipes.loader import load_recipe
from composer.trainer.checkpoint_init import init_hf_checkpoint
from composer.trainer.hf_config import model_section_from_hf
from tests.conftest import run_ranks
from tests.integration.test_model_engines import assert_same_weights

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp")
    deepseek = load_recipe(REPO / "recipes/smoke-deepseek-v3-midtrain.yaml", ["model.num_layers=4", "model.vocab_size=512"]).model
    qwen = load_recipe(REPO / "recipes/smoke-midtrain.yaml", ["model.vocab_size=512"]).model
    return {m.family: init_hf_checkpoint(m, root / m.family, tokenizer_bytes=2**18) for m in (deepseek, qwen)}


def test_pp2_step_equals_pp1_and_exports_from_both_stages(checkpoints, tmp_path):
    result = run_ranks(2, "tests.helpers.workers.pipeline_worker", str(tmp_path), *map(str, checkpoints.values()))
    assert result.returncode == 0, result.stderr[-4000:]
    results = torch.load(tmp_path / "results.pt")
    tokens = 3 * (32 + 20)  # 3 micro-batches of a full and a 20-token sequence
    for family, layouts in results.items():
        pp1, pp2 = layouts["pp1"], layouts["pp2"]
        assert pp2["rank0_layers"] == pp1["rank0_layers"] // 2, f"{family}: stage 0 must hold half the layers"
        assert abs(pp2["loss_before"] - pp1["loss_before"]) / tokens <= 1e-5, family
        assert abs(pp2["loss_after"] - pp1["loss_after"]) / tokens <= 1e-5, family
        assert (pp1["loss_before"] - pp1["loss_after"]) / tokens > 1e-2, f"{family}: the SGD step must change the loss"
        assert pp2["weights_after"].keys() == pp1["weights_after"].keys()
        for name, weight in pp1["weights_after"].items():
            assert (pp2["weights_after"][name] - weight).abs().max().item() <= 1e-6, f"{family}: {name}"
        assert_same_weights(checkpoints[family], tmp_path / f"export-{family}-pp2")


@pytest.mark.slow
def test_midtrain_at_pp2_reproduces_pp1(checkpoints, tmp_path):
    """`composer train midtrain` with the twin split over 2 stages (dp=1) against 2 data-parallel replicas (pp=1):
    every recorded metric of 2 steps and 3 evaluations agrees, and the run checkpoints and exports from both stages."""
    from composer.runtime.run_dir import read_metrics
    from tests.conftest import run_composer

    runs = {}
    for pp in (1, 2):
        sets = [
            f"model.checkpoint={checkpoints['deepseek_v3']}",
            "model.num_layers=4",
            "model.vocab_size=512",
            f"run.dir={tmp_path}",
            f"run.name=pp{pp}",
            f"parallelism.pp={pp}",
            "parallelism.ep=1",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.steps=2",
            "train.eval_every=1",
            "train.eval_batches=1",
            "train.checkpoint_every=2",
            "train.global_batch_size=8",
            "optim.warmup_steps=1",
            "data.split=[90,10,0]",
            'data.sources.0.paths=["{stdlib}/email/**/*.py"]',
        ]
        result = run_composer(
            "train", "midtrain", str(REPO / "recipes/smoke-deepseek-v3-midtrain.yaml"), *(a for kv in sets for a in ("--set", kv))
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[pp] = list(read_metrics(tmp_path / f"pp{pp}" / "metrics.jsonl"))
    assert [r["step"] for r in runs[2]] == [0, 1, 2]
    for one, two in zip(runs[1], runs[2]):
        for key in ("loss", "eval_loss", "grad_norm", "tokens", "moe_aux_loss", "moe_max_over_mean_l1", "moe_cv_l3"):
            if key in one:
                assert abs(one[key] - two[key]) <= 1e-5 * max(1.0, abs(one[key])), (one["step"], key, one[key], two[key])
    assert "moe_max_over_mean_l0" not in runs[2][1]  # layer 0 is dense
    assert sorted(p.name for p in (tmp_path / "pp2/checkpoints").iterdir()) == ["latest", "step-00000002"]
    assert model_section_from_hf(tmp_path / "pp2/export").num_layers == 4
