"""What an episode produced: its token stream in segments (one training sequence each; more than one when the
episode was self-summarized), per token the id, whether the learner trains on it (model-generated) and the engine's
logprob, per token and MoE layer the experts the engine routed to (narrowest integer dtype: a long episode holds
~10^8 ids), and the episode's reward and details. The RL run stores and trains on these (`rl.trajectories`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Segment:
    token_ids: np.ndarray
    """int32 [T]: prompt and response tokens of one training sequence."""
    loss_mask: np.ndarray
    """bool [T]: tokens the policy generated (trained on); prompt and tool output are False."""
    logprobs: np.ndarray
    """float32 [T]: rollout logprob of each generated token (0 elsewhere)."""
    routed_experts: np.ndarray | None = None
    """[T-1, layers, top_k] expert ids from the engine (the last token is never forwarded)."""

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=bool)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"segment arrays disagree: {n} tokens, {len(self.loss_mask)} mask, {len(self.logprobs)} logprobs")
        if self.routed_experts is not None:
            self.routed_experts = narrowest_ids(self.routed_experts)
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != n - 1:
                raise ValueError(f"routed experts {self.routed_experts.shape} do not cover {n} tokens ([T-1, layers, top_k])")


@dataclass
class Trajectory:
    id: str
    group_id: str
    task_id: str
    policy_version: int
    """Weights version the episode was generated with (staleness is measured against it)."""
    reward: float
    segments: list[Segment]
    info: dict = field(default_factory=dict)
    """JSON-serialisable extras: finish reasons, sandbox status, summaries made."""

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)


def narrowest_ids(ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0):
        raise ValueError("expert ids must be non-negative")
    top = int(ids.max()) if ids.size else 0
    dtype = np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.uint32
    return ids.astype(dtype, copy=False)
