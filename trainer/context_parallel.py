"""Ring attention: exact causal attention over sequences split across the context-parallel group.

Each rank holds its zigzag share of every sequence (`trainer.packing`); its queries must meet every rank's keys.
Keys and values travel around the ring (rank r sends to r+1, receives from r-1) while the block in hand is
computed, and the blocks' results are merged with the online softmax (output and log-sum-exp per query row), so
the result is softmax attention over the whole sequence, not an approximation. Backward recomputes each block
from the final log-sum-exp (nothing of another rank's attention is stored) and the keys' and values' gradients
travel with their block until it is home again.

Masks come from (position, sequence id) per token, so padded rows and packed streams alike are causal within each
sequence. Query rows are taken in tiles (a tile's scores stay under TILE_BYTES) and each tile only reads the key
range it can see, which under the zigzag split skips the half of a block that causality hides. The arithmetic is
plain torch matmuls in fp32: portable (gloo on CPU, NCCL on GPUs), not a fused kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TILE_BYTES = 32 << 20
"""Bound on the temporaries of one query tile against the keys it sees (its scores and their gradient)."""


def ring_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, layout: list[tuple[torch.Tensor, torch.Tensor]], group
) -> torch.Tensor:
    """query [B, H, L, Dk], key [B, Hkv, L, Dk], value [B, Hkv, L, Dv] (Hkv divides H: query head h reads KV head
    h // (H / Hkv)) -> [B, H, L, Dv]. `layout[r]`: (position, sequence id) [L] of the tokens cp rank r holds."""
    return _RingAttention.apply(query, key, value, scale, layout, group)


class _Ring:
    """This rank's neighbours in the context-parallel group."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group)
        self.group, self.rank, self.size = group, dist.get_rank(group), len(ranks)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def start_shift(self, tensors: tuple[torch.Tensor, ...]) -> _Shift:
        """Send `tensors` (one dtype) to the next rank and receive the previous rank's, in the background."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        received = torch.empty_like(flat)
        requests = [dist.isend(flat, self.next, group=self.group), dist.irecv(received, self.prev, group=self.group)]
        return _Shift(requests, received, [t.shape for t in tensors])

    def shift(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return self.start_shift(tensors).wait()


class _Shift:
    def __init__(self, requests, received: torch.Tensor, shapes):
        self.requests, self.received, self.shapes = requests, received, shapes

    def wait(self) -> tuple[torch.Tensor, ...]:
        for request in self.requests:
            request.wait()
        sizes = [s.numel() for s in self.shapes]
        return tuple(part.view(shape) for part, shape in zip(self.received.split(sizes), self.shapes))


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return (t.repeat_interleave(groups, dim=1) if groups > 1 else t).float()


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of an expanded KV tensor back onto its KV heads."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


def _tiles(query: torch.Tensor, keys: int):
    b, h, n, _ = query.shape
    rows = max(16, TILE_BYTES // (3 * 4 * b * h * max(keys, 1)))  # up to three fp32 [b, h, rows, keys] at once
    return [(start, min(n, start + rows)) for start in range(0, n, rows)]


def _visible_keys(q_layout, k_layout, start: int, end: int):
    """(first, end, mask) of the key range the query rows [start, end) can see, or None when they see none."""
    q_pos, q_id = (t[start:end] for t in q_layout)
    k_pos, k_id = k_layout
    visible = (q_id[:, None] == k_id[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    columns = visible.any(0).nonzero().flatten()
    if columns.numel() == 0:
        return None
    first, last = int(columns[0]), int(columns[-1]) + 1
    return first, last, visible[:, first:last]


def _finite(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _block_forward(q, k, v, scale, q_layout, k_layout, out, lse) -> None:
    """Merge the attention of queries `q` over one block of keys into (out, lse), in place."""
    for start, end in _tiles(q, k.shape[2]):
        seen = _visible_keys(q_layout, k_layout, start, end)
        if seen is None:
            continue
        first, last, visible = seen
        # in place: a tile's scores are the largest temporaries here (two of them at most)
        scores = (q[:, :, start:end] @ k[:, :, first:last].transpose(-1, -2)).mul_(scale).masked_fill_(~visible, float("-inf"))
        tile_lse = torch.logsumexp(scores, dim=-1)  # -inf for rows that see nothing of this block
        tile_out = scores.sub_(_finite(tile_lse)[..., None]).exp_() @ v[:, :, first:last]
        rows_out, rows_lse = out[:, :, start:end], lse[:, :, start:end]
        merged = torch.logaddexp(rows_lse, tile_lse)
        rows_out.mul_(torch.exp(rows_lse - _finite(merged))[..., None]).add_(tile_out * torch.exp(tile_lse - _finite(merged))[..., None])
        rows_lse.copy_(merged)


def _block_backward(q, k, v, d_out, lse, delta, scale, q_layout, k_layout, dq, dk, dv) -> None:
    """Add one block's contribution to dq and to the block's dk, dv (softmax gradient from the final lse)."""
    for start, end in _tiles(q, k.shape[2]):
        seen = _visible_keys(q_layout, k_layout, start, end)
        if seen is None:
            continue
        first, last, visible = seen
        q_tile, d_tile = q[:, :, start:end], d_out[:, :, start:end]
        probs = (q_tile @ k[:, :, first:last].transpose(-1, -2)).mul_(scale).masked_fill_(~visible, float("-inf"))
        probs.sub_(lse[:, :, start:end, None]).exp_()
        dv[:, :, first:last] += probs.transpose(-1, -2) @ d_tile
        d_scores = (d_tile @ v[:, :, first:last].transpose(-1, -2)).sub_(delta[:, :, start:end, None]).mul_(probs).mul_(scale)
        dq[:, :, start:end] += d_scores @ k[:, :, first:last]
        dk[:, :, first:last] += d_scores.transpose(-1, -2) @ q_tile


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale, layout, group):
        ring = _Ring(group)
        groups = query.shape[1] // key.shape[1]
        q = query.float()
        b, h, n, _ = query.shape
        out = torch.zeros(b, h, n, value.shape[-1], dtype=torch.float32, device=query.device)
        lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=query.device)
        block = (key, value)
        for step in range(ring.size):
            incoming = ring.start_shift(block) if step < ring.size - 1 else None
            owner = (ring.rank - step) % ring.size
            _block_forward(q, _expand(block[0], groups), _expand(block[1], groups), scale, layout[ring.rank], layout[owner], out, lse)
            if incoming is not None:
                block = incoming.wait()
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale, ctx.layout, ctx.group = scale, layout, group
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, d_out):
        query, key, value, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        groups = query.shape[1] // key.shape[1]
        q, d_out = query.float(), d_out.float()
        delta = (d_out * out).sum(-1)
        dq = torch.zeros_like(q)
        block = (key, value)
        grads = (torch.zeros_like(key, dtype=torch.float32), torch.zeros_like(value, dtype=torch.float32))
        for step in range(ring.size):
            incoming = ring.start_shift(block) if step < ring.size - 1 else None
            owner = (ring.rank - step) % ring.size
            k, v = _expand(block[0], groups), _expand(block[1], groups)
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            _block_backward(q, k, v, d_out, lse, delta, ctx.scale, ctx.layout[ring.rank], ctx.layout[owner], dq, dk, dv)
            # the block's gradients go on with it: after the last step each rank holds its own block's
            grads = ring.shift((grads[0] + _fold(dk, groups), grads[1] + _fold(dv, groups)))
            if incoming is not None:
                block = incoming.wait()
        return dq.to(query.dtype), grads[0].to(key.dtype), grads[1].to(value.dtype), None, None, None
