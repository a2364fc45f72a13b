"""Where each token of a micro-batch sits on this rank: packed into one stream or padded to rows, split over
context parallelism.

A micro-batch is a list of sequences (RL segments, or the documents of mid-training samples). Its *stream* is
their tokens concatenated; every per-token array the loops keep (tokens, labels, loss masks, routes) is indexed
by stream position. A `SequenceLayout` says which stream position each of this rank's model inputs holds:

- packed (THD, Megatron's `PackedSeqParams`): one row `[1, T]` of all sequences back to back, each with its own
  causal attention and positions restarting at 0; no padding compute.
- padded: one row per sequence, right-padded to the longest; causal attention over the row.

Padding rules. Packed: each sequence is padded at its end to a multiple of 2*cp when cp > 1 (each is split into
2*cp chunks), and the last one further so that the stream is a multiple of 2*cp*m (cp > 1) or m (cp = 1), where m
is tp under sequence parallelism (else 1). Padded: rows are padded to a multiple of 2*cp*m (cp > 1) or m. Padding
sits after the real tokens of a sequence, so causal attention keeps it out of their results; its stream index is
-1 and it is never trained.

Context parallelism splits every sequence (packed) or row (padded) into 2*cp equal chunks and gives rank r chunks
r and 2*cp-1-r (the zigzag split: under causal attention every rank then does the same work). Megatron's RoPE
slices positions the same way (`get_pos_emb_on_this_cp_rank`, and per sequence for THD).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def zigzag_positions(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of a `length`-token sequence that context-parallel rank `cp_rank` holds (length % 2*cp == 0)."""
    if cp_size == 1:
        return torch.arange(length)
    chunk = length // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class SequenceLayout:
    """This rank's model inputs for a micro-batch of sequences of `lengths` tokens (see the module docstring)."""

    lengths: tuple[int, ...]
    """Real tokens of each sequence, in stream order."""
    packed: bool
    spans: tuple[int, ...]
    """Packed: each sequence's padded length in the packed row; padded: the row length once per sequence."""
    cp_size: int = 1
    cp_rank: int = 0
    _indices: dict = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def build(lengths: list[int], packed: bool, cp_size: int = 1, cp_rank: int = 0, multiple: int = 1) -> SequenceLayout:
        """`multiple`: tp under sequence parallelism (each tensor-parallel rank holds an equal block of the row)."""
        if not lengths or min(lengths) < 1:
            raise ValueError(f"a micro-batch needs sequences of at least one token, got lengths {list(lengths)}")
        unit = 2 * cp_size if cp_size > 1 else 1
        if packed:
            spans = [_round_up(n, unit) for n in lengths]
            spans[-1] += -sum(spans) % (unit * multiple)
        else:
            spans = [_round_up(max(lengths), unit * multiple)] * len(lengths)
        return SequenceLayout(tuple(lengths), packed, tuple(spans), cp_size, cp_rank)

    @property
    def stream_length(self) -> int:
        return sum(self.lengths)

    @property
    def has_padding(self) -> bool:
        """Whether any rank's inputs hold padding (the same answer on every rank)."""
        return sum(self.spans) > sum(self.lengths)

    @property
    def offsets(self) -> list[int]:
        """Stream position of each sequence's first token."""
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(int).tolist()

    def indices(self, cp_rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(stream index, position in its sequence) of each model input of `cp_rank` (default: this rank), both
        int64 `[rows, columns]`; stream index -1 for padding."""
        rank = self.cp_rank if cp_rank is None else cp_rank
        if rank not in self._indices:
            rows = []
            for offset, length, span in zip(self.offsets, self.lengths, self.spans):
                positions = zigzag_positions(span, self.cp_size, rank)
                rows.append((torch.where(positions < length, positions + offset, -1), positions))
            if self.packed:
                source, positions = (torch.cat([row[i] for row in rows])[None] for i in (0, 1))
            else:
                source, positions = (torch.stack([row[i] for row in rows]) for i in (0, 1))
            self._indices[rank] = (source, positions)
        return self._indices[rank]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.indices()[0].shape)

    @property
    def position_ids(self) -> torch.Tensor:
        return self.indices()[1]

    def local(self, stream: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """`stream` [N, ...] (one entry per stream position) -> this rank's `[rows, columns, ...]`, `fill` at padding."""
        source = self.indices()[0]
        out = stream[source.clamp(min=0)]
        padding = (source < 0).view(*source.shape, *([1] * (stream.dim() - 1)))
        return out.masked_fill(padding, fill)

    def stream(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's `[rows, columns, ...]` -> the whole stream `[N, ...]` (all context-parallel ranks').

        Differentiable: under cp every rank must compute the same function of the result (each gets the gradient
        of its own entries). A collective over the context-parallel group when cp > 1.
        """
        parts = _gather_context_parallel(local) if self.cp_size > 1 else [local]
        out = local.new_zeros(self.stream_length, *local.shape[2:])
        for rank, part in enumerate(parts):
            source = self.indices(rank)[0]
            real = source >= 0
            out = out.index_put((source[real],), part[real])
        return out

    def padded(self, stream: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """The stream's `[N, ...]` as `[sequences, width (default: the longest), ...]` rows, zeros past each end."""
        width = width or max(self.lengths)
        rows = torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths))
        columns = torch.cat([torch.arange(n) for n in self.lengths])
        keep = columns < width
        out = stream.new_zeros(len(self.lengths), width, *stream.shape[1:])
        return out.index_put((rows[keep], columns[keep]), stream[keep])

    def packed_seq_params(self):
        """Megatron's PackedSeqParams (THD) of a packed layout, with the global padded sequence boundaries; None padded."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        bounds = torch.tensor([0, *np.cumsum(self.spans)], dtype=torch.int32)
        if torch.cuda.is_available():
            bounds = bounds.cuda()
        longest = max(self.spans)
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=bounds,
            cu_seqlens_kv=bounds,
            cu_seqlens_q_padded=bounds,
            cu_seqlens_kv_padded=bounds,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )


def context_parallel_layout(spans: list[int], cp_size: int, packed: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(position, sequence id) of each token of a row on every context-parallel rank, for ring attention.

    Packed: the row holds sequences of `spans` padded tokens, each split zigzag; padded: one sequence of spans[0].
    """
    spans = spans if packed else spans[:1]
    out = []
    for rank in range(cp_size):
        positions = [zigzag_positions(span, cp_size, rank) for span in spans]
        ids = [torch.full_like(p, i) for i, p in enumerate(positions)]
        out.append((torch.cat(positions), torch.cat(ids)))
    return out


class _GatherFromContextParallel(torch.autograd.Function):
    """All-gather over the context-parallel group; backward keeps the gradient of this rank's own part (every rank
    computes the same function of the gathered result, so nothing is summed)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
        ctx.rank = torch.distributed.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad[ctx.rank]


def _gather_context_parallel(local: torch.Tensor) -> list[torch.Tensor]:
    return list(_GatherFromContextParallel.apply(local).unbind(0))


def stream_of(sequences: list[np.ndarray], dtype=torch.int64) -> torch.Tensor:
    """The sequences' entries back to back (the stream)."""
    return torch.as_tensor(np.concatenate([np.asarray(s) for s in sequences]), dtype=dtype)


def next_token_labels(sequences: list[np.ndarray]) -> torch.Tensor:
    """Per stream position the next token of its sequence; a sequence's last position repeats its last token (a
    placeholder: the last position predicts nothing)."""
    return stream_of([np.concatenate([np.asarray(s)[1:], np.asarray(s)[-1:]]) for s in sequences])


def document_lengths(tokens: torch.Tensor, eod: int) -> list[int]:
    """Lengths of the documents of mid-training samples `[B, S]` in stream order: a document ends with its EOD
    token (Megatron's reset_attention_mask convention) or with its sample."""
    lengths = []
    for row in tokens:
        ends = (torch.nonzero(row == eod).flatten() + 1).tolist()
        bounds = [0, *[e for e in ends if e < len(row)], len(row)]
        lengths += [b - a for a, b in zip(bounds, bounds[1:])]
    return lengths


def segment_lengths(segments: torch.Tensor) -> list[int]:
    """Lengths of the documents of samples `[B, S]` that say each position's document (consecutive equal ids;
    -1: padding, left out) in stream order."""
    lengths = []
    for row in segments:
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        lengths += counts[ids >= 0].tolist()
    return lengths
