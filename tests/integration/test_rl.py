"""`composer train rl` end to end on CPU (real vLLM, Megatron, sandbox, sync), killed with -9 and resumed."""

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from composer.runtime.status import run_status
from tests.conftest import COMPOSER, RECIPES, REPO

pytestmark = pytest.mark.engines

STEPS, PROMPTS = 5, 2
TEMPERATURE = 0.7  # not 1: engine and learner must both score the tempered distribution the tokens came from


def start(run_dir, checkpoint, *extra, prefix=(), env=None):
    """`composer train rl` of the smoke recipe, made small; `prefix` runs it under another program (salloc)."""
    args = [
        *prefix,
        *COMPOSER,
        "train",
        "rl",
        str(RECIPES / "smoke-rl.yaml"),
        "--set",
        f"model.checkpoint={checkpoint}",
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"sync.store={run_dir}/weights",
        "--set",
        f"train.steps={STEPS}",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        f"rl.prompts_per_step={PROMPTS}",
        "--set",
        "rl.group_size=4",
        "--set",
        "train.global_batch_size=8",
        "--set",
        "rl.kl_coeff=0.05",
        "--set",
        f"rollout.sampling.temperature={TEMPERATURE}",
        *extra,
    ]
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def metrics(run):
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    from composer.recipes.loader import load_recipe
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    root = tmp_path_factory.mktemp("rl")
    checkpoint = init_hf_checkpoint(load_recipe(RECIPES / "smoke-rl.yaml").model, root / "init", tokenizer_bytes=2**20)
    run = root / "runs" / "smoke-rl"
    # The first run rolls out on a fleet of two vLLM servers, so the kill catches groups in flight on both
    # (without held-out evaluation, which would keep one server busy; the resumed run evaluates).
    first = start(
        root / "runs", checkpoint, "--set", "rollout.engine=server", "--set", "rollout.engines_per_host=2", "--set", "rl.eval=null"
    )
    deadline = time.monotonic() + 600
    while len(metrics(run)) < 3:  # step 3 is trained but no checkpoint covers it yet
        assert first.poll() is None, first.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed_status = run_status(run).status
    fleet_groups = [json.loads(line) for line in (run / "rollout_metrics.jsonl").read_text().splitlines()]
    deadline = time.monotonic() + 60
    while (servers := processes_mentioning(run)) and time.monotonic() < deadline:
        time.sleep(0.5)
    resumed = start(root / "runs", checkpoint, "--resume")
    output, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, output[-3000:]
    return SimpleNamespace(run=run, fleet_groups=fleet_groups, servers_left=servers, killed_status=killed_status, console=output)


def processes_mentioning(path) -> list[str]:
    found = subprocess.run(["pgrep", "-af", str(path)], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def test_fleet_servers_share_the_work_and_die_with_the_driver(killed_and_resumed):
    engines = Counter(g["engine"] for g in killed_and_resumed.fleet_groups)
    assert set(engines) == {0, 1}  # both servers made groups
    assert killed_and_resumed.servers_left == []  # kill -9 of the driver stopped its vLLM servers


def test_no_trajectory_lost_or_duplicated(killed_and_resumed):
    assert_each_group_trained_once(killed_and_resumed.run, STEPS, PROMPTS)


def assert_each_group_trained_once(run, steps: int, prompts: int) -> None:
    """After a run that was killed somewhere: every group is in one stage, none skipped, every step trained once on
    groups no other step used."""
    stages = {
        stage: sorted(p.stem for p in (run / "trajectories" / stage).glob("*.traj"))
        for stage in ("ready", "trained", "consumed", "dropped")
    }
    every = [g for groups in stages.values() for g in groups]
    assert len(every) == len(set(every))  # each group is in exactly one stage
    indices = sorted(int(g[1:]) for g in every)
    assert indices == list(range(len(indices)))  # in-flight groups at the kill were made again, none skipped
    assert stages["trained"] == []
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # steps lost with the kill were trained again
    trained_last = {r["step"]: r["groups"].split(",") for r in records}
    used = Counter(g for groups in trained_last.values() for g in groups)
    assert set(used) == set(stages["consumed"]) and set(used.values()) == {1}
    assert len(used) == steps * prompts


def test_first_step_learner_matches_engine(killed_and_resumed):
    """At temperature 0.7: step 1 on the server fleet, and every later step with on-policy groups."""
    records = metrics(killed_and_resumed.run)
    first = records[0]
    assert first["step"] == 1 and first["staleness_max"] == 0
    assert first["logprob_abs_diff"] < 1e-5  # same weights, fp32: only numerical noise
    assert abs(first["prob_ratio_max"] - 1) < 1e-4
    on_policy = [r["on_policy_prob_ratio_error"] for r in records if "on_policy_prob_ratio_error" in r]
    assert on_policy and max(on_policy) < 1e-4


def test_kl_is_measured_against_the_starting_policy_across_the_resume(killed_and_resumed):
    kl = [r["kl_ref"] for r in metrics(killed_and_resumed.run)]
    assert kl[0] < 1e-9  # step 1 trains the starting weights themselves
    assert all(value > 0 for value in kl[1:])  # later policies moved away from the reference, resumed steps too


def test_policies_flow_through_sync(killed_and_resumed):
    run = killed_and_resumed.run
    policy = json.loads((run / "policy.json").read_text())
    assert policy["version"] == STEPS
    last = metrics(run)[-1]
    assert last["sync_bytes"] > 0 and last["staleness_max"] <= 1
    versions = [json.loads(line)["policy_version"] for line in (run / "rollout_metrics.jsonl").read_text().splitlines()]
    assert max(versions) >= 2  # rollouts followed the learner's pushed policies


def test_a_learner_that_cannot_start_here_is_refused_before_the_run_starts(composer, tmp_path):
    result = composer("train", "rl", str(RECIPES / "kimi-k2-rl.yaml"), "--set", f"run.dir={tmp_path}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cluster.launcher is slurm but this is not inside a SLURM allocation" in result.stderr
    assert not (tmp_path / "kimi-k2-rl").exists()


def test_resume_refuses_a_recipe_that_changes_what_the_run_depends_on(killed_and_resumed, composer):
    run = killed_and_resumed.run
    saved = (run / "recipe.yaml").read_text()
    result = composer(
        "train",
        "rl",
        str(RECIPES / "smoke-rl.yaml"),
        "--resume",
        "--set",
        f"run.dir={run.parent}",
        "--set",
        "model.checkpoint=unused",
        "--set",
        "rl.group_size=2",
        "--set",
        "rollout.engine=server",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "rl.group_size: 4 -> 2" in result.stderr and "rollout.engine" not in result.stderr  # engines may change
    assert f"rollout.sampling.temperature: {TEMPERATURE} -> 1.0" in result.stderr  # stored groups were sampled at 0.7
    assert (run / "recipe.yaml").read_text() == saved


def tree_state(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file())


def test_replay_trains_the_recorded_groups_again_without_engines(killed_and_resumed, composer):
    """`--replay RUN` re-runs the learner on RUN's stored trajectories, step by step as RUN took them: on CPU the
    losses come out the same, no engine starts, and the recorded run is left untouched."""
    run = killed_and_resumed.run
    before = tree_state(run)
    result = composer("train", "rl", str(run / "recipe.yaml"), "--replay", str(run), "--set", "run.name=replay")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    replayed = metrics(run.parent / "replay")
    recorded = metrics(run)
    assert [r["groups"] for r in replayed] == [r["groups"] for r in recorded]
    for mine, theirs in zip(replayed, recorded):
        assert abs(mine["loss"] - theirs["loss"]) < 1e-6 and abs(mine["kl_ref"] - theirs["kl_ref"]) < 1e-6
    assert not (run.parent / "replay" / "rollout_metrics.jsonl").exists()  # no engine ran
    assert tree_state(run) == before  # nothing read from the recorded run was moved, and no policy went to its store
    again = composer(
        "train", "rl", str(run / "recipe.yaml"), "--replay", str(run), "--set", "run.name=replay2", "--set", f"train.steps={STEPS + 1}"
    )
    assert again.returncode == 2 and "recorded 5 learner steps" in again.stderr and "Traceback" not in again.stderr


def test_replay_with_context_parallelism_repeats_the_recorded_losses(killed_and_resumed, composer):
    """The learner at cp=2 x dp=2 on 4 ranks (each sequence split over a pair of ranks, ring attention, router replay
    of each rank's share) trains RUN's groups to the per-step losses of RUN's 2 data-parallel ranks."""
    run = killed_and_resumed.run
    result = composer(
        "train",
        "rl",
        str(run / "recipe.yaml"),
        "--replay",
        str(run),
        "--set",
        "run.name=replay-cp2",
        "--set",
        "parallelism.cp=2",
        "--set",
        "cluster.procs_per_host=4",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    replayed, recorded = metrics(run.parent / "replay-cp2"), metrics(run)
    assert len(replayed) == len(recorded) == STEPS
    for mine, theirs in zip(replayed, recorded):
        for key in ("loss", "kl_ref", "grad_norm"):
            assert abs(mine[key] - theirs[key]) <= 1e-5 * max(1.0, abs(theirs[key])), (mine["step"], key, mine[key], theirs[key])


def test_the_console_shows_progress_and_the_engine_logs_stay_in_files(killed_and_resumed):
    """Off a terminal the driver prints plain progress lines; vLLM, torch and the ranks write to logs/ only."""
    run, console = killed_and_resumed.run, killed_and_resumed.console.splitlines()
    assert len(console) < 20 and "\x1b" not in killed_and_resumed.console, console
    steps = [line for line in console if line.startswith("rl step ")]
    assert steps and steps[-1].startswith(f"rl step {STEPS}/{STEPS}  eta 0:00:00  reward "), console
    assert "last sync v5 ratio" in steps[-1] and "alarms" in steps[-1]
    assert not [line for line in console if "INFO" in line or "WARNING" in line or "vllm" in line.lower()], console
    driver_log = (run / "logs" / "driver.log").read_text()
    assert "vLLM" in driver_log or "vllm" in driver_log  # the embedded engine of the resumed run logged there
    for log in (run / "logs").glob("*.log"):  # the known-harmless reload warning at most once per process
        assert log.read_text().count("Following weights were not loaded from checkpoint") <= 1, log


def test_runs_shows_the_killed_run_resumable_and_the_resumed_one_finished(killed_and_resumed, composer):
    assert killed_and_resumed.killed_status == "resumable"
    shown = composer("runs", "show", str(killed_and_resumed.run))
    assert shown.returncode == 0 and re.search(r"status +finished", shown.stdout), shown.stdout
    assert re.search(rf"steps +{STEPS}/{STEPS}", shown.stdout) and "reward_mean" in shown.stdout
    assert list((killed_and_resumed.run / "tensorboard").glob("events.out.tfevents.*"))


def test_a_failed_run_says_why_and_is_listed_failed(tmp_path, composer):
    result = composer(
        "train",
        "rl",
        str(RECIPES / "smoke-rl.yaml"),
        "--set",
        f"run.dir={tmp_path}",
        "--set",
        f"model.checkpoint={tmp_path / 'no-such-checkpoint'}",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    status = run_status(tmp_path / "smoke-rl")
    assert status.status == "failed" and "no-such-checkpoint" in status.reason


def test_held_out_evaluation_at_the_start_and_the_end_on_tasks_never_trained(killed_and_resumed):
    from composer.rl.trajectories import TrajectoryStore

    run = killed_and_resumed.run
    records = [json.loads(line) for line in (run / "eval_metrics.jsonl").read_text().splitlines()]
    resumed_at = records[0]["step"]  # the policy the resumed driver started with (the first run did not evaluate)
    assert 0 < resumed_at < STEPS and [r["step"] for r in records] == [resumed_at, STEPS]
    for r in records:
        assert r["eval_smoke_tasks"] == 20 and 0 <= r["eval_smoke_greedy_pass@1"] <= 1 and r["eval_seconds"] > 0
        assert r["eval_smoke_greedy_pass@1_low"] <= r["eval_smoke_greedy_pass@1"] <= r["eval_smoke_greedy_pass@1_high"]
        assert r["eval_smoke_pass@1"] <= r["eval_smoke_pass@4"]
    held_out = set(json.loads((run / "eval" / f"v{STEPS:06d}.json").read_text()))
    store = TrajectoryStore(run / "trajectories")
    trained = {t.task_id for g in store.known_groups() for t in store.load(g, store.stage_of(g))}
    assert len(held_out) == 20 and trained and not held_out & trained
