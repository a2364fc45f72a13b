"""`composer eval` end to end on CPU (real vLLM, sandbox, sync store): the same figures as an RL run's held-out
evaluation of the same policy, --compare of a checkpoint with itself, kill -9 then a rerun that regrades nothing."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import COMPOSER, RECIPES, REPO

pytestmark = [pytest.mark.engines, pytest.mark.slow, pytest.mark.timeout(1800)]  # an RL run, then evaluations (~10 min on 2 cores)

EVAL_SETTINGS = ["--set", "rl.eval.limit=8", "--set", "rl.eval.samples=2", "--set", "rl.eval.pass_k=[1,2]"]


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    """A one-step RL run of the smoke recipe that evaluates its starting and its final policy (8 held-out tasks)."""
    from composer.recipes.loader import load_recipe
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    root = tmp_path_factory.mktemp("eval")
    checkpoint = init_hf_checkpoint(load_recipe(RECIPES / "smoke-rl.yaml").model, root / "init", tokenizer_bytes=2**20)
    result = subprocess.run(
        [
            *COMPOSER,
            "train",
            "rl",
            str(RECIPES / "smoke-rl.yaml"),
            "--set",
            f"model.checkpoint={checkpoint}",
            "--set",
            f"run.dir={root / 'runs'}",
            "--set",
            "train.steps=1",
            "--set",
            "rl.prompts_per_step=1",
            "--set",
            "rl.group_size=2",
            "--set",
            "train.global_batch_size=2",
            "--set",
            "train.micro_batch_size=2",
            "--set",
            "rollout.sampling.temperature=0.7",
            "--set",
            "cluster.procs_per_host=1",
            "--set",
            "parallelism.ep=1",
            *EVAL_SETTINGS,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, checkpoint, root / "runs" / "smoke-rl"


def without_seconds(record):
    return {k: v for k, v in record.items() if k not in ("step", "time", "eval_seconds")}


def test_a_killed_eval_resumes_and_gives_the_figures_of_the_rl_runs_held_out_evaluations(rl_run, composer):
    """The starting checkpoint (an HF directory) against the run's final policy (the run directory: its newest policy
    from its sync store), in batches of one task, killed with -9 midway: the rerun keeps every graded episode and runs
    only the rest, and each checkpoint's figures and per-task results are those the RL run's held-out evaluation of
    the same policy recorded."""
    root, checkpoint, run = rl_run
    out = root / "start-vs-final"
    args = [*COMPOSER, "eval", str(run / "recipe.yaml"), str(checkpoint), "--compare", str(run), "--out", str(out), "--batch", "1"]
    first = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while len(lines(out / "checkpoint.jsonl")) < 4:
        assert first.poll() is None, first.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    kept = (out / "checkpoint.jsonl").read_text()
    kept = kept[: kept.rfind("\n") + 1]  # a line the kill tore is not a graded episode
    assert not (out / "results.json").exists()

    result = composer(*args[len(COMPOSER) :])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint: {len(kept.splitlines())} of 24 episodes already graded" in result.stdout
    assert (out / "checkpoint.jsonl").read_text().startswith(kept)
    for role in ("checkpoint", "compare"):
        keys = [(e["task"], e["mode"], e["sample"]) for e in lines(out / f"{role}.jsonl")]
        assert len(keys) == len(set(keys)) == 24  # 8 tasks x (1 greedy + 2 sampled), none graded twice

    results = json.loads((out / "results.json").read_text())
    evaluations = {r["step"]: without_seconds(r) for r in lines(run / "eval_metrics.jsonl")}
    for role, step in (("checkpoint", 0), ("compare", 1)):
        assert results["sets"]["smoke"][role]["record"] == evaluations[step]
        assert results["tasks"][role] == json.loads((run / "eval" / f"v{step:06d}.json").read_text())
    start, final = (json.loads((run / "eval" / f"v{step:06d}.json").read_text()) for step in (0, 1))
    difference = results["sets"]["smoke"]["difference"]
    assert difference["gained"] == sorted(t for t in start if start[t]["greedy"] and not final[t]["greedy"])
    assert difference["lost"] == sorted(t for t in start if final[t]["greedy"] and not start[t]["greedy"])
    assert "smoke" in result.stdout and "greedy pass@1" in result.stdout and (out / "report.html").is_file()


def test_compare_with_itself_gives_no_difference(rl_run, composer):
    root, checkpoint, run = rl_run
    result = composer("eval", str(run / "recipe.yaml"), str(checkpoint), "--compare", str(checkpoint), "--out", str(root / "self"))
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((root / "self" / "results.json").read_text())
    difference = results["sets"]["smoke"]["difference"]
    assert difference["greedy_pass@1"] == 0 and difference["greedy_pass@1_interval"] == [0, 0]
    assert difference["sampled_pass@1"] == 0 and difference["gained"] == [] and difference["lost"] == []
    assert results["tasks"]["checkpoint"] == results["tasks"]["compare"]
    assert "+0.000 [+0.000, +0.000]" in result.stdout and "0 / 0" in result.stdout


def test_bad_input_is_one_clear_line(rl_run, composer, tmp_path):
    root, checkpoint, run = rl_run
    cases = [
        ([str(tmp_path / "no-such-checkpoint")], "no-such-checkpoint: no such file or directory"),
        ([f"{run / 'weights'}@v00000009"], "has no version v00000009 (its newest is v00000002)"),
        ([str(checkpoint), "--tasks", "humaneval"], "the recipe has no task set 'humaneval' (its sets: smoke)"),
        ([str(checkpoint), "--compare", str(tmp_path / "gone")], "gone: no such file or directory"),
    ]
    for args, message in cases:
        result = composer("eval", str(run / "recipe.yaml"), *args, "--out", str(tmp_path / "out"))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
