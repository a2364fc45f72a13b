"""The RL learner: Megatron recomputes the policy's logprobs (replaying the engine's expert routes) and takes a
truncated-importance-sampled policy-gradient step on a batch of trajectories.

It sees trajectories only as `LearnerSequence`s, plain arrays; who produced them is the RL driver's business.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from composer.recipes.schema import ModelSection, OptimSection, ParallelismSection, RLSection, TrainSection
from composer.trainer.core import TrainerCore
from composer.trainer.logprobs import layout_for, sequence_logprobs
from composer.trainer.packing import SequenceLayout
from composer.trainer.rl_objective import PolicyLossStats, policy_gradient_loss
from composer.trainer.router_replay import replay_for_micro_batch, routing, routing_disagreement


@dataclass
class LearnerSequence:
    """One training sequence (a trajectory segment) with its episode's advantage."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    advantage: float
    routes: np.ndarray | None
    episode: str = ""
    """The episode it is a segment of (sequence-mean aggregation weighs episodes, not segments, equally)."""
    on_policy: bool = False
    """Made by the weights this step trains (no policy change since): the train/inference mismatch metrics."""
    bonus: np.ndarray | None = None
    """float [T], added to `advantage` per token (the shaped summary term on a summary's tokens); none when unset."""


class RLLearner:
    """One rank of the learner (run under torchrun; every rank constructs it): the trainer core, plus the frozen
    starting policy when the objective has a KL term.

    `temperature` is the one the trajectories were sampled at (`rollout.sampling.temperature`): the policy, the
    reference and so the importance ratio, KL and entropy are all taken of softmax(logits / temperature), the
    distribution the engine sampled from and reports logprobs of. At temperature 0 (greedy) the engine reports
    the untempered distribution, so the learner scores at 1.
    """

    def __init__(
        self,
        model: ModelSection,
        parallelism: ParallelismSection,
        optim: OptimSection,
        train: TrainSection,
        rl: RLSection,
        checkpoints: Path,
        temperature: float = 1.0,
    ):
        self.rl, self.parallelism, self.micro_batch_size = rl, parallelism, train.micro_batch_size
        self.temperature = temperature if temperature > 0 else 1.0
        self.core = TrainerCore(model, parallelism, optim, train, checkpoints)
        self.replays_routes = model.is_moe and rl.router_replay == "r3"
        # before any step or resume: the reference is the starting policy, the same on every resume
        self.reference = self.core.frozen_copy() if rl.kl_coeff > 0 else None

    def _reference_logprobs(
        self, layout: SequenceLayout, tokens: list[np.ndarray], replay: list[torch.Tensor] | None
    ) -> torch.Tensor | None:
        if self.reference is None:
            return None
        # The reference replays the engine's routes too: the KL compares the two policies on the same experts.
        with routing(self.reference, replay) if replay is not None else contextlib.nullcontext():
            return sequence_logprobs(self.reference, layout, tokens, with_grad=False, temperature=self.temperature)

    def train_step(self, sequences: list[LearnerSequence]) -> dict[str, float]:
        """One optimizer step on this data-parallel rank's share of the global batch (collective)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        started = time.monotonic()
        rl, ddp = self.rl, self.core.ddp
        dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        # Megatron's DDP averages gradients over the dp x cp ranks, but each rank's loss is already its part of the
        # whole step's loss (normalised over the step's batch; under cp every rank of a group computes the same
        # loss, its backward reaching the weights through its own tokens): scaled back, the gradient is the batch's
        # whatever the layout.
        cp = parallel_state.get_context_parallel_world_size()
        loss_scale = dp_size * cp
        mine = sequences[dp_rank::dp_size]
        # Every rank runs the same number of micro-batches: MoE dispatch is collective inside the forward.
        mbs = self.micro_batch_size
        num_micro = -(-len(sequences) // (dp_size * mbs))
        # The routers' load-balancing loss: its mean over the step's micro-batches, whatever the layout (under cp each
        # rank holds its part of it, and DDP averages over dp x cp).
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(cp / num_micro))
        # Every rank holds the whole batch, so it computes the normalisers itself (a sum over the world would count
        # tokens once per TP rank). Both keep the segments of one episode adding up exactly.
        normalisers = sequence_normalisers(sequences, rl.loss_aggregation)
        ddp.train()
        self.core.optimizer.zero_grad()
        stats, loss_sum, disagreement = PolicyLossStats(), 0.0, {}
        mine_norms = normalisers[dp_rank::dp_size]
        for i in range(num_micro):
            chunk = mine[i * mbs : (i + 1) * mbs] or [_padding_like(sequences[0])]
            norms = torch.tensor(mine_norms[i * mbs : (i + 1) * mbs] or [1.0], dtype=torch.float32)
            tokens = [s.tokens for s in chunk]
            layout = layout_for(ddp, [len(t) for t in tokens], packed=rl.pack_sequences)
            replay = None
            if self.replays_routes:
                replay = replay_for_micro_batch(ddp, "r3", [s.routes for s in chunk], layout)
            reference = self._reference_logprobs(layout, tokens, replay)
            scope = routing(ddp, replay) if replay is not None else contextlib.nullcontext()
            with scope as used:
                logprobs = sequence_logprobs(ddp, layout, tokens, temperature=self.temperature)
                rollout, mask, advantages = _aligned(chunk, logprobs.shape[1] + 1)
                on_policy = torch.tensor([s.on_policy for s in chunk])
                loss, micro_stats = policy_gradient_loss(logprobs, rollout, advantages, mask, rl, norms, reference, on_policy)
                (loss * loss_scale).backward()
                if replay is not None and i == 0:
                    # what the learner's own routers would have chosen vs the engine's routes, on this rank's first micro-batch
                    per_layer = routing_disagreement(used.preferred(), used.layers, [s.routes for s in chunk], layout)
                    disagreement = {f"routing_disagreement_layer{layer}": rate for layer, rate in per_layer.items()}
            stats.add(micro_stats)
            loss_sum += float(loss.detach())
        update = self.core.optimizer.step()
        totals = _all_reduce_stats(stats, loss_sum)
        return {
            **totals,
            **update,
            **disagreement,
            "learner_seconds": time.monotonic() - started,
            "trained_tokens_per_s": totals["trained_tokens"] / max(time.monotonic() - started, 1e-9),
        }


def sequence_normalisers(sequences: list[LearnerSequence], aggregation: str) -> list[float]:
    """What each sequence's token sum is divided by. token_mean: the batch's trained tokens, for all;
    sequence_mean: its episode's trained tokens times the batch's episodes (each episode weighs 1 / episodes)."""
    trained = [float(s.loss_mask[1:].sum()) for s in sequences]
    if aggregation == "token_mean":
        return [max(sum(trained), 1.0)] * len(sequences)
    per_episode: dict[str, float] = {}
    for s, n in zip(sequences, trained):
        per_episode[s.episode] = per_episode.get(s.episode, 0.0) + n
    return [max(per_episode[s.episode], 1.0) * len(per_episode) for s in sequences]


def _padding_like(seq: LearnerSequence) -> LearnerSequence:
    """A micro-batch filler that trains nothing (all-false mask) but runs the collectives."""
    return LearnerSequence(seq.tokens, np.zeros_like(seq.loss_mask), seq.rollout_logprobs, 0.0, seq.routes)


def _aligned(chunk: list[LearnerSequence], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rollout logprobs, masks and per-token advantages shifted to the learner's [B, S-1] (entry t predicts token t+1)."""
    rollout = torch.zeros(len(chunk), seq_len - 1)
    mask = torch.zeros(len(chunk), seq_len - 1, dtype=torch.bool)
    advantages = torch.tensor([[s.advantage] for s in chunk], dtype=torch.float32).repeat(1, seq_len - 1)
    for b, s in enumerate(chunk):
        n = len(s.tokens)
        rollout[b, : n - 1] = torch.from_numpy(np.asarray(s.rollout_logprobs[1:], dtype=np.float32))
        mask[b, : n - 1] = torch.from_numpy(np.asarray(s.loss_mask[1:], dtype=bool))
        if s.bonus is not None:
            advantages[b, : n - 1] += torch.from_numpy(np.asarray(s.bonus[1:], dtype=np.float32))
    return rollout, mask, advantages


def _all_reduce_stats(stats: PolicyLossStats, loss_sum: float) -> dict[str, float]:
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    sums = torch.tensor([getattr(stats, name) for name in PolicyLossStats.SUMMED] + [loss_sum], dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    peak = torch.tensor([stats.ratio_max], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    *summed, loss = sums.tolist()
    total = PolicyLossStats(**dict(zip(PolicyLossStats.SUMMED, summed)), ratio_max=float(peak[0]))
    return {"loss": loss, **total.finalize()}
