"""Routed experts from the inference engine, in the layout Megatron's RouterReplay consumes.

The engine reports per sequence `[T-1, layers, top_k]` (the last token is never forwarded). Megatron wants,
per local MoE layer, one int64 `[S*B, top_k]` tensor in sequence-major order (row = s*B + b) over the
micro-batch padded to S tokens; under sequence parallelism each tensor-parallel rank holds its own
contiguous block of S/tp positions. Nothing downstream validates this, so everything is checked here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from recipes.errors import UserError


class ReplayLayoutError(UserError):
    """Engine routes that do not fit the model or the micro-batch (wrong model, truncated or corrupt trajectory)."""


def replay_tensors(
    routes: list[np.ndarray],
    lengths: list[int],
    seq_len: int,
    num_experts: int,
    layers: Sequence[int],
    tp_rank: int = 0,
    tp_size: int = 1,
    sequence_parallel: bool = False,
) -> list[torch.Tensor]:
    """One int64 `[S_local*B, top_k]` tensor per layer in `layers` for a micro-batch of len(routes) sequences.

    routes[b]: `[lengths[b]-1, total_layers, top_k]`. Positions without a route (each sequence's last token,
    whose output feeds no loss, and padding) get a fixed valid selection, so they cannot change the loss.
    """
    if len(routes) != len(lengths):
        raise ReplayLayoutError(f"{len(routes)} route arrays for {len(lengths)} sequences")
    if not routes:
        raise ReplayLayoutError("empty micro-batch")
    top_k = routes[0].shape[-1]
    total_layers = routes[0].shape[1]
    if max(layers, default=-1) >= total_layers:
        raise ReplayLayoutError(f"routes cover {total_layers} layers, the model needs layers up to {max(layers)}")
    filler = np.arange(top_k, dtype=np.int64)
    batch = np.broadcast_to(filler, (len(routes), seq_len, total_layers, top_k)).copy()
    for b, (r, n) in enumerate(zip(routes, lengths)):
        if r.ndim != 3 or r.shape[1:] != (total_layers, top_k):
            raise ReplayLayoutError(f"sequence {b}: routes of shape {r.shape}, expected [*, {total_layers}, {top_k}]")
        if r.shape[0] != n - 1:
            raise ReplayLayoutError(f"sequence {b}: {r.shape[0]} routed positions for {n} tokens (expected {n - 1})")
        if n > seq_len:
            raise ReplayLayoutError(f"sequence {b}: {n} tokens exceed the micro-batch length {seq_len}")
        if r.size and (int(r.max()) >= num_experts or int(r.min()) < 0):
            bad = int(r.max()) if int(r.max()) >= num_experts else int(r.min())
            raise ReplayLayoutError(f"sequence {b}: expert id {bad} out of range for {num_experts} experts")
        batch[b, : n - 1] = r
        if n >= 2:
            batch[b, n - 1] = r[-1]
    if sequence_parallel:
        if seq_len % tp_size:
            raise ReplayLayoutError(f"micro-batch length {seq_len} not divisible by tp={tp_size} under sequence parallelism")
        shard = seq_len // tp_size
        batch = batch[:, tp_rank * shard : (tp_rank + 1) * shard]
    # [B, S, L, K] -> per layer [S, B, K] -> [S*B, K]
    return [torch.from_numpy(np.ascontiguousarray(batch[:, :, layer].transpose(1, 0, 2)).reshape(-1, top_k)) for layer in layers]
