"""The learner role of an RL run, one process per rank under torchrun: `python -m rl.learner_main RUN_DIR`.

Per step: take `rl.prompts_per_step` ready groups no staler than `rl.max_staleness` versions (older ones are
dropped and counted), train on them, export and push the new policy through sync, publish it for the
rollout engines. Groups move to `consumed/` only after a checkpoint covers them, so a crash at any point
retrains, never skips, what the checkpoint had not seen.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from recipes.errors import UserError
from recipes.loader import load_recipe
from recipes.processes import die_with_parent
from recipes.runs import MetricsWriter, RunDir, drop_records_after
from recipes.schema import Recipe
from rl.layout import Policy, RLRunFiles, sync_section
from rollout.trajectories import Trajectory, TrajectoryStore, episode_stats
from sync.pusher import push_version
from trainer.launch import record_rank_error, redirect_rank_output
from trainer.rl_learner import LearnerSequence, RLLearner
from trainer.rl_objective import group_advantages

POLL_SECONDS = 0.2
DRIVER_TIMEOUT_SECONDS = 120


def take_groups(store: TrajectoryStore, files: RLRunFiles, step: int, recipe: Recipe) -> tuple[list[str], int]:
    """Rank 0: wait for enough fresh groups; drop the stale ones. Returns (group ids, groups dropped)."""
    need, oldest = recipe.rl.prompts_per_step, step - recipe.rl.max_staleness
    dropped = 0
    versions: dict[str, int] = {}  # each group file is read once, not on every poll
    while True:
        fresh = []
        for group_id in store.ready_groups():
            if group_id not in versions:
                versions[group_id] = store.load(group_id)[0].policy_version
            if versions[group_id] < oldest:
                store.move([group_id], "ready", "dropped")
                dropped += 1
            else:
                fresh.append(group_id)
            if len(fresh) == need:
                return fresh, dropped
        if files.driver_silent_for() > DRIVER_TIMEOUT_SECONDS:
            raise UserError(f"no rollouts: the driver has been silent for over {DRIVER_TIMEOUT_SECONDS} s")
        time.sleep(POLL_SECONDS)


def learner_sequences(groups: list[list[Trajectory]], advantage_mode: str) -> list[LearnerSequence]:
    """Every segment of every trajectory becomes a sequence carrying its episode's group-relative advantage."""
    sequences = []
    for trajectories in groups:
        # An infrastructure failure's reward says nothing about the policy: out of the statistics, advantage 0.
        valid = np.array([not t.info.get("infra_failure", False) for t in trajectories])
        advantages = group_advantages(np.array([t.reward for t in trajectories]), advantage_mode, valid=valid)
        for trajectory, advantage in zip(trajectories, advantages):
            for s in trajectory.segments:
                sequences.append(LearnerSequence(s.token_ids, s.loss_mask, s.logprobs, float(advantage), s.routed_experts))
    return sequences


def rollout_stats(groups: list[list[Trajectory]], step: int, max_context: int) -> dict[str, float]:
    trajectories = [t for g in groups for t in g]
    rewards = np.array([t.reward for t in trajectories])
    staleness = np.array([step - t.policy_version for t in trajectories])
    return {
        "reward_mean": float(rewards.mean()),
        "pass_rate": float((rewards == 1.0).mean()),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        **episode_stats(trajectories, max_context),
    }


def publish(learner: RLLearner, recipe: Recipe, files: RLRunFiles, version: int) -> dict[str, float]:
    """Export the new policy (collective), push it as a delta (rank 0) and point the rollout engines at it."""
    out = files.export / f"policy-{version:06d}"
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    learner.export(out, tokenizer_dir=recipe.model.checkpoint)
    metrics: dict[str, float] = {}
    if dist.get_rank() == 0:
        info = push_version(out, sync_section(recipe, files), recipe.cluster.ssh, cache_dir=files.root / "sync-cache")
        files.publish_policy(Policy(version, info.id))
        for old in files.export.glob("policy-*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
        metrics = {"sync_bytes": info.stored_bytes, "sync_ratio": info.ratio, "sync_seconds": info.seconds,
                   "sync_changed_fraction": info.changed_elements / max(info.total_elements, 1)}
    dist.barrier()
    return metrics


def run_learner(recipe: Recipe, files: RLRunFiles) -> None:
    learner = RLLearner(recipe, files.checkpoints)
    state = learner.resume() or {}
    start = state.get("step", 0)
    store = TrajectoryStore(files.trajectories)
    rank0 = dist.get_rank() == 0
    if rank0:
        # Steps after the checkpoint are lost with the crash: their groups go back to the queue.
        checkpointed = set(state.get("consumed", []))
        trained = store.groups("trained")
        store.move([g for g in trained if g in checkpointed], "trained", "consumed")
        store.move([g for g in trained if g not in checkpointed], "trained", "ready")
        drop_records_after(files.root / "metrics.jsonl", start)  # those steps are trained again
    metrics = MetricsWriter(files.root / "metrics.jsonl") if rank0 else None
    unsaved: list[str] = []
    for step in range(start, recipe.train.steps):
        started = time.monotonic()
        picked = [take_groups(store, files, step, recipe) if rank0 else None]
        dist.broadcast_object_list(picked, src=0)
        group_ids, dropped = picked[0]
        groups = [store.load(g) for g in group_ids]
        waited = time.monotonic() - started
        record = learner.train_step(learner_sequences(groups, recipe.rl.advantage))
        if rank0:
            store.move(group_ids, "ready", "trained")
        record.update(publish(learner, recipe, files, step + 1))
        unsaved += group_ids
        if (step + 1) % recipe.train.checkpoint_every == 0 or step + 1 == recipe.train.steps:
            learner.save(step + 1, {"consumed": unsaved})
            if rank0:
                store.move(unsaved, "trained", "consumed")
            unsaved = []
        if metrics:
            metrics.write(step + 1, **record, **rollout_stats(groups, step, recipe.rollout.max_context), groups=",".join(group_ids),
                          dropped_stale=dropped, wait_seconds=waited, step_seconds=time.monotonic() - started)


def main() -> None:
    die_with_parent()
    files = RLRunFiles(Path(sys.argv[1]))
    run, rank = RunDir(files.root), int(os.environ.get("RANK", "0"))
    redirect_rank_output(run, rank)
    try:
        run_learner(load_recipe(run.recipe_path), files)
    except UserError as e:
        record_rank_error(run, rank, str(e))
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
