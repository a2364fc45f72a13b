"""The learner's log-probabilities of the tokens of a micro-batch, under any tp / sequence-parallel / ep layout.

Megatron's GPTModel with labels returns the vocab-parallel cross entropy per token ([B, S], -log p of the label,
identical on every tensor-parallel rank), so the full-vocabulary logits are never gathered. Router replay is
orthogonal: run `token_logprobs` inside `trainer.router_replay.routing(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainer.model import causal_mask


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    """int64 [B, S]: the sequences, right-padded with `pad_id` to a common length S."""
    lengths: list[int]
    """Tokens of each sequence before padding."""

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]


def pad_micro_batch(sequences: list[np.ndarray], multiple: int = 1, pad_id: int = 0) -> MicroBatch:
    """Right-pad token sequences to one length, rounded up to `multiple` (the tp size under sequence parallelism).

    Padding sits after each sequence, so causal attention keeps it out of the real tokens' logprobs.
    """
    lengths = [len(s) for s in sequences]
    seq_len = -(-max(lengths) // multiple) * multiple
    tokens = torch.full((len(sequences), seq_len), pad_id, dtype=torch.int64)
    for b, s in enumerate(sequences):
        tokens[b, : len(s)] = torch.as_tensor(np.asarray(s), dtype=torch.int64)
    return MicroBatch(tokens, lengths)


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


def logprob_mismatch(learner: torch.Tensor, batch: MicroBatch, engine_logprobs: list[np.ndarray], loss_masks: list[np.ndarray]) -> dict[str, float]:
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
