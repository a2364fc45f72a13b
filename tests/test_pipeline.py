"""Pipeline parallelism through Megatron's schedules on gloo: a pp=2 training step equals the pp=1 step.

Two real gloo processes (torchrun): the tiny DeepSeek-V3 twin with 4 layers (a dense first layer on stage 0,
MoE layers on both stages) and the tiny Qwen3-MoE. The step has 3 micro-batches (1F1B warm-up, steady phase and
cool-down) with a padded tail; the HF export gathered from both stages must be the imported checkpoint, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recipes.loader import load_recipe
from tests.test_model_engines import assert_same_weights
from trainer.checkpoint_init import init_hf_checkpoint
from trainer.distributed import run_torchrun

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp")
    deepseek = load_recipe(REPO / "recipes/smoke-deepseek-v3-midtrain.yaml", ["model.num_layers=4", "model.vocab_size=512"]).model
    qwen = load_recipe(REPO / "recipes/smoke-midtrain.yaml", ["model.vocab_size=512"]).model
    return {m.family: init_hf_checkpoint(m, root / m.family, tokenizer_bytes=2**18) for m in (deepseek, qwen)}


def test_pp2_step_equals_pp1_and_exports_from_both_stages(checkpoints, tmp_path):
    result = run_torchrun(2, [str(REPO / "tests/pipeline_worker.py"), str(tmp_path), *map(str, checkpoints.values())],
                          env={"PYTHONPATH": str(REPO)}, timeout=300)
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
