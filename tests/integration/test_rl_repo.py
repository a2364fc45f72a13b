"""RL on repository tasks end to end: `composer env build` then `composer train rl recipes/smoke-repo-rl.yaml` with the
tiny model, its episodes working in networkx views with the tools harness (the reward need not rise)."""

import json

import pytest

from tests.conftest import RECIPES

pytestmark = pytest.mark.engines


def test_rl_on_repository_tasks_runs_end_to_end(tmp_path, composer):
    from composer.recipes.loader import load_recipe
    from composer.rl.trajectories import TrajectoryStore
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    recipe = RECIPES / "smoke-repo-rl.yaml"
    cache = ["--set", f"env.tasks.0.repo.cache_dir={tmp_path / 'repo-tasks'}"]
    built = composer("env", "build", str(recipe), *cache)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    checkpoint = init_hf_checkpoint(load_recipe(recipe).model, tmp_path / "init", tokenizer_bytes=2**20)
    run = tmp_path / "runs" / "smoke-repo-rl"
    result = composer(
        "train",
        "rl",
        str(recipe),
        "--set",
        f"model.checkpoint={checkpoint}",
        "--set",
        f"run.dir={run.parent}",
        "--set",
        f"sync.store={run}/weights",
        *cache,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2]
    groups = [json.loads(line) for line in (run / "rollout_metrics.jsonl").read_text().splitlines()]
    assert groups and all("tool_error_rate" in g and g["infra_failure_rate"] == 0.0 for g in groups)
    store = TrajectoryStore(run / "trajectories")
    trajectories = [t for stage in TrajectoryStore.STAGES for g in store.groups(stage) for t in store.load(g, stage)]
    assert trajectories and all(t.task_id.startswith("repo/networkx/bug/") for t in trajectories)
    for t in trajectories:
        # graded by the project's own tests in the episode's view: every expected test id was reported
        assert t.info["tests_total"] >= 1 and t.info["sandbox_status"] != "infra" and 1 <= t.info["turns"] <= 6
        assert all(len(s.token_ids) <= 2048 for s in t.segments)
