"""`composer train midtrain` end to end: real torchrun ranks, real Megatron-Core, the shipped smoke recipe shortened.

One uninterrupted run is the reference: held-out loss falls, it exports, and a run killed with SIGKILL at a
random step then resumed must reproduce its every metric.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from composer.runtime.run_dir import read_metrics
from tests.conftest import COMPOSER, RECIPES, REPO, run_composer

pytestmark = pytest.mark.engines

STEPS = 12
SHORT = [
    f"train.steps={STEPS}",
    "train.eval_every=6",
    "train.eval_batches=2",
    "train.checkpoint_every=4",
    "train.global_batch_size=8",
    "optim.warmup_steps=2",
    "data.split=[90,10,0]",
    'data.sources.0.paths=["{stdlib}/email/**/*.py"]',
]


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("midtrain")
    result = run_composer("model", "init", str(root / "init"))
    assert result.returncode == 0, result.stderr[-2000:]
    return root


def midtrain_args(root: Path, name: str, *extra: str) -> list[str]:
    return [
        "train",
        "midtrain",
        str(RECIPES / "smoke-midtrain.yaml"),
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
    (workspace / "reference-console.txt").write_text(result.stdout + result.stderr)
    return workspace / "runs" / "reference"


def test_the_console_shows_composer_lines_and_the_logs_keep_the_rest(workspace, reference):
    console = (workspace / "reference-console.txt").read_text().splitlines()
    assert len(console) < 15 and "\x1b" not in "".join(console)  # not a terminal: plain lines, no control codes
    progress = [line for line in console if line.startswith("midtrain step")]
    assert progress and progress[-1].startswith(f"midtrain step {STEPS}/{STEPS}  loss ") and "eta 0:00:00" in progress[-1]
    assert not [line for line in console if "warn" in line.lower() or "megatron" in line.lower()]
    logs = "".join(p.read_text() for p in (reference / "logs").glob("rank-*.log"))
    assert "megatron" in logs.lower()  # what the libraries said is kept


def test_held_out_loss_falls_and_every_step_is_recorded(reference):
    rows = records(reference)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evals) == [0, 6, 12]
    assert evals[12] < evals[0] - 0.5, evals  # from ln(4096) = 8.3 at random init
    for r in rows[1:]:
        assert r["tokens"] == 8 * 256
        assert r["lr"] > 0 or r["step"] == 1  # warmup starts at 0
        for key in ("loss", "grad_norm", "tokens_per_s", "moe_aux_loss", "moe_max_over_mean_l0", "moe_cv_l1", "peak_rss_mb"):
            assert r[key] > 0, (r["step"], key)
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))


def test_run_keeps_the_newest_checkpoints_and_exports_an_hf_checkpoint(reference):
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["latest", "step-00000008", "step-00000012"]
    export = reference / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_local_experts"] == 8
    assert (export / "tokenizer.json").is_file() and list(export.glob("model-*.safetensors"))


def test_export_command_writes_the_newest_checkpoint(reference, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "exported"
    result = run_composer("export", str(reference), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    ours, final = (load_file(next(d.glob("model-*.safetensors"))) for d in (out, reference / "export"))
    assert ours.keys() == final.keys() and all(ours[k].equal(final[k]) for k in ours)


def test_killed_run_resumes_with_the_same_data_and_losses(workspace, reference):
    kill_after = random.randint(5, 10)  # past the step-4 checkpoint; sometimes mid-save of step 8
    run_dir = workspace / "runs" / "killed"
    cmd = [*COMPOSER, *midtrain_args(workspace, "killed")]
    process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not (run_dir / "metrics.jsonl").exists() or max([r["step"] for r in records(run_dir)], default=-1) < kill_after:
            assert process.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the whole tree: CLI, torchrun, ranks
        process.wait()
    killed_at = records(run_dir)[-1]["step"]
    assert killed_at < STEPS
    assert (run_dir / "checkpoints" / "latest").read_text() in ("step-00000004", "step-00000008")
    shown = run_composer("runs", "show", str(run_dir))
    assert shown.returncode == 0 and re.search(r"status +resumable", shown.stdout), shown.stdout
    assert re.search(rf"steps +{killed_at}/{STEPS}", shown.stdout) and re.search(r"checkpoint +step [48]\b", shown.stdout)

    result = run_composer(*midtrain_args(workspace, "killed"), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed, expected = records(run_dir), records(reference)
    assert [r["step"] for r in resumed] == list(range(STEPS + 1)), f"killed at step {killed_at}"
    for got, want in zip(resumed, expected):
        for key in ("loss", "eval_loss", "lr", "grad_norm", "moe_aux_loss", "moe_cv_l0"):
            assert (key in got) == (key in want)
            if key in want:
                assert abs(got[key] - want[key]) <= 1e-6, (got["step"], key, got[key], want[key], f"killed at step {killed_at}")


def test_resume_with_another_expert_parallel_layout_is_refused(workspace, reference):
    before = (reference / "recipe.yaml").read_text()
    result = run_composer(*midtrain_args(workspace, "reference", "parallelism.ep=1"), "--resume")
    assert result.returncode == 2
    assert "cannot resume with another model-parallel layout (ep=2 in the checkpoint, 1 now)" in result.stderr
    assert "Traceback" not in result.stderr
    assert (reference / "recipe.yaml").read_text() == before  # the run's recipe still describes its checkpoints


def test_resume_that_would_change_the_data_order_is_refused(workspace, reference):
    result = run_composer(*midtrain_args(workspace, "reference", "train.steps=20"), "--resume")
    assert result.returncode == 2
    assert "--resume: the recipe changes what the run's checkpoints and data order depend on (train.steps: 12 -> 20)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def corpus(tmp_path) -> Path:
    directory = tmp_path / "corpus"
    directory.mkdir()
    return directory


def bad_input_cases(corpus: Path, workspace: Path) -> dict[str, tuple[list[str], str]]:
    return {
        "empty corpus": (["data.sources.0.paths=[" + json.dumps(str(corpus / "*.py")) + "]"], "hold no text; the corpus would be empty"),
        "unreadable file": (["data.sources.0.paths=[" + json.dumps(str(corpus / "*.py")) + "]"], "missing.py: cannot read"),
        "tokenizer larger than the model": (
            ["model.checkpoint=null", f"data.tokenizer={workspace / 'init'}", "model.vocab_size=1024"],
            "has 4096 tokens but model.vocab_size is 1024",
        ),
    }


@pytest.mark.parametrize("case", ["empty corpus", "unreadable file", "tokenizer larger than the model"])
def test_bad_input_is_one_clear_error_from_the_ranks(workspace, corpus, case):
    (corpus / "empty.py").write_text("\n\n")
    if case == "unreadable file":
        (corpus / "missing.py").symlink_to(corpus / "gone.py")
    overrides, message = bad_input_cases(corpus, workspace)[case]
    result = run_composer(*midtrain_args(workspace, f"bad-{case.replace(' ', '-')}", *overrides))
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_activation_recompute_trains_the_same_model(workspace, reference):
    """train.recompute_activations re-runs every layer's forward in backward: the same losses and gradients."""
    result = run_composer(*midtrain_args(workspace, "recompute", "train.recompute_activations=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    plain, recomputed = records(reference), records(workspace / "runs" / "recompute")
    assert len(plain) == len(recomputed)
    for a, b in zip(plain, recomputed):
        for key in ("loss", "eval_loss", "grad_norm"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5, (a["step"], key, a[key], b[key])


def test_keys_the_loop_cannot_honour_are_refused_before_launch(workspace):
    result = run_composer(*midtrain_args(workspace, "refused", f"sync.store={workspace / 'store'}"))
    assert result.returncode == 2
    assert "sync: train midtrain does not support" in result.stderr and "it does not push weight versions" in result.stderr
    assert not (workspace / "runs" / "refused").exists()


def test_runs_lists_the_finished_the_failed_and_the_killed_then_resumed_runs(workspace, reference):
    result = run_composer("runs", str(workspace / "runs"))
    assert result.returncode == 0, result.stderr
    status = {
        line.split("│")[1].strip().rsplit("/", 1)[-1]: line.split("│")[3].strip()
        for line in result.stdout.splitlines()
        if line.startswith("│")
    }
    assert status["reference"] == "finished"
    if "killed" in status:  # resumed to the end by its test
        assert status["killed"] == "finished"
    failed = [name for name in status if name.startswith("bad-")]
    assert failed and all(status[name] == "failed" for name in failed), status
