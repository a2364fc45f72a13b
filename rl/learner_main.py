"""The learner role of an RL run, one process per rank under torchrun: `python -m composer.rl.learner_main RUN_DIR`.

Each step: take `rl.prompts_per_step` groups (rl.protocol: fresh ones from the rollouts, or a recorded run's on
replay; rank 0 takes them, the other ranks read which in the run directory) -> train on them -> publish the new
policy through sync -> save a checkpoint when due -> log. What a crash at any point leaves behind is repaired on
resume by the protocol.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from composer.cluster.placement import bind_this_rank
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.recipes.schema import Recipe, RLSection
from composer.rl.protocol import LearnerQueue, Policy, ReplayQueue, RLRunFiles, StepGroups, learner_queue, sync_section
from composer.rl.trajectories import episode_stats
from composer.rollout.agent.trajectory import Trajectory
from composer.runtime.processes import die_with_parent
from composer.runtime.progress import Trackers
from composer.runtime.run_dir import MetricsWriter, RunDir, drop_records_after
from composer.sync.pusher import TensorPusher, push_version
from composer.trainer.core import Every
from composer.trainer.launch import record_rank_error, redirect_rank_output
from composer.trainer.rl_learner import LearnerSequence, RLLearner
from composer.trainer.rl_objective import group_advantages, has_signal

MODULE = __spec__.name
"""This entry point, as `python -m` names it (the driver starts it under torchrun)."""


def learner_sequences(groups: list[list[Trajectory]], rl: RLSection, step: int) -> list[LearnerSequence]:
    """Every segment of every trajectory becomes a sequence carrying its episode's group-relative advantage (plus,
    with `rl.summary_reward`, the shaped term on its summary's tokens: `summary_bonuses`).
    With `rl.skip_uniform_groups`, groups without signal are left out, unless no group has any: then they
    stay (zero advantages, no gradient) so the optimizer still steps and its state stays whole for checkpoints."""
    sequences = []
    # An infrastructure failure's reward says nothing about the policy: out of the statistics, advantage 0.
    valid = [np.array([not t.info.get("infra_failure", False) for t in g]) for g in groups]
    bonuses = [summary_bonuses(g, ok, rl.summary_reward) for g, ok in zip(groups, valid)]
    informative = [
        has_signal(np.array([t.reward for t in g])[ok]) or any(b is not None for per_t in bonus for b in per_t)
        for g, ok, bonus in zip(groups, valid, bonuses)
    ]
    for trajectories, ok, signal, bonus in zip(groups, valid, informative, bonuses):
        rewards = np.array([t.reward for t in trajectories])
        if rl.skip_uniform_groups and not signal and any(informative):
            continue
        advantages = group_advantages(rewards, rl.advantage, valid=ok)
        for trajectory, advantage, per_segment in zip(trajectories, advantages, bonus):
            for s, extra in zip(trajectory.segments, per_segment):
                sequences.append(
                    LearnerSequence(
                        s.token_ids,
                        s.loss_mask,
                        s.logprobs,
                        float(advantage),
                        s.routed_experts,
                        episode=trajectory.id,
                        on_policy=trajectory.policy_version == step,
                        bonus=extra,
                    )
                )
    return sequences


def summary_bonuses(group: list[Trajectory], valid: np.ndarray, weight: float) -> list[list[np.ndarray | None]]:
    """Per trajectory and segment, the shaped summary term added to each token's advantage, or None.

    Segment i of a summarized episode ends with its summary i (`summary_tokens[i]` tokens). A summary's term is
    `weight` x (the share of the facts still needed that it kept - the mean of that share over the group's
    summaries): centred like the advantages, so summaries are pushed apart only where they differ, and nothing at
    all when every summary of the group kept as much."""
    kept = [t.info.get("summary_kept", []) if ok else [] for t, ok in zip(group, valid)]
    known = [k for per_t in kept for k in per_t if k is not None]
    out: list[list[np.ndarray | None]] = [[None] * len(t.segments) for t in group]
    if weight <= 0 or len(set(known)) < 2:
        return out
    mean = sum(known) / len(known)
    for t, (trajectory, shares) in enumerate(zip(group, kept)):
        for i, share in enumerate(shares):
            if share is None:
                continue
            segment, length = trajectory.segments[i], trajectory.info["summary_tokens"][i]
            extra = np.zeros(len(segment.token_ids), dtype=np.float32)
            extra[len(extra) - length :] = weight * (share - mean)
            out[t][i] = extra
    return out


def rollout_stats(groups: list[list[Trajectory]], step: int, max_context: int) -> dict[str, float]:
    trajectories = [t for g in groups for t in g]
    rewards = np.array([t.reward for t in trajectories])
    staleness = np.array([step - t.policy_version for t in trajectories])
    response = np.array([sum(int(s.loss_mask.sum()) for s in t.segments) for t in trajectories])
    return {
        "reward_mean": float(rewards.mean()),
        "pass_rate": float((rewards == 1.0).mean()),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "response_tokens_mean": float(response.mean()),
        "response_tokens_max": float(response.max()),
        "uniform_group_fraction": float(np.mean([not has_signal([t.reward for t in g]) for g in groups])),
        **episode_stats(trajectories, max_context),
    }


def health_alarms(record: dict[str, float], rl: RLSection) -> dict[str, float]:
    """Alarm metrics (1 = raised) for train/inference mismatch on the step's on-policy tokens."""
    return {
        "alarm_ratio_error": float(record.get("on_policy_prob_ratio_error", 0.0) > rl.alarm_ratio_error),
        "alarm_logprob_diff": float(record.get("on_policy_logprob_abs_diff", 0.0) > rl.alarm_logprob_diff),
    }


def alarm_message(step: int, record: dict[str, float], rl: RLSection) -> str | None:
    raised = []
    if record["alarm_ratio_error"]:
        raised.append(f"|prob ratio - 1| = {record['on_policy_prob_ratio_error']:.4f} > rl.alarm_ratio_error={rl.alarm_ratio_error}")
    if record["alarm_logprob_diff"]:
        raised.append(f"|dlogprob| = {record['on_policy_logprob_abs_diff']:.4f} > rl.alarm_logprob_diff={rl.alarm_logprob_diff}")
    if not raised:
        return None
    return f"ALARM step {step}: learner and engine disagree on on-policy tokens: {'; '.join(raised)} (see README, RL health metrics)"


def publish(learner: RLLearner, recipe: Recipe, files: RLRunFiles, version: int, pusher: TensorPusher | None) -> dict[str, float]:
    """Export the new policy (collective), push it as a delta (rank 0) and point the rollout engines at it. With a
    `pusher` (rank 0, `sync.push_from: memory`) the policy stays in memory and only its small files are written."""
    started = time.monotonic()
    out = files.export / f"policy-{version:06d}"
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    # In the engines' format, not the fp32 master weights': consecutive bf16 (or fp8, INT4) policies share most of
    # their values, so the sync delta is sparse, and the engines get exactly the weights they compute with.
    rollout = recipe.rollout
    dtype = None if rollout.quantize else getattr(torch, rollout.dtype)
    sync = sync_section(recipe, files)
    in_memory = sync.push_from == "memory"
    if in_memory:
        policy = learner.core.export_tensors(out, tokenizer_dir=recipe.model.checkpoint, quantize=rollout.quantize, dtype=dtype)
    else:
        learner.core.export(out, tokenizer_dir=recipe.model.checkpoint, quantize=rollout.quantize, dtype=dtype)
    metrics: dict[str, float] = {}
    if dist.get_rank() == 0:
        if in_memory:
            info = pusher.push(policy.tensors, policy.files, out)
        else:
            info = push_version(out, sync, recipe.cluster.ssh, cache_dir=files.root / "sync-cache")
        files.publish_policy(Policy(version, info.id))
        for old in files.export.glob("policy-*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
        metrics = {
            "sync_bytes": info.stored_bytes,
            # a version that changed no byte stores nothing: no ratio (full size over 1 byte would plot as billions)
            **({"sync_ratio": info.ratio} if info.stored_bytes else {}),
            "sync_seconds": info.seconds,
            "sync_changed_fraction": info.changed_elements / max(info.total_elements, 1),
            "publish_seconds": time.monotonic() - started,
        }
    dist.barrier()
    return metrics


def take(queue: LearnerQueue | ReplayQueue, step_groups: StepGroups, step: int) -> tuple[list[str], int]:
    """Rank 0 takes the step's groups and records them; every rank gets their ids (and how many stale ones were
    dropped). No rank waits inside a collective: rollouts may take longer than a collective's timeout."""
    if dist.get_rank() != 0:
        return step_groups.wait(step)
    picked = queue.take(step)
    step_groups.record(step, *picked)
    return picked


def run_learner(recipe: Recipe, files: RLRunFiles) -> None:
    learner = RLLearner(
        recipe.model, recipe.parallelism, recipe.optim, recipe.train, recipe.rl, files.checkpoints, recipe.rollout.sampling.temperature
    )
    state = learner.core.resume() or {}
    start = state.get("step", 0)
    queue, step_groups = learner_queue(files, recipe.rl), StepGroups(files)
    rank0 = dist.get_rank() == 0
    if rank0:
        queue.repair(state.get("consumed", []))
        step_groups.clear()
        drop_records_after(files.root / "metrics.jsonl", start)  # those steps are trained again
    dist.barrier()  # no rank may read step groups recorded before a crash
    metrics = MetricsWriter(files.root / "metrics.jsonl") if rank0 else None
    board = Trackers(files.root, recipe.run.name, start) if rank0 else None
    save_due = Every(recipe.train.checkpoint_every, recipe.train.steps)
    # holds the policy it pushed last, the next push's base; a restarted learner reads that one from the store once
    sync = sync_section(recipe, files)
    pusher = TensorPusher(sync, recipe.cluster.ssh, cache_dir=files.root / "sync-cache") if rank0 and sync.push_from == "memory" else None
    unsaved: list[str] = []
    for step in range(start, recipe.train.steps):
        started = time.monotonic()
        group_ids, dropped = take(queue, step_groups, step)
        groups = queue.load(group_ids)
        waited = time.monotonic() - started
        record = learner.train_step(learner_sequences(groups, recipe.rl, step))
        record.update(health_alarms(record, recipe.rl))
        record.update(publish(learner, recipe, files, step + 1, pusher))
        if rank0:
            queue.trained(group_ids)
        unsaved += group_ids
        if save_due(step + 1):
            learner.core.save(step + 1, {"consumed": unsaved})
            if rank0:
                queue.consumed(unsaved)
            unsaved = []
        if metrics:
            record.update(
                rollout_stats(groups, step, recipe.rollout.max_context),
                dropped_stale=dropped,
                wait_seconds=waited,
                step_seconds=time.monotonic() - started,
            )
            if alarm := alarm_message(step + 1, record, recipe.rl):
                print(alarm, file=sys.stderr, flush=True)
            metrics.write(step + 1, **record, groups=",".join(group_ids))
            board.write(step + 1, record)


def main() -> None:
    die_with_parent(forks_too=True)
    bind_this_rank()  # off the engines' cores, where the driver planned it (cluster.placement)
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
