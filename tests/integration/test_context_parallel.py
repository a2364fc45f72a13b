"""Context parallelism (ring attention in composer's SDPA attention, trainer.context_parallel) computes what one
rank computes.

- 4 gloo ranks (tests/helpers/workers/context_parallel_worker.py): cp2 == cp1 and cp2 x tp2 == tp1 for both families (GQA and MLA),
  padded rows and packed streams, with sequences of 37, 20 and 9 tokens (padded per trainer.packing's rules): logits
  and the learner's logprobs of every token that predicts one, the loss and every weight's gradient within 1e-5
  (fp32), and router replay uses exactly the replayed experts.
- `composer train midtrain` at cp2 reproduces cp1 (loss, eval loss, grad norm, load-balancing figures).
- Bad input: one message each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.trainer.checkpoint_init import init_hf_checkpoint
from tests.conftest import RECIPES, run_composer, run_ranks

pytestmark = pytest.mark.engines

TOLERANCE = 1e-5
LENGTHS = [37, 20, 9]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cp")
    recipes = {"qwen3_moe": "smoke-midtrain.yaml", "deepseek_v3": "smoke-deepseek-v3-midtrain.yaml"}
    return {
        family: init_hf_checkpoint(load_recipe(RECIPES / recipe, ["model.vocab_size=512"]).model, root / family, tokenizer_bytes=2**18)
        for family, recipe in recipes.items()
    }


def test_cp2_and_cp2_x_tp2_compute_what_one_rank_computes(checkpoints, tmp_path):
    result = run_ranks(4, "tests.helpers.workers.context_parallel_worker", str(tmp_path), *map(str, checkpoints.values()), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    results = torch.load(tmp_path / "results.pt")
    valid = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.bool)  # positions that predict a token
    for b, n in enumerate(LENGTHS):
        valid[b, : n - 1] = True
    for family, layouts in results.items():
        for packed in (False, True):
            reference = layouts["cp1", packed]
            scale = max(float(g.abs().max()) for g in reference["grads"].values())
            assert scale > 1e-2, family
            for name in ("cp2", "cp2_tp2"):
                got, where = layouts[name, packed], (family, name, "packed" if packed else "padded")
                assert float((got["logits"] - reference["logits"]).abs()[valid].max()) <= TOLERANCE, where
                assert float((got["logprobs"] - reference["logprobs"]).abs()[valid[:, :-1]].max()) <= TOLERANCE, where
                assert abs(got["loss"] - reference["loss"]) <= TOLERANCE, where
                assert got["grads"].keys() == reference["grads"].keys()
                for weight, grad in reference["grads"].items():
                    assert float((got["grads"][weight] - grad).abs().max()) <= TOLERANCE * max(1.0, scale), (where, weight)
                assert all(torch.equal(a, b) for a, b in zip(got["routes"], reference["routes"])), where
            # each rank holds half of every sequence: packed, each padded to a multiple of 2*cp (and the stream of 2*cp*tp)
            assert layouts["cp2", packed]["rows"] == ((1, 36) if packed else (3, 20)), family
            assert layouts["cp1", packed]["rows"] == ((1, 66) if packed else (3, 37)), family


@pytest.mark.slow
def test_midtrain_at_cp2_reproduces_cp1(checkpoints, tmp_path):
    """The DeepSeek-V3 twin on 2 ranks, documents packed with their own attention: cp2 (each sample split over both
    ranks) against 2 data-parallel replicas; every recorded metric of 2 steps and 2 evaluations agrees."""
    from composer.runtime.run_dir import read_metrics

    runs = {}
    for cp in (1, 2):
        sets = [
            f"model.checkpoint={checkpoints['deepseek_v3']}",
            "model.vocab_size=512",
            f"run.dir={tmp_path}",
            f"run.name=cp{cp}",
            f"parallelism.cp={cp}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.attention=document",
            "train.steps=2",
            "train.eval_every=2",
            "train.eval_batches=1",
            "train.checkpoint_every=2",
            "train.global_batch_size=8",
            "data.seq_length=128",
            "optim.warmup_steps=1",
            "data.split=[90,10,0]",
            'data.sources.0.paths=["{stdlib}/email/**/*.py"]',
        ]
        result = run_composer(
            "train", "midtrain", str(RECIPES / "smoke-deepseek-v3-midtrain.yaml"), *(a for kv in sets for a in ("--set", kv))
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[cp] = list(read_metrics(tmp_path / f"cp{cp}" / "metrics.jsonl"))
    assert [r["step"] for r in runs[2]] == [0, 1, 2]
    for one, two in zip(runs[1], runs[2]):
        for key in ("loss", "eval_loss", "grad_norm", "tokens", "moe_aux_loss"):
            if key in one:
                assert abs(one[key] - two[key]) <= 1e-5 * max(1.0, abs(one[key])), (one["step"], key, one[key], two[key])
        # expert loads count discrete top-k choices: a token whose scores tie within rounding (cp sums its attention
        # in another order) may pick another expert, a step of one token in a load of hundreds
        for key in ("moe_max_over_mean_l1", "moe_cv_l2"):
            if key in one:
                assert abs(one[key] - two[key]) <= 1e-2 * abs(one[key]), (one["step"], key, one[key], two[key])
    assert "grad_norm" in runs[2][1] and "moe_aux_loss" in runs[2][1]


def test_bad_context_parallel_settings_are_one_message_each():
    with pytest.raises(UserError, match=r"data.seq_length: 102 is not a multiple of 2\*cp = 4"):
        load_recipe(RECIPES / "smoke-midtrain.yaml", ["parallelism.cp=2", "parallelism.ep=1", "data.seq_length=102"])
    with pytest.raises(UserError, match="model.kernels.attention: parallelism.cp=2 need attention sdpa"):
        load_recipe(RECIPES / "smoke-midtrain.yaml", ["parallelism.cp=2", "parallelism.ep=1", "model.kernels.attention=local"])
    with pytest.raises(UserError, match="parallelism.cp: context parallelism with pipeline parallelism"):
        load_recipe(
            RECIPES / "smoke-midtrain.yaml", ["parallelism.cp=2", "parallelism.ep=1", "parallelism.pp=2", "cluster.procs_per_host=4"]
        )
    recipe = load_recipe(RECIPES / "smoke-midtrain.yaml", ["parallelism.cp=2", "parallelism.ep=1"])
    assert recipe.parallelism.cp == 2
    result = run_composer("train", "midtrain", str(RECIPES / "smoke-midtrain.yaml"), "--dry-run", "--set", "parallelism.cp=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "context (CP) │ 2" in result.stdout
