"""Routed experts from the inference engine, in the layout Megatron's RouterReplay consumes.

The engine reports per sequence `[T-1, layers, top_k]` (the last token is never forwarded). Megatron wants,
per local MoE layer, one int64 `[S*B, top_k]` tensor in sequence-major order (row = s*B + b) over the model's
input rows (`[B, S]` padded, or `[1, T]` packed, this context-parallel rank's share: `trainer.packing`); under
sequence parallelism each tensor-parallel rank holds its own contiguous block of S/tp positions. Nothing
downstream validates this, so everything is checked here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from composer.recipes.errors import UserError
from composer.trainer.packing import SequenceLayout


class ReplayLayoutError(UserError):
    """Engine routes that do not fit the model or the micro-batch (wrong model, truncated or corrupt trajectory)."""


def replay_tensors(
    routes: list[np.ndarray],
    lengths: list[int],
    layout: SequenceLayout,
    num_experts: int,
    layers: Sequence[int],
    tp_rank: int = 0,
    tp_size: int = 1,
    sequence_parallel: bool = False,
) -> list[torch.Tensor]:
    """One int64 `[S_local*B, top_k]` tensor per layer in `layers` for a micro-batch of len(routes) sequences placed
    by `layout` (`trainer.packing`: padded rows or a packed stream, this context-parallel rank's share).

    routes[b]: `[lengths[b]-1, total_layers, top_k]`. Positions without a route (each sequence's last token,
    whose output feeds no loss, and padding) get a fixed valid selection, so they cannot change the loss.
    """
    if len(routes) != len(lengths):
        raise ReplayLayoutError(f"{len(routes)} route arrays for {len(lengths)} sequences")
    if not routes:
        raise ReplayLayoutError("empty micro-batch")
    if tuple(lengths) != layout.lengths:
        raise ReplayLayoutError(f"routes for sequences of {list(lengths)} tokens, the micro-batch holds {list(layout.lengths)}")
    top_k = routes[0].shape[-1]
    total_layers = routes[0].shape[1]
    if max(layers, default=-1) >= total_layers:
        raise ReplayLayoutError(f"routes cover {total_layers} layers, the model needs layers up to {max(layers)}")
    filler = np.arange(top_k, dtype=np.int64)
    per_sequence = []
    for b, (r, n) in enumerate(zip(routes, lengths)):
        if r.ndim != 3 or r.shape[1:] != (total_layers, top_k):
            raise ReplayLayoutError(f"sequence {b}: routes of shape {r.shape}, expected [*, {total_layers}, {top_k}]")
        if r.shape[0] != n - 1:
            raise ReplayLayoutError(f"sequence {b}: {r.shape[0]} routed positions for {n} tokens (expected {n - 1})")
        if r.size and (int(r.max()) >= num_experts or int(r.min()) < 0):
            bad = int(r.max()) if int(r.max()) >= num_experts else int(r.min())
            raise ReplayLayoutError(f"sequence {b}: expert id {bad} out of range for {num_experts} experts")
        last = r[-1:] if n >= 2 else np.broadcast_to(filler, (1, total_layers, top_k))
        per_sequence += [r.astype(np.int64), last.astype(np.int64)]
    # the stream of routes, one row per token, then the filler that padding positions read
    stream = np.concatenate([*per_sequence, np.broadcast_to(filler, (1, total_layers, top_k))])
    source = layout.indices()[0].numpy()
    batch = stream[np.where(source >= 0, source, len(stream) - 1)]  # [B_local, S_local, L, K]
    if sequence_parallel:
        seq_len = batch.shape[1]
        if seq_len % tp_size:
            raise ReplayLayoutError(f"micro-batch length {seq_len} not divisible by tp={tp_size} under sequence parallelism")
        shard = seq_len // tp_size
        batch = batch[:, tp_rank * shard : (tp_rank + 1) * shard]
    # [B, S, L, K] -> per layer [S, B, K] -> [S*B, K]
    return [torch.from_numpy(np.ascontiguousarray(batch[:, :, layer].transpose(1, 0, 2)).reshape(-1, top_k)) for layer in layers]
