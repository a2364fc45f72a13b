"""QK-clip (Kimi K2's MuonClip): attention logits held under `optim.qk_clip` by scaling query/key weights after a step.

The core-attention modules (`MaxLogitRecorder`) record, in training forwards, each local head's largest logit (the
scaled q.k that enters the softmax, over the causal positions) into `current_max_attn_logits`, the attribute
Megatron's clipping reads; on GPUs Transformer Engine's attention would record it, the local and SDPA modules here
compute it from their queries and keys. After the optimizer step `clip_attention_logits` takes the maximum over
data parallelism and, for every head above the threshold, eta = threshold / max and (alpha = 1/2):
- MLA (deepseek_v3): Megatron's `MLASelfAttention.clip_qk`, per head: q_nope * eta^alpha, k_nope * eta^(1-alpha),
  q_rope * eta (the RoPE key is shared by all heads, so it stays); each logit is then multiplied by eta.
- GQA (llama): per KV group, eta of the group's largest head: its query rows * eta^alpha, its key rows *
  eta^(1-alpha). Done here: Megatron 0.16.1's `SelfAttention.clip_qk` reshapes the tensor-parallel shard of
  linear_qkv by the global projection sizes, which is right at tp=1 only.
qwen3_moe normalises queries and keys after these projections (QK-norm), so scaling them cannot lower its logits;
recipes.checks refuses QK-clip there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ALPHA = 0.5
"""Share of the scaling applied to the queries (the rest to the keys), as Kimi K2 and Megatron's default."""

_SCORES_PER_CHUNK = 2**24
"""Logits materialised at once while searching the maximum (64 MiB in fp32)."""


def max_logits_per_head(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """Each query head's largest causal logit scale * q_i.k_j (j <= i) of query [s, b, heads, d] and key
    [s, b, groups, d] (GQA: head h reads group h // (heads / groups)); returns [heads] in fp32."""
    seq, batch, heads, _ = query.shape
    q = query.detach().float().permute(1, 2, 0, 3)  # [b, heads, s, d]
    k = key.detach().float().repeat_interleave(heads // key.shape[2], dim=2).permute(1, 2, 3, 0)  # [b, heads, d, s]
    rows = max(1, _SCORES_PER_CHUNK // (batch * heads * seq))
    maxima = torch.full((heads,), -torch.inf, device=query.device)
    for start in range(0, seq, rows):
        scores = torch.matmul(q[:, :, start : start + rows], k) * scale  # [b, heads, rows, s]
        query_pos = torch.arange(start, start + scores.shape[2], device=query.device)[:, None]
        scores.masked_fill_(torch.arange(seq, device=query.device)[None, :] > query_pos, -torch.inf)
        maxima = torch.maximum(maxima, scores.amax(dim=(0, 2, 3)))
    return maxima


class MaxLogitRecorder:
    """Mixin of a core-attention module: keeps the largest logit per local head over the training forwards
    since the last clip, when its config has QK-clip on."""

    current_max_attn_logits: torch.Tensor | None = None

    def record_max_logits(self, query: torch.Tensor, key: torch.Tensor, scale: float) -> None:
        if not (self.training and self.config.qk_clip):
            return
        with torch.no_grad():
            maxima = max_logits_per_head(query, key, scale)
            seen = self.current_max_attn_logits
            self.current_max_attn_logits = maxima if seen is None else torch.maximum(seen, maxima)


def clip_attention_logits(model) -> float:
    """Collective. Scale back the heads of `model` (this rank's GPTModel, QK-clip on) whose largest training logit
    since the last call exceeded the threshold; returns the largest logit of the whole model before clipping."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    attentions = [layer.self_attention for layer in model.decoder.layers]
    heads = [a.num_attention_heads_per_partition for a in attentions]
    seen = [a.core_attention.current_max_attn_logits for a in attentions]
    local = torch.cat([m if m is not None else torch.full((n,), -torch.inf) for m, n in zip(seen, heads)])
    # replicas of the same heads (data parallelism, experts' ranks included) saw other samples: all clip alike
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    overall = local.max() if local.numel() else torch.tensor(-torch.inf)
    dist.all_reduce(overall, op=dist.ReduceOp.MAX)  # other tensor-parallel heads, other pipeline stages
    threshold = model.config.qk_clip_threshold
    # a diverged run's non-finite logits give no scale to clip by: left alone (the logged maximum shows them)
    local = torch.where(torch.isfinite(local), local, -torch.inf)
    for attention, maxima in zip(attentions, local.split(heads)):
        attention.core_attention.current_max_attn_logits = maxima
        if isinstance(attention, MLASelfAttention):
            attention.clip_qk()  # also resets current_max_attn_logits
        else:
            _clip_grouped_query_attention(attention, maxima, threshold)
            attention.core_attention.current_max_attn_logits = None
    return float(overall)


@torch.no_grad()
def _clip_grouped_query_attention(attention, maxima: torch.Tensor, threshold: float) -> None:
    groups = attention.num_query_groups_per_partition
    per_group = maxima.view(groups, -1).amax(dim=1)
    if not bool((per_group > threshold).any()):
        return
    eta = (threshold / per_group).clamp(max=1.0).view(groups, 1, 1)
    weight = attention.linear_qkv.weight
    q_rows = attention.hidden_size_per_attention_head * (attention.num_attention_heads_per_partition // groups)
    for tensor in (weight, getattr(weight, "main_param", None)):
        if tensor is None:
            continue
        # Megatron's fused layout: per KV group, that group's query heads, then its key, then its value rows
        rows = tensor.data.view(groups, -1, tensor.shape[-1])
        rows[:, :q_rows].mul_(eta**ALPHA)
        rows[:, q_rows : q_rows + attention.hidden_size_per_attention_head].mul_(eta ** (1 - ALPHA))
