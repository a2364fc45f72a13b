"""Muon and QK-clip: the recipe keys, Megatron's Muon under tensor/expert parallelism, QK-clip on grouped-query and
latent attention, and a Muon + QK-clip mid-training run killed with SIGKILL and resumed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from composer.runtime.run_dir import read_metrics
from tests.conftest import COMPOSER, RECIPES, REPO, run_composer, run_ranks

# --- recipe keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.muon.momentum=0.9"], "optim.muon: Muon settings, but optim.name is adam; set optim.name: muon or remove optim.muon"),
        (
            ["optim.qk_clip=0"],
            "optim.qk_clip: must be > 0: the largest attention logit allowed (e.g. 100); leave it unset for no clipping (got 0)",
        ),
    ],
)
def test_bad_optimizer_settings_are_one_clear_error(overrides, message):
    result = run_composer("recipe", "validate", str(RECIPES / "smoke-midtrain.yaml"), *(a for o in overrides for a in ("--set", o)))
    assert result.returncode == 2
    assert message in result.stdout + result.stderr
    assert "1 problem" in result.stdout + result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "recipe, overrides, path, message",
    [
        ("smoke-midtrain", ["optim.qk_clip=-5"], "optim.qk_clip", "must be > 0"),
        (
            "smoke-midtrain",
            ["optim.name=muon", "optim.muon.nesterow=false"],
            "optim.muon.nesterow",
            "unknown key; did you mean 'nesterov'?",
        ),
        ("smoke-midtrain", ["optim.name=sgd"], "optim.name", "Input should be 'adam' or 'muon'"),
        (
            "smoke-midtrain",
            ["optim.name=muon", "parallelism.distributed_optimizer=true"],
            "parallelism.distributed_optimizer",
            "Megatron-Core 0.16.1's Muon does not shard",
        ),
        ("smoke-midtrain", ["optim.qk_clip=100"], "optim.qk_clip", "model.family qwen3_moe normalises queries and keys (QK-norm)"),
        (
            "smoke-deepseek-v3-midtrain",
            ["optim.qk_clip=100", "model.dtype=bfloat16", "parallelism.distributed_optimizer=true"],
            "optim.qk_clip",
            "the distributed optimizer holds the fp32 master weights in shards",
        ),
    ],
)
def test_optimizer_settings_that_cannot_work_are_refused(recipe, overrides, path, message):
    from composer.recipes.loader import RecipeError, load_recipe

    with pytest.raises(RecipeError) as refused:
        load_recipe(RECIPES / f"{recipe}.yaml", overrides)
    problems = {p.path: p.message for p in refused.value.problems}
    assert list(problems) == [path] and message in problems[path], problems


def test_muon_defaults_fill_in_and_qk_clip_validates_for_mla_and_gqa():
    from composer.recipes.loader import load_recipe

    recipe = load_recipe(RECIPES / "smoke-deepseek-v3-midtrain.yaml", ["optim.name=muon", "optim.qk_clip=100"])
    assert recipe.optim.muon.momentum == 0.95 and recipe.optim.muon.nesterov and recipe.optim.muon.router == "muon"
    dense = [
        "model.family=llama",
        "model.num_experts=0",
        "model.moe_top_k=0",
        "model.moe_ffn_hidden_size=0",
        "model.ffn_hidden_size=256",
        "parallelism.ep=1",
        "optim.qk_clip=100",
    ]
    assert load_recipe(RECIPES / "smoke-midtrain.yaml", dense).optim.qk_clip == 100


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    import json

    from composer.recipes.errors import UserError
    from composer.trainer.checkpointing import Checkpointer

    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / "trainer_state.json").write_text(
        json.dumps({"step": 3, "optimizer": "muon", "layout": {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "cp": 1}})
    )
    (tmp_path / "latest").write_text("step-00000003")
    checkpointer = Checkpointer(tmp_path, keep=2)
    with pytest.raises(UserError, match="trained with optim.name muon, the recipe says adam; switching optimizer on resume is refused"):
        checkpointer.load(checkpointer.latest(), None, SimpleNamespace(name="adam"), {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "cp": 1})


# --- Muon and QK-clip on 2 gloo ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def parallel(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("muon_parallel")
    result = run_ranks(2, "tests.helpers.workers.muon_parallel", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out / "results.pt")


@pytest.mark.engines
def test_muon_updates_the_same_under_tensor_and_expert_parallelism(parallel):
    """Three Muon steps (fused QKV orthogonalized per part, experts, routers; Adam for the rest): tp=2 with
    sequence parallelism and ep=2 give the weights of one rank."""
    runs = parallel["muon"]
    initial, reference = runs["initial"], runs["tp1"]
    for name, weight in reference.items():
        assert (weight - initial[name]).abs().max() > 1e-3, f"{name} did not move"
    for split in ("tp2_sp", "ep2"):
        for name, weight in reference.items():
            assert (runs[split][name] - weight).abs().max().item() <= 1e-5, f"{split}: {name}"


@pytest.mark.engines
def test_the_rl_learner_takes_the_same_muon_steps_under_expert_parallelism(parallel):
    """Policy-gradient steps with Muon: the same losses and weights at ep=2 as with all experts on every rank."""
    run = parallel["rl_learner"]
    assert run["loss_tp1"] == pytest.approx(run["loss_ep2"], abs=1e-7)
    assert run["loss_tp1"][0] != pytest.approx(run["loss_tp1"][-1], abs=1e-4)  # the steps moved the policy
    for name, weight in run["tp1"].items():
        assert (run["ep2"][name] - weight).abs().max().item() <= 1e-5, name


@pytest.mark.engines
@pytest.mark.parametrize("family, group", [("llama", 2), ("deepseek_v3", 1)])
def test_qk_clip_scales_back_the_heads_over_the_threshold_only(parallel, family, group):
    """A threshold between the first layer's largest logits (tp=2): in the next step on the same batch, with the
    optimizer all but frozen, its clipped heads peak at the threshold and the others are as they were (GQA clips
    whole KV groups of 2 heads, MLA each head); later layers see the first one's change."""
    run = parallel[f"qk_clip_{family}"]
    threshold, before, after = run["threshold"], run["maxima_before"], run["maxima_after"]
    first_before, first_after = before[0].view(-1, group), after[0].view(-1, group)
    clipped = first_before.amax(dim=1) > threshold
    assert clipped.any() and not clipped.all(), (threshold, before[0])
    for g in range(len(clipped)):
        if clipped[g]:
            assert abs(first_after[g].max().item() - threshold) <= 1e-4 * threshold, (g, first_after[g], threshold)
            assert (first_after[g] < first_before[g] + 1e-7).all()
        else:
            assert torch.allclose(first_after[g], first_before[g], rtol=1e-5), (g, first_after[g], first_before[g])
    assert after.max() < before.max()


@pytest.mark.engines
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_qk_clip_above_every_logit_changes_nothing_and_logs_the_largest(parallel, family):
    run = parallel[f"qk_clip_{family}"]
    assert run["logged_before"] == pytest.approx(run["maxima_before"].max().item(), rel=1e-6)
    assert run["threshold_above"].keys() == run["unclipped"].keys()
    for name, weight in run["unclipped"].items():
        assert torch.equal(run["threshold_above"][name], weight), name


# --- a Muon + QK-clip mid-training run, killed and resumed -----------------------------------------------

STEPS = 5
SHORT = [
    f"train.steps={STEPS}",
    "train.eval_every=3",
    "train.eval_batches=1",
    "train.checkpoint_every=2",
    "train.global_batch_size=8",
    "optim.warmup_steps=1",
    "data.split=[90,10,0]",
    'data.sources.0.paths=["{stdlib}/email/**/*.py"]',
    "optim.name=muon",
    "optim.lr=0.02",
    "optim.qk_clip=0.3",  # the tiny twin's largest logit grows from 0.29 at initialisation: clipping is at work
]


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("muon_midtrain")
    result = run_composer("model", "init", str(root / "init"), "--recipe", str(RECIPES / "smoke-deepseek-v3-midtrain.yaml"))
    assert result.returncode == 0, result.stderr[-2000:]
    return root


def midtrain_args(root: Path, name: str, *extra: str) -> list[str]:
    return [
        "train",
        "midtrain",
        str(RECIPES / "smoke-deepseek-v3-midtrain.yaml"),
        *sets(
            f"run.dir={root / 'runs'}",
            f"run.name={name}",
            f"model.checkpoint={root / 'init'}",
            f"data.cache_dir={root / 'cache'}",
            *SHORT,
            *extra,
        ),
    ]


def records(run_dir: Path) -> list[dict]:
    return list(read_metrics(run_dir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def reference(workspace) -> Path:
    result = run_composer(*midtrain_args(workspace, "reference"))
    assert result.returncode == 0, result.stderr[-3000:]
    return workspace / "runs" / "reference"


@pytest.mark.engines
def test_the_largest_attention_logit_is_logged_every_step_and_clipped(reference):
    rows = records(reference)[1:]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    logits = [r["max_attention_logit"] for r in rows]
    assert all(value > 0 for value in logits)
    assert max(logits) > 0.3  # the threshold was crossed, so the clipped weights are part of what resumes


@pytest.mark.engines
@pytest.mark.slow
def test_killed_muon_run_resumes_with_the_same_losses(workspace, reference):
    kill_after = random.randint(3, 4)  # past the step-2 checkpoint; sometimes mid-save of step 4
    run_dir = workspace / "runs" / "killed"
    process = subprocess.Popen(
        [*COMPOSER, *midtrain_args(workspace, "killed")],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while not (run_dir / "metrics.jsonl").exists() or max([r["step"] for r in records(run_dir)], default=-1) < kill_after:
            assert process.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert records(run_dir)[-1]["step"] < STEPS
    result = run_composer(*midtrain_args(workspace, "killed"), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed, expected = records(run_dir), records(reference)
    assert [r["step"] for r in resumed] == list(range(STEPS + 1)), f"killed after step {kill_after}"
    for got, want in zip(resumed, expected):
        for key in ("loss", "eval_loss", "grad_norm", "max_attention_logit", "moe_aux_loss"):
            assert (key in got) == (key in want)
            if key in want:
                assert abs(got[key] - want[key]) <= 1e-6, (got["step"], key, got[key], want[key], f"killed after step {kill_after}")


@pytest.mark.engines
def test_resume_with_another_optimizer_is_refused(workspace, reference):
    result = run_composer(*midtrain_args(workspace, "reference", "optim.name=adam", "optim.qk_clip=null"), "--resume")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "optim.name: 'muon' -> 'adam'" in result.stderr
