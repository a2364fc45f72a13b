"""The RL objective: group-relative advantages and a truncated importance-sampled policy gradient.

The rollout engine sampled with its own numerics (and possibly an older policy), so each token's
gradient is weighted by min(pi_learner / pi_rollout, cap): unbiased up to the cap, bounded variance.
Losses are sums over tokens divided by a normaliser fixed for the whole step, so the loss of an
episode split into segments (self-summarization) is exactly the sum of its segments' losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recipes.schema import RLSection


def group_advantages(rewards: np.ndarray, mode: str, eps: float = 1e-6, valid: np.ndarray | None = None) -> np.ndarray:
    """Advantages of the samples of one prompt: reward minus the group mean (divided by its std).

    `valid` (bool per sample) leaves out samples whose reward says nothing (infrastructure failures):
    the statistics come from the valid ones only, and the others get advantage 0."""
    rewards = np.asarray(rewards, dtype=np.float64)
    valid = np.ones(len(rewards), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    advantages = np.zeros_like(rewards)
    if not valid.any():
        return advantages
    kept = rewards[valid]
    centred = kept - kept.mean()
    advantages[valid] = centred / (kept.std() + eps) if mode == "group_mean_std" else centred
    return advantages


@dataclass
class PolicyLossStats:
    """Sums over the tokens of one micro-batch; `finalize` turns them into per-token means."""

    tokens: float = 0.0
    abs_logprob_diff: float = 0.0
    ratio: float = 0.0
    ratio_max: float = 0.0
    clipped: float = 0.0
    kl: float = 0.0

    def add(self, other: PolicyLossStats) -> None:
        self.tokens += other.tokens
        self.abs_logprob_diff += other.abs_logprob_diff
        self.ratio += other.ratio
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        self.clipped += other.clipped
        self.kl += other.kl

    def finalize(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {
            "logprob_abs_diff": self.abs_logprob_diff / n,
            "prob_ratio_mean": self.ratio / n,
            "prob_ratio_max": self.ratio_max,
            "is_clip_fraction": self.clipped / n,
            "kl_ref": self.kl / n,
            "trained_tokens": self.tokens,
        }


def policy_gradient_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rl: RLSection,
    normaliser: float,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Loss of a micro-batch of sequences [B, T].

    logprobs: the learner's log-probabilities of the sampled tokens (with grad);
    rollout_logprobs: the engine's; advantages: [B] per sequence; loss_mask: tokens the policy generated.
    """
    mask = loss_mask.to(logprobs.dtype)
    log_ratio = (logprobs.detach() - rollout_logprobs) * mask
    if rl.is_level == "sequence":
        seq_ratio = torch.exp(log_ratio.sum(-1, keepdim=True))
        ratio = seq_ratio.expand_as(logprobs)
    else:
        ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=rl.is_cap)
    per_token = -weight * advantages.unsqueeze(-1) * logprobs
    kl = torch.zeros_like(logprobs)
    if rl.kl_coeff > 0 and ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || ref), non-negative
        per_token = per_token + rl.kl_coeff * kl
    loss = (per_token * mask).sum() / normaliser
    with torch.no_grad():
        token_ratio = torch.exp(log_ratio)
        stats = PolicyLossStats(
            tokens=float(mask.sum()),
            abs_logprob_diff=float(log_ratio.abs().sum()),
            ratio=float((token_ratio * mask).sum()),
            ratio_max=float((token_ratio * mask).max()) if mask.any() else 0.0,
            clipped=float(((ratio > rl.is_cap).to(mask.dtype) * mask).sum()),
            kl=float((kl.detach() * mask).sum()),
        )
    return loss, stats
