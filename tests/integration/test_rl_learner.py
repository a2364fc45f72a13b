"""The RL learner's ranks (2 gloo processes, the tiny MoE, no engines) fed by a producer in the test process."""

import threading
import time

import numpy as np
import pytest

from composer.recipes.loader import load_recipe, recipe_to_yaml
from composer.rl.protocol import Heartbeat, Policy, RLRunFiles, RolloutQueue, StalenessRule, group_id, sync_section
from composer.rollout.agent.trajectory import Segment, Trajectory
from composer.runtime.run_dir import RunDir, read_metrics
from tests.conftest import RECIPES, run_ranks

pytestmark = pytest.mark.engines

RANKS = 2
COLLECTIVE_TIMEOUT_SECONDS = 10
"""The learner's process group gives up on a collective after this (30 minutes by default on gloo)."""
ROLLOUT_SECONDS = 1.5 * COLLECTIVE_TIMEOUT_SECONDS
"""How long the producer takes for the step's groups, counted from when every rank waits for them."""


def group(index: int, version: int, size: int, layers: int, top_k: int, experts: int) -> list[Trajectory]:
    rng = np.random.default_rng(index)
    trajectories = []
    for i in range(size):
        tokens = rng.integers(1, 4096, 12)
        generated = np.arange(12) >= 6
        routes = np.argsort(rng.random((11, layers, experts)), axis=-1)[..., :top_k]  # top_k distinct experts a token
        segment = Segment(tokens, generated, np.where(generated, -1.5, 0.0), routes)
        trajectories.append(
            Trajectory(
                f"{group_id(index)}-{i}",
                group_id(index),
                "smoke/1",
                version,
                float(i % 2),
                [segment],
                {"summaries": 0, "summary_tokens": []},
            )
        )
    return trajectories


@pytest.mark.slow  # waits out a collective timeout on purpose (about 30 s)
def test_a_step_whose_rollouts_outlast_the_collective_timeout_is_trained(tmp_path):
    """Long episodes make slow steps normal: no rank may wait for rollouts inside a collective, which would end
    the run when its timeout passes ("Timed out waiting ...ms for recv")."""
    from composer.sync.pusher import push_version
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    overrides = [
        f"run.dir={tmp_path / 'runs'}",
        "train.steps=1",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "rl.eval=null",
    ]
    model = load_recipe(RECIPES / "smoke-rl.yaml", overrides).model
    checkpoint = init_hf_checkpoint(model, tmp_path / "init", tokenizer_bytes=2**18)
    recipe = load_recipe(RECIPES / "smoke-rl.yaml", [*overrides, f"model.checkpoint={checkpoint}"])
    run = RunDir.of(recipe)
    run.prepare(recipe_to_yaml(recipe), resume=False)
    files = RLRunFiles(run.root)
    info = push_version(checkpoint, sync_section(recipe, files), recipe.cluster.ssh, cache_dir=files.root / "sync-cache")
    files.publish_policy(Policy(0, info.id))
    producer = RolloutQueue(files, StalenessRule.of(recipe.rl))
    m, rl = recipe.model, recipe.rl

    def slow_rollouts():
        while len(list(run.root.glob("rank-*.waiting"))) < RANKS:
            time.sleep(0.2)
        time.sleep(ROLLOUT_SECONDS)
        for _ in range(rl.prompts_per_step):
            index = producer.claim(0)
            producer.put(index, group(index, 0, rl.group_size, m.num_layers, m.moe_top_k, m.num_experts))

    with Heartbeat(files.heartbeat):
        rollouts = threading.Thread(target=slow_rollouts, daemon=True)
        rollouts.start()
        result = run_ranks(RANKS, "tests.helpers.workers.rl_learner", str(run.root), str(COLLECTIVE_TIMEOUT_SECONDS), timeout=600)
        rollouts.join(timeout=5)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = read_metrics(run.metrics_path)
    assert record["step"] == 1 and record["groups"] == "g0000000,g0000001"
    assert record["wait_seconds"] > COLLECTIVE_TIMEOUT_SECONDS  # the premise: the step waited longer than a collective may
