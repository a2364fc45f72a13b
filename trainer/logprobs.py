"""The learner's log-probabilities of the tokens of a micro-batch, under any tp / sequence-parallel / ep / cp layout,
padded or packed.

Megatron's GPTModel with labels returns the vocab-parallel cross entropy per token ([B, S], -log p of the label,
identical on every tensor-parallel rank), so the full-vocabulary logits are never gathered. Router replay is
orthogonal: run `sequence_logprobs` (or `token_logprobs`) inside `trainer.router_replay.routing(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from composer.trainer.model import causal_mask
from composer.trainer.packing import SequenceLayout, next_token_labels, stream_of


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    """int64 [B, S]: the sequences, right-padded with `pad_id` to a common length S."""
    lengths: list[int]
    """Tokens of each sequence before padding."""
    layout: SequenceLayout
    """The padded rows as a layout (one rank, no context parallelism)."""

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]


def pad_micro_batch(sequences: list[np.ndarray], multiple: int = 1, pad_id: int = 0) -> MicroBatch:
    """Right-pad token sequences to one length, rounded up to `multiple` (the tp size under sequence parallelism).

    Padding sits after each sequence, so causal attention keeps it out of the real tokens' logprobs.
    """
    lengths = [len(s) for s in sequences]
    layout = SequenceLayout.build(lengths, packed=False, multiple=multiple)
    return MicroBatch(layout.local(stream_of(sequences), fill=pad_id), lengths, layout)


def token_logprobs(model, tokens: torch.Tensor, *, with_grad: bool = True, temperature: float = 1.0) -> torch.Tensor:
    """[B, S-1]: log p(tokens[:, t+1] | tokens[:, :t+1]) in fp32; with_grad=False for a no-grad (eval) pass.

    `temperature` scores the tokens under softmax(logits / temperature), the distribution the engine sampled
    them from (and reports logprobs of). The model's train/eval mode is the caller's; the last position is
    forwarded too (its route, if replayed, exists) but predicts nothing.
    """
    from megatron.core import tensor_parallel

    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=tokens.device).expand(batch, seq)
    labels = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # the last label is a placeholder, dropped below
    with torch.set_grad_enabled(with_grad):
        if temperature == 1.0:
            nll = model(tokens, position_ids, causal_mask(seq, tokens.device), labels=labels)
        else:
            # the vocab-parallel logits ([B, S, V/tp]), tempered in fp32 as the engine's sampler does
            logits = model(tokens, position_ids, causal_mask(seq, tokens.device))
            nll = tensor_parallel.vocab_parallel_cross_entropy(logits.float() / temperature, labels)
        return -nll[:, :-1].float()


def layout_for(model, lengths: list[int], packed: bool) -> SequenceLayout:
    """How a micro-batch of sequences of `lengths` tokens enters `model` on this rank (Megatron's parallel state)."""
    from megatron.core import parallel_state

    config = model.config  # the GPTModel's, also on Megatron's DDP wrapper
    return SequenceLayout.build(
        lengths,
        packed,
        cp_size=parallel_state.get_context_parallel_world_size(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        multiple=config.tensor_model_parallel_size if config.sequence_parallel else 1,
    )


def forward_token_losses(
    model, layout: SequenceLayout, tokens: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """-log p(label) per model input of this rank ([rows, columns], fp32 under a temperature), at `temperature`."""
    from megatron.core import tensor_parallel

    inputs = dict(packed_seq_params=layout.packed_seq_params())
    if layout.has_padding:
        # routers leave padding out of their load-balancing loss and expert loads (every cp rank alike: the
        # statistics are reduced over the group)
        inputs["padding_mask"] = (layout.indices()[0] < 0).to(tokens.device)
    mask = None if layout.packed else causal_mask(tokens.shape[1], tokens.device)
    if temperature == 1.0:
        return model(tokens, layout.position_ids, mask, labels=labels, **inputs)
    # the vocab-parallel logits ([B, S, V/tp]), tempered in fp32 as the engine's sampler does
    logits = model(tokens, layout.position_ids, mask, **inputs)
    return tensor_parallel.vocab_parallel_cross_entropy(logits.float() / temperature, labels)


def sequence_logprobs(
    model, layout: SequenceLayout, sequences: list[np.ndarray], *, with_grad: bool = True, temperature: float = 1.0
) -> torch.Tensor:
    """[B, S-1] as `token_logprobs` gives for the sequences padded to the longest (S): entry t of row b is
    log p(sequences[b][t+1] | sequences[b][:t+1]) in fp32, for t < len(b) - 1; the rest are not predictions.

    The sequences enter the model as `layout` places them (padded or packed, split over cp): the same logprobs
    either way. A collective over the context-parallel group; under cp every rank returns the whole batch's, and
    backward through them reaches the weights through this rank's share of the tokens only.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = layout.local(stream_of(sequences)).to(device)
    labels = layout.local(next_token_labels(sequences)).to(device)
    with torch.set_grad_enabled(with_grad):
        logprobs = -forward_token_losses(model, layout, tokens, labels, temperature).float()
        return layout.padded(layout.stream(logprobs.cpu()))[:, :-1]


def logprob_mismatch(
    learner: torch.Tensor, batch: MicroBatch, engine_logprobs: list[np.ndarray], loss_masks: list[np.ndarray]
) -> dict[str, float]:
    """Mean and max |learner - engine| logprob over the generated tokens (engine arrays aligned with the tokens,
    as in rollout Segments: entry t is the logprob of token t, used where loss_masks[b][t])."""
    diffs = []
    for b, (lp, mask, n) in enumerate(zip(engine_logprobs, loss_masks, batch.lengths)):
        positions = np.flatnonzero(np.asarray(mask)[:n])
        positions = positions[positions > 0]  # token 0 has no prediction
        ours = learner[b, positions - 1].detach().double().numpy()
        diffs.append(np.abs(ours - np.asarray(lp, dtype=np.float64)[positions]))
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    return {"mean": float(d.mean()) if d.size else 0.0, "max": float(d.max()) if d.size else 0.0, "tokens": int(d.size)}
