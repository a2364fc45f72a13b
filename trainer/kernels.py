"""Fast kernels for the model's two hot spots, as drop-in modules of Megatron's local layer spec.

- `GroupedGemmExperts`: every local routed expert in two grouped GEMMs (torch's grouped_mm), forward
  and backward, instead of SequentialMLP's Python loop. It keeps SequentialMLP's parameters
  (`local_experts.N.linear_fc{1,2}.weight`), so HF mapping, checkpoints, sync and router replay do not change.
  Megatron's own grouped experts are not used: TEGroupedMLP needs Transformer Engine and GroupedMLP the
  grouped_gemm package (neither is in the pinned stack), and both store experts under other parameter names.
- `SDPAttention`: Megatron's DotProductAttention with its unfused softmax(QK^T)V replaced by torch's
  scaled_dot_product_attention (flash / memory-efficient / cuDNN kernels on GPUs): causal, GQA, the module's
  softmax scale (MLA's included); packed sequences (THD) as one attention per sequence, and context parallelism
  as ring attention (`trainer.context_parallel`), which Megatron's own attention does only with Transformer Engine.
The local and SDPA modules record the largest attention logits when QK-clip is on (trainer.qk_clip).

`resolve_kernels` turns `model.kernels` into the modules used; `check_kernels` refuses a choice this torch cannot run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from composer.recipes.errors import UserError
from composer.recipes.schema import KernelsSection
from composer.trainer.qk_clip import MaxLogitRecorder


@dataclass(frozen=True)
class KernelChoice:
    experts: str
    """`grouped` or `sequential`."""
    attention: str
    """`sdpa` or `local`."""


def _grouped_mm():
    """torch's grouped GEMM: public as nn.functional.grouped_mm in newer releases, torch._grouped_mm before."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def grouped_mm_runs(dtype: torch.dtype, device: str) -> bool:
    """Whether this torch runs a grouped GEMM forward and backward in `dtype` on `device` (empty groups included)."""
    if _grouped_mm() is None:
        return False
    try:
        x = torch.ones(24, 16, dtype=dtype, device=device, requires_grad=True)
        w = torch.ones(3, 16, 16, dtype=dtype, device=device, requires_grad=True)
        offsets = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)
        _grouped_linear(x, w, offsets).sum().backward()
        return bool(torch.isfinite(w.grad).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def check_kernels_installed(kernels: KernelsSection) -> None:
    """Recipe check (before launch, on the driver): the installed torch has the kernels asked for."""
    if kernels.experts == "grouped" and _grouped_mm() is None:
        raise UserError(f"model.kernels.experts=grouped: torch {torch.__version__} has no grouped_mm; use experts: sequential (or auto)")


def check_kernels(kernels: KernelsSection, dtype: torch.dtype, device: str) -> None:
    """At model build, on the rank's device: the grouped GEMM also runs in the model's dtype there."""
    if kernels.experts == "grouped" and not grouped_mm_runs(dtype, device):
        raise UserError(
            f"model.kernels.experts=grouped: torch {torch.__version__} cannot run grouped_mm in {dtype} on {device}; "
            "use experts: sequential (or auto)"
        )


def resolve_kernels(kernels: KernelsSection, dtype: torch.dtype, device: str) -> KernelChoice:
    check_kernels(kernels, dtype, device)
    experts = kernels.experts
    if experts == "auto":
        experts = "grouped" if grouped_mm_runs(dtype, device) else "sequential"
    return KernelChoice(experts=experts, attention="local" if kernels.attention == "local" else "sdpa")


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[T, K] tokens sorted by group, weight [G, N, K], offsets[g] = end row of group g -> [T, N] (x_g @ W_g^T)."""
    out = _grouped_mm()(x, weight.transpose(1, 2), offs=offsets)
    if out.requires_grad:
        # grouped_mm's backward rejects broadcast (zero-stride) gradients, e.g. the one of a sum
        out.register_hook(lambda grad: grad.contiguous())
    return out


def grouped_gemm_experts():
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GroupedGemmExperts(SequentialMLP):
        """SequentialMLP's experts and parameters, computed by two grouped GEMMs over all local experts.

        Megatron marks expert linears `explicit_expert_comm` under tp or ep, so each expert is a plain local
        x @ W^T and the dispatcher does every collective: the grouped GEMM computes the same without the loop.
        """

        def __init__(self, num_local_experts, config, submodules, pg_collection=None):
            super().__init__(num_local_experts, config, submodules, pg_collection)
            c = self.config
            if not c.gated_linear_unit or c.add_bias_linear or c.activation_func_clamp_value is not None or c.glu_linear_offset:
                raise UserError("model.kernels.experts=grouped computes bias-free SwiGLU experts only; use experts: sequential")

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            # no tokens for this rank's experts (expert parallelism): grouped_mm's backward rejects some empty operands
            empty = permuted_local_hidden_states.shape[0] == 0
            if empty or self.config.moe_apply_probs_on_input or self.config.fp8 or self.config.fp4:
                return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
            hidden = permuted_local_hidden_states.contiguous()  # grouped GEMM kernels want row-major tokens
            fc1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])  # [E, 2F, H]
            fc2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])  # [E, H, F]
            offsets = torch.cumsum(tokens_per_expert.to(hidden.device), 0).to(torch.int32)
            gate, up = _grouped_linear(hidden, fc1, offsets).chunk(2, dim=-1)
            intermediate = self.config.activation_func(gate) * up
            # as MLP's per_token_scale: probabilities applied after the activation, back in the compute dtype
            intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(hidden.dtype)
            return _grouped_linear(intermediate, fc2, offsets), None

    return GroupedGemmExperts


def local_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalAttention(MaxLogitRecorder, DotProductAttention):
        """Megatron's unfused DotProductAttention, recording the largest logits for QK-clip.

        MLA passes `k_channels`/`v_channels` (keys wider than values), which only Transformer Engine's attention
        takes in 0.16.1; the local one computes the same from the shapes it gets, with MLA's softmax scale passed
        explicitly and the output width from kv_channels (= v_head_dim there).
        """

        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
            super().__init__(*args, **kwargs)

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            self.record_max_logits(query, key, _logit_scale(self))
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return LocalAttention


def _logit_scale(attention) -> float:
    """What q.k is multiplied by before the softmax (query-key layer scaling folds a layer factor out and back in)."""
    return attention.softmax_scale * (attention.layer_number if attention.config.apply_query_key_layer_scaling else 1)


def sdp_attention():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class SDPAttention(MaxLogitRecorder, MegatronModule):
        """Causal attention computed by torch's fused scaled_dot_product_attention, for padded rows, packed
        sequences (THD: one causal attention per sequence) and context parallelism (ring attention over the cp
        group, `trainer.context_parallel`).

        Causal masking comes from the mask type (`is_causal`), as Transformer Engine's attention does: the explicit
        causal mask the callers pass is not read. MLA's `k_channels`/`v_channels` (keys wider than values) need no
        setting: the shapes carry them. Built in place of Megatron's DotProductAttention (same arguments), which
        refuses packed sequences and context parallelism.
        """

        def __init__(
            self,
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=None,
            softmax_scale=None,
            cp_comm_type=None,
            pg_collection=None,
            k_channels: int | None = None,
            v_channels: int | None = None,
        ):
            super().__init__(config=config)
            self.attn_mask_type = attn_mask_type
            self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups(required_pgs=["cp"])
            self.cp_group = pg_collection.cp

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            mask_type = attn_mask_type or self.attn_mask_type
            if attention_bias is not None or mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
                raise UserError("model.kernels.attention=sdpa builds causal attention only; use attention: local")
            if query.shape[0] != key.shape[0]:
                raise UserError("model.kernels.attention=sdpa: queries and keys of different lengths (a KV cache) are not built")
            packed = packed_seq_params is not None
            cp = self.cp_group.size()
            dropout = self.dropout if self.training else 0.0
            if dropout and (packed or cp > 1):
                raise UserError("attention dropout with packed sequences or context parallelism is not built; set it to 0")
            # [s, b, heads, d] (THD: [t, heads, d]) -> [b, heads, s, d]
            q, k, v = (t.unsqueeze(1).permute(1, 2, 0, 3) if packed else t.permute(1, 2, 0, 3) for t in (query, key, value))
            bounds = packed_seq_params.cu_seqlens_q_padded.tolist() if packed else [0, q.shape[2] * cp]
            if cp > 1:
                from composer.trainer.context_parallel import ring_attention

                if self.config.qk_clip:
                    raise UserError("optim.qk_clip with context parallelism (parallelism.cp > 1) is not built")
                spans = tuple(b - a for a, b in zip(bounds, bounds[1:]))
                layout = [tuple(t.to(q.device) for t in rank) for rank in _context_parallel_layout(spans, cp, packed)]
                out = ring_attention(q, k, v, self.softmax_scale, layout, self.cp_group)
            else:
                groups = q.shape[1] // k.shape[1]
                if groups > 1:
                    # GQA as the local module does it (query head i reads KV group i // groups); expanded rather than
                    # SDPA's enable_gqa, which not every fused backend takes (a fallback to the unfused math kernel)
                    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
                for a, b in zip(bounds, bounds[1:]):
                    self.record_max_logits(q[:, :, a:b].permute(2, 0, 1, 3), k[:, :, a:b].permute(2, 0, 1, 3), self.softmax_scale)
                # MLA's values are narrower than its keys; fused kernels (CPU flash among them) want one head width,
                # and without them SDPA keeps the whole [s, s] attention for backward: values zero-padded to the key
                # width, the padding's output columns dropped
                width = v.shape[-1]
                if width < q.shape[-1]:
                    v = F.pad(v, (0, q.shape[-1] - width))
                out = torch.cat(
                    [
                        F.scaled_dot_product_attention(
                            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=self.softmax_scale, dropout_p=dropout
                        )
                        for a, b in zip(bounds, bounds[1:])
                    ],
                    dim=2,
                )[..., :width]
            out = out.permute(2, 0, 1, 3)  # [s, b, heads, dv]
            return out.reshape(out.shape[0], -1) if packed else out.reshape(out.shape[0], out.shape[1], -1)

    return SDPAttention


@functools.lru_cache(maxsize=16)
def _context_parallel_layout(spans: tuple[int, ...], cp: int, packed: bool):
    """Every layer of a micro-batch asks for the same layout."""
    from composer.trainer.packing import context_parallel_layout

    return context_parallel_layout(list(spans), cp, packed)
