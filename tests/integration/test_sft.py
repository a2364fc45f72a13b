"""`composer train sft` end to end: real torchrun ranks, real Megatron-Core, the shipped smoke recipe shortened.

One uninterrupted run is the reference: held-out loss falls and it exports; a run killed with SIGKILL at a random
step then resumed must reproduce its every metric (the same conversations in the same order). A packed run (three
conversations a sample) trains three times the tokens a sample, learns and exports.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer.runtime.run_dir import read_metrics
from tests.conftest import COMPOSER, RECIPES, REPO, run_composer
from tests.helpers.sft_demos import write_demonstrations

pytestmark = pytest.mark.engines

STEPS = 12


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    result = run_composer("model", "init", str(root / "init"))
    assert result.returncode == 0, result.stderr[-2000:]
    write_demonstrations(root / "demos" / "openai.jsonl", 30)
    write_demonstrations(root / "demos" / "hf.jsonl", 30, openai=False, start=30)
    return root


def sft_args(root: Path, name: str, *extra: str) -> list[str]:
    pairs = [
        f"run.dir={root / 'runs'}",
        f"run.name={name}",
        f"model.checkpoint={root / 'init'}",
        f"sft.sources=[{{name: demonstrations, paths: [{root / 'demos'}]}}]",
        "env=null",
        "sft.max_length=640",
        f"train.steps={STEPS}",
        "train.eval_every=6",
        "train.eval_batches=1",
        "train.checkpoint_every=4",
        "optim.warmup_steps=2",
        *extra,
    ]
    return ["train", "sft", str(RECIPES / "smoke-sft.yaml"), *(arg for pair in pairs for arg in ("--set", pair))]


def records(run_dir: Path) -> list[dict]:
    return list(read_metrics(run_dir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def reference(workspace) -> Path:
    result = run_composer(*sft_args(workspace, "reference"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sft source demonstrations: 60 conversations" in result.stdout and "54 conversations for training, 6 held out" in result.stdout
    # sft.pack's default, but 640 positions hold one of these ~570-token conversations
    assert "sft samples: 54 of 640 positions in a pass, 1.00 conversations each" in result.stdout
    return workspace / "runs" / "reference"


def test_held_out_loss_falls_and_the_run_exports(reference):
    evals = [r["eval_loss"] for r in records(reference) if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.5
    assert [r["step"] for r in records(reference)] == list(range(STEPS + 1))
    export = reference / "export"
    assert json.loads((export / "config.json").read_text())["num_local_experts"] == 8
    assert (export / "tokenizer.json").is_file() and list(export.glob("model-*.safetensors"))


@pytest.mark.slow  # ~35 s; the default suite keeps packing's unit tests and the per-conversation loss test (test_packing.py)
def test_packed_samples_hold_several_conversations_and_the_run_learns_and_exports(workspace, reference):
    """sft.pack with room for three conversations a sample (max_length 1920, on the same model given 2048 positions):
    the preparation reports the packing, each step trains about three times the tokens a sample of the reference
    (one conversation a sample at 640), held-out loss falls and the run exports."""
    init = workspace / "init-2048"
    if not init.exists():
        shutil.copytree(workspace / "init", init)
        config = json.loads((init / "config.json").read_text())
        (init / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    steps = ["train.steps=6", "train.eval_every=3", "train.checkpoint_every=6", "train.global_batch_size=4", "train.micro_batch_size=2"]
    packed = ["sft.pack=true", "sft.max_length=1920", f"model.checkpoint={init}", "model.max_position_embeddings=2048", *steps]
    result = run_composer(*sft_args(workspace, "packed", *packed))
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(
        r"sft samples: (\d+) of 1920 positions in a pass, ([\d.]+) conversations each, (\d+)% of positions real", result.stdout
    )
    assert line and int(line[1]) == 18 and float(line[2]) == 3.0 and int(line[3]) > 80, result.stdout[-2000:]
    run = workspace / "runs" / "packed"
    per_sample = [r["tokens"] / 4 for r in records(run) if "tokens" in r]
    alone = [r["tokens"] / 8 for r in records(reference) if "tokens" in r]
    assert len(per_sample) == 6 and min(per_sample) > 2.5 * max(alone)
    evals = [r["eval_loss"] for r in records(run) if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.5
    assert (run / "export" / "config.json").is_file() and list((run / "export").glob("model-*.safetensors"))


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_conversations_and_losses(workspace, reference):
    kill_after = random.randint(5, 10)
    run_dir = workspace / "runs" / "killed"
    process = subprocess.Popen(
        [*COMPOSER, *sft_args(workspace, "killed")], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while not (run_dir / "metrics.jsonl").exists() or max([r["step"] for r in records(run_dir)], default=-1) < kill_after:
            assert process.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the whole tree: CLI, torchrun, ranks
        process.wait()
    killed_at = records(run_dir)[-1]["step"]
    assert killed_at < STEPS
    result = run_composer(*sft_args(workspace, "killed"), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed, expected = records(run_dir), records(reference)
    assert [r["step"] for r in resumed] == list(range(STEPS + 1)), f"killed at step {killed_at}"
    for got, want in zip(resumed, expected):
        for key in ("loss", "eval_loss", "lr", "grad_norm", "moe_aux_loss"):
            assert (key in got) == (key in want)
            if key in want:
                assert abs(got[key] - want[key]) <= 1e-6, (got["step"], key, got[key], want[key], f"killed at step {killed_at}")


def test_resume_that_would_change_the_conversations_is_refused(workspace, reference):
    result = run_composer(*sft_args(workspace, "reference", "sft.held_out=0.2"), "--resume")
    assert (
        result.returncode == 2 and "--resume: the recipe changes what the run's checkpoints and data order depend on (sft" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_the_real_scale_sft_recipe_passes_dry_run_and_writes_nothing(tmp_path):
    result = run_composer("train", "sft", str(RECIPES / "qwen3-30b-a3b-sft.yaml"), "--dry-run", "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.replace("│", " ").split())
    assert "launcher ssh, 2 host(s), world size 16" in out and "composer.trainer.sft" in out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("recipe", ["smoke-sft.yaml", "smoke-repo-sft.yaml"])
def test_the_smoke_sft_recipes_pass_dry_run_as_shipped(tmp_path, recipe):
    result = run_composer("train", "sft", str(RECIPES / recipe), "--dry-run", "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "composer.trainer.sft" in result.stdout and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_repo_sft_recipe_trains_on_the_test_made_projects_tasks(workspace):
    """`recipes/smoke-repo-sft.yaml` as shipped but for where the project and the cache are: env build, then a few
    steps of SFT on the reference changes of its training tasks (every one replayed to reward 1.0), exported."""
    project = workspace / "tally"
    made = subprocess.run([sys.executable, "-m", "tests.helpers.user_project", str(project)], cwd=REPO, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    where = [
        "--set",
        f"env.tasks.0.repo.projects.0.path={project}",
        "--set",
        f"env.tasks.0.repo.cache_dir={workspace / 'repo-tasks'}",
    ]
    recipe = str(RECIPES / "smoke-repo-sft.yaml")
    built = run_composer("env", "build", recipe, *where)
    assert built.returncode == 0 and "17 validated" in built.stdout, built.stdout[-2000:] + built.stderr[-2000:]
    steps = ["train.steps=4", "train.eval_every=2", "train.checkpoint_every=4", "optim.warmup_steps=1"]
    result = run_composer(
        "train",
        "sft",
        recipe,
        *where,
        "--set",
        f"run.dir={workspace / 'runs'}",
        "--set",
        f"model.checkpoint={workspace / 'init'}",
        *(arg for pair in steps for arg in ("--set", pair)),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # the 14 training tasks of 17 (3 held out), each reference replayed to reward 1.0 (none skipped)
    assert "sft source repo-references: 14 conversations" in result.stdout
    assert "tasks skipped (no passing reference): 0" in result.stdout
    run = workspace / "runs" / "smoke-repo-sft"
    evals = [r["eval_loss"] for r in records(run) if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0]
    assert (run / "export" / "config.json").is_file()
