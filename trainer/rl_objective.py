"""The RL objective: group-relative advantages and a truncated importance-sampled policy gradient.

The rollout engine sampled with its own numerics (and possibly an older policy), so each token's
gradient is weighted by min(pi_learner / pi_rollout, cap): unbiased up to the cap, bounded variance.
The ratio may be taken per token, per sequence or as a sequence's geometric mean, and tokens or
sequences whose ratio leaves a band can be masked out (`RLSection`). Losses are sums over tokens
divided by normalisers fixed for the whole step (per episode with sequence-mean aggregation), so the
loss of an episode split into segments (self-summarization) is exactly the sum of its segments' losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from composer.recipes.schema import RLSection


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


def has_signal(rewards: np.ndarray) -> bool:
    """Do a group's rewards differ? A group whose samples all scored the same has zero group-relative advantages."""
    rewards = np.asarray(rewards, dtype=np.float64)
    return bool(rewards.size) and bool(rewards.max() - rewards.min() > 1e-9)


@dataclass
class PolicyLossStats:
    """Sums over the tokens of one micro-batch; `finalize` turns them into per-token means.

    The `fresh_*` sums cover on-policy tokens only (made by the very weights being trained): there learner and
    engine compute the same function, so any disagreement is numerics or a bug, not a policy change.
    """

    tokens: float = 0.0
    abs_logprob_diff: float = 0.0
    ratio: float = 0.0
    ratio_max: float = 0.0
    clipped: float = 0.0
    masked: float = 0.0
    kl: float = 0.0
    neg_logprob: float = 0.0
    fresh_tokens: float = 0.0
    fresh_abs_logprob_diff: float = 0.0
    fresh_ratio: float = 0.0

    SUMMED = (
        "tokens",
        "abs_logprob_diff",
        "ratio",
        "clipped",
        "masked",
        "kl",
        "neg_logprob",
        "fresh_tokens",
        "fresh_abs_logprob_diff",
        "fresh_ratio",
    )

    def add(self, other: PolicyLossStats) -> None:
        for name in self.SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ratio_max = max(self.ratio_max, other.ratio_max)

    def finalize(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        out = {
            "logprob_abs_diff": self.abs_logprob_diff / n,
            "prob_ratio_mean": self.ratio / n,
            "prob_ratio_max": self.ratio_max,
            "is_clip_fraction": self.clipped / n,
            "is_mask_fraction": self.masked / n,
            "kl_ref": self.kl / n,
            "entropy": self.neg_logprob / n,
            "trained_tokens": self.tokens,
        }
        if self.fresh_tokens:
            out["on_policy_logprob_abs_diff"] = self.fresh_abs_logprob_diff / self.fresh_tokens
            out["on_policy_prob_ratio_error"] = abs(self.fresh_ratio / self.fresh_tokens - 1.0)
        return out


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, rl: RLSection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, ratio, kept) per token [B, T] from the detached log ratio learner/rollout (zero off the mask).

    `rl.is_level`: the ratio of each token, of its sequence (product), or the sequence's geometric mean; the
    weight is the ratio truncated at `rl.is_cap`; `kept` is False where `rl.is_mask` leaves the token (token
    level) or its whole sequence out for a ratio outside the band.
    """
    if rl.is_level == "token":
        ratio = torch.exp(log_ratio)
    else:
        seq_log = log_ratio.sum(-1, keepdim=True)
        if rl.is_level == "geometric":
            seq_log = seq_log / mask.sum(-1, keepdim=True).clamp(min=1)
        ratio = torch.exp(seq_log).expand_as(log_ratio)
    kept = torch.ones_like(mask, dtype=torch.bool)
    if rl.is_mask is not None:
        low, high = rl.is_mask
        kept = (ratio >= low) & (ratio <= high)
    return torch.clamp(ratio, max=rl.is_cap) * kept, ratio, kept


def policy_gradient_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rl: RLSection,
    normaliser: float | torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    on_policy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Loss of a micro-batch of sequences [B, T].

    logprobs: the learner's log-probabilities of the sampled tokens (with grad);
    rollout_logprobs: the engine's; advantages: [B] per sequence, or [B, T] per token; loss_mask: tokens the policy generated;
    normaliser: what each sequence's token sum is divided by (a float for all, or [B]; see `rl.loss_aggregation`);
    on_policy: [B] bool, sequences made by the weights being trained (for the mismatch metrics).
    """
    mask = loss_mask.to(logprobs.dtype)
    log_ratio = (logprobs.detach() - rollout_logprobs) * mask
    weight, ratio, kept = importance_weights(log_ratio, mask, rl)
    per_token = -weight * (advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages) * logprobs
    kl = torch.zeros_like(logprobs)
    if rl.kl_coeff > 0 and ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || ref), non-negative
        per_token = per_token + rl.kl_coeff * kl
    norm = normaliser.unsqueeze(-1) if isinstance(normaliser, torch.Tensor) else normaliser
    loss = (per_token * mask / norm).sum()
    with torch.no_grad():
        token_ratio = torch.exp(log_ratio)
        fresh = mask * (on_policy.to(mask.dtype).unsqueeze(-1) if on_policy is not None else 0.0)
        stats = PolicyLossStats(
            tokens=float(mask.sum()),
            abs_logprob_diff=float(log_ratio.abs().sum()),
            ratio=float((token_ratio * mask).sum()),
            ratio_max=float((token_ratio * mask).max()) if mask.any() else 0.0,
            clipped=float(((ratio > rl.is_cap) & kept).to(mask.dtype).mul(mask).sum()),
            masked=float((~kept).to(mask.dtype).mul(mask).sum()),
            kl=float((kl.detach() * mask).sum()),
            # -log p of tokens sampled from the policy: a one-sample estimate of its entropy per token
            neg_logprob=float(-(logprobs.detach() * mask).sum()),
            fresh_tokens=float(fresh.sum()),
            fresh_abs_logprob_diff=float((log_ratio.abs() * fresh).sum()),
            fresh_ratio=float((token_ratio * fresh).sum()),
        )
    return loss, stats
