"""The RL learner: Megatron recomputes the policy's logprobs (replaying the engine's expert routes) and takes a
truncated-importance-sampled policy-gradient step on a batch of trajectories.

It sees trajectories only as `LearnerBatch`, plain arrays; who produced them is the RL driver's business.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from recipes.schema import Recipe
from trainer.checkpointing import LAYOUT_KEYS, Checkpointer
from trainer.distributed import init_distributed
from trainer.logprobs import pad_micro_batch, token_logprobs
from trainer.model import build_model
from trainer.optimizer import TrainOptimizer, wrap_data_parallel
from trainer.rl_objective import PolicyLossStats, policy_gradient_loss
from trainer.router_replay import replay_for_micro_batch, routing, routing_disagreement
from trainer.weights import export_hf, load_hf_into


@dataclass
class LearnerSequence:
    """One training sequence (a trajectory segment) with its episode's advantage."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    advantage: float
    routes: np.ndarray | None


class RLLearner:
    """One rank of the learner (run under torchrun; every rank constructs it)."""

    def __init__(self, recipe: Recipe, checkpoints: Path):
        self.recipe = recipe
        p = recipe.parallelism
        init_distributed(p, seed=recipe.train.seed)
        self.model = build_model(recipe.model, p, recompute_activations=recipe.train.recompute_activations)
        if recipe.model.checkpoint:
            load_hf_into(self.model, recipe.model, recipe.model.checkpoint)
        self.reference = self._frozen_reference() if recipe.rl.kl_coeff > 0 else None  # before any step or resume
        self.ddp = wrap_data_parallel(self.model, p)
        self.optimizer = TrainOptimizer(self.ddp, recipe.optim, p, recipe.train.steps, getattr(torch, recipe.model.dtype))
        self.checkpointer = Checkpointer(checkpoints, recipe.train.keep_checkpoints)
        self.layout = {k: getattr(p, k) for k in LAYOUT_KEYS}

    def _frozen_reference(self):
        """The starting policy (model.checkpoint, as just loaded), kept for the KL penalty; the same on every resume."""
        reference = build_model(self.recipe.model, self.recipe.parallelism)
        reference.load_state_dict(self.model.state_dict())
        reference.eval()
        for param in reference.parameters():
            param.requires_grad_(False)
        return reference

    def _reference_logprobs(self, tokens: torch.Tensor, replay: list[torch.Tensor] | None) -> torch.Tensor | None:
        if self.reference is None:
            return None
        # The reference replays the engine's routes too: the KL compares the two policies on the same experts.
        with routing(self.reference, replay) if replay is not None else contextlib.nullcontext():
            return token_logprobs(self.reference, tokens, with_grad=False)

    def resume(self) -> dict | None:
        """Restore the newest checkpoint; returns its saved state (None on a fresh start)."""
        latest = self.checkpointer.latest()
        return self.checkpointer.load(latest, self.model, self.optimizer, self.layout) if latest else None

    def save(self, step: int, state: dict) -> None:
        self.checkpointer.save(step, self.model, self.optimizer, {"layout": self.layout, **state})

    def export(self, out_dir: Path, tokenizer_dir: str | None) -> None:
        export_hf(self.model, self.recipe.model, out_dir, tokenizer_dir=tokenizer_dir)

    def train_step(self, sequences: list[LearnerSequence]) -> dict[str, float]:
        """One optimizer step on this data-parallel rank's share of the global batch (collective)."""
        from megatron.core import parallel_state

        started = time.monotonic()
        rl, p = self.recipe.rl, self.recipe.parallelism
        dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        mine = sequences[dp_rank::dp_size]
        # Every rank runs the same number of micro-batches: MoE dispatch is collective inside the forward.
        mbs = self.recipe.train.micro_batch_size
        num_micro = -(-len(sequences) // (dp_size * mbs))
        # Loss = sum over the global batch's trained tokens / their count: segments of one episode add up exactly.
        # Every rank holds the whole batch, so it counts the tokens itself (a sum over the world would count them once per TP rank).
        normaliser = max(sum(float(s.loss_mask[1:].sum()) for s in sequences), 1.0)
        self.ddp.train()
        self.optimizer.zero_grad()
        stats, loss_sum, disagreement = PolicyLossStats(), 0.0, {}
        for i in range(num_micro):
            chunk = mine[i * mbs : (i + 1) * mbs] or [_padding_like(sequences[0])]
            batch = pad_micro_batch([s.tokens for s in chunk], multiple=p.tp if p.sequence_parallel else 1)
            replay = None
            if self.recipe.model.is_moe and rl.router_replay == "r3":
                replay = replay_for_micro_batch(self.ddp, "r3", [s.routes for s in chunk], batch.lengths, batch.seq_len)
            reference = self._reference_logprobs(batch.tokens, replay)
            scope = routing(self.ddp, replay) if replay is not None else contextlib.nullcontext()
            with scope as used:
                logprobs = token_logprobs(self.ddp, batch.tokens)
                rollout, mask = _aligned(chunk, batch.seq_len)
                advantages = torch.tensor([s.advantage for s in chunk], dtype=torch.float32)
                loss, micro_stats = policy_gradient_loss(logprobs, rollout, advantages, mask, rl, normaliser, reference)
                loss.backward()
                if replay is not None and i == 0:
                    # what the learner's own routers would have chosen vs the engine's routes, on this rank's first micro-batch
                    per_layer = routing_disagreement(used.preferred(), used.layers, [s.routes for s in chunk], batch.lengths)
                    disagreement = {f"routing_disagreement_layer{layer}": rate for layer, rate in per_layer.items()}
            stats.add(micro_stats)
            loss_sum += float(loss.detach())
        update = self.optimizer.step()
        totals = _all_reduce_stats(stats, loss_sum)
        return {**totals, **update, **disagreement, "learner_seconds": time.monotonic() - started,
                "trained_tokens_per_s": totals["trained_tokens"] / max(time.monotonic() - started, 1e-9)}


def _padding_like(seq: LearnerSequence) -> LearnerSequence:
    """A micro-batch filler that trains nothing (all-false mask) but runs the collectives."""
    return LearnerSequence(seq.tokens, np.zeros_like(seq.loss_mask), seq.rollout_logprobs, 0.0, seq.routes)


def _aligned(chunk: list[LearnerSequence], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout logprobs and masks shifted to the learner's [B, S-1] (entry t predicts token t+1)."""
    rollout = torch.zeros(len(chunk), seq_len - 1)
    mask = torch.zeros(len(chunk), seq_len - 1, dtype=torch.bool)
    for b, s in enumerate(chunk):
        n = len(s.tokens)
        rollout[b, : n - 1] = torch.from_numpy(np.asarray(s.rollout_logprobs[1:], dtype=np.float32))
        mask[b, : n - 1] = torch.from_numpy(np.asarray(s.loss_mask[1:], dtype=bool))
    return rollout, mask


def _all_reduce_stats(stats: PolicyLossStats, loss_sum: float) -> dict[str, float]:
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    sums = torch.tensor([stats.tokens, stats.abs_logprob_diff, stats.ratio, stats.clipped, stats.kl, loss_sum], dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    peak = torch.tensor([stats.ratio_max], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    tokens, abs_diff, ratio, clipped, kl, loss = sums.tolist()
    total = PolicyLossStats(tokens=tokens, abs_logprob_diff=abs_diff, ratio=ratio, ratio_max=float(peak[0]), clipped=clipped, kl=kl)
    return {"loss": loss, **total.finalize()}
