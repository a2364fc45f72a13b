"""Sizes of a model from its recipe section: parameters, and what one device of a vLLM engine holds.

Pure arithmetic on the schema, so recipes are checked (and `--dry-run` plans printed) without torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer.recipes.schema import EngineParallelismSection, ModelSection

WEIGHT_BYTES = {"float32": (4, 4), "bfloat16": (2, 2), "fp8": (1, 1), "int4": (2, 0.5)}
"""Bytes per parameter (outside the routed experts, of a routed expert) of each rollout.dtype: fp8 quantizes every
linear, int4 the routed experts only (their scales and the bf16 embeddings and norms left out: a lower bound)."""


def sized_dtype(dtype: str, kind: str | None) -> str:
    """`rollout.dtype` for sizing before the machine decides `auto`: bfloat16 on GPUs, float32 on CPUs or unknown
    devices (the larger of the two it may become there)."""
    return ("bfloat16" if kind == "gpu" else "float32") if dtype == "auto" else dtype


@dataclass(frozen=True)
class ParameterBreakdown:
    """Parameters of architecture `m` by the part that holds them: what parallelism splits differently (the
    planner's per-rank split, cluster/plan.py) and what optimizers treat differently (Muon takes the matrices)."""

    embedding: int
    """The input embedding [vocab, hidden]."""
    output: int
    """The output layer [vocab, hidden]; 0 with tie_word_embeddings."""
    final_norm: int
    attention_split: int
    """Per layer: the attention matrices tensor parallelism splits by heads (query, key / value, output)."""
    attention_whole: int
    """Per layer: attention matrices every tensor-parallel rank holds whole (MLA's down-projections)."""
    attention_norms: int
    """Per layer: QK norms (qwen3_moe), MLA's latent norms."""
    layer_norms: int
    """Per layer: the input and pre-MLP norms."""
    dense_mlp: int
    """Per dense layer (the first_k_dense ones, or all of a dense model)."""
    router: int
    """Per MoE layer: the router's weight matrix."""
    expert_bias: int
    """Per MoE layer: deepseek_v3's expert bias (aux-loss-free balancing; a buffer in Megatron, no gradient)."""
    shared_experts: int
    """Per MoE layer, all of them."""
    routed_expert: int
    """One routed expert."""


def parameter_breakdown(m: ModelSection) -> ParameterBreakdown:
    h, a = m.hidden_size, m.num_attention_heads
    if m.family == "deepseek_v3":
        q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        split = a * m.v_head_dim * h + m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
        whole = h * (m.kv_lora_rank + m.qk_rope_head_dim)
        norms = m.kv_lora_rank
        if m.q_lora_rank:
            split += m.q_lora_rank * a * q_head
            whole += h * m.q_lora_rank
            norms += m.q_lora_rank
        else:
            split += h * a * q_head
    else:
        split, whole = h * m.head_dim * (2 * a + 2 * m.num_kv_heads), 0
        norms = 2 * m.head_dim if m.family == "qwen3_moe" else 0
    return ParameterBreakdown(
        embedding=m.vocab_size * h,
        output=0 if m.tie_word_embeddings else m.vocab_size * h,
        final_norm=h,
        attention_split=split,
        attention_whole=whole,
        attention_norms=norms,
        layer_norms=2 * h,
        dense_mlp=3 * h * m.ffn_hidden_size,
        router=m.num_experts * h,
        expert_bias=m.num_experts if m.family == "deepseek_v3" else 0,
        shared_experts=3 * h * m.moe_ffn_hidden_size * m.num_shared_experts,
        routed_expert=3 * h * m.moe_ffn_hidden_size,
    )


def parameter_counts(m: ModelSection) -> tuple[int, int]:
    """(total, active per token) parameters of architecture `m`: embeddings and every layer; active counts only
    moe_top_k of each MoE layer's routed experts (routers and shared experts always run)."""
    b = parameter_breakdown(m)
    moe_layers = len(m.moe_layers)
    per_layer = b.attention_split + b.attention_whole + b.attention_norms + b.layer_norms
    always = moe_layers * (b.router + b.expert_bias + b.shared_experts) + (m.num_layers - moe_layers) * b.dense_mlp
    common = b.embedding + b.output + b.final_norm + m.num_layers * per_layer + always
    return common + moe_layers * m.num_experts * b.routed_expert, common + moe_layers * m.moe_top_k * b.routed_expert


def mtp_parameters(m: ModelSection) -> int:
    """Parameters of the stored multi-token-prediction layers (DeepSeek-V3's `model.layers.61`), carried, not
    trained: each a decoder layer like the last one plus its own embedding and output head (stored, not shared),
    the projection of [embedding; hidden] (2h -> h) and three norms (enorm, hnorm, the head's)."""
    if not m.num_mtp_layers:
        return 0
    b = parameter_breakdown(m)
    layer = b.attention_split + b.attention_whole + b.attention_norms + b.layer_norms
    if m.is_moe:
        layer += b.router + b.expert_bias + b.shared_experts + m.num_experts * b.routed_expert
    else:
        layer += b.dense_mlp
    h = m.hidden_size
    return m.num_mtp_layers * (layer + 2 * m.vocab_size * h + 2 * h * h + 3 * h)


def routed_expert_parameters(m: ModelSection) -> int:
    """Parameters of all routed experts of all MoE layers (what expert parallelism shards)."""
    return len(m.moe_layers) * m.num_experts * parameter_breakdown(m).routed_expert


def engine_weight_bytes_per_device(m: ModelSection, p: EngineParallelismSection, dtype: str) -> int:
    """Weights on one device of an engine, spread evenly: everything is split over tp and pp, and the routed
    experts over ep = tp x dp instead of tp with expert parallelism. A lower bound (layers vLLM replicates over
    tp, such as norms or MLA's latent projections, and the embeddings of the first and last stage, weigh more)."""
    experts = routed_expert_parameters(m)
    common = parameter_counts(m)[0] - experts
    expert_split = p.ep if p.enable_expert_parallel else p.tp
    common_bytes, expert_bytes = WEIGHT_BYTES[dtype]
    return int(common // (p.tp * p.pp) * common_bytes + experts // (expert_split * p.pp) * expert_bytes)


def kv_bytes_per_token_per_device(m: ModelSection, p: EngineParallelismSection, dtype: str) -> int:
    """KV-cache bytes one token takes on one device of an engine: its stage's layers; a tensor-parallel rank
    keeps its share of the KV heads (at least one, which vLLM replicates when tp exceeds them); MLA's latent
    (kv_lora_rank + qk_rope_head_dim per layer) is the same on every tensor-parallel rank."""
    layers = -(-m.num_layers // p.pp)
    if m.family == "deepseek_v3":
        per_layer = m.kv_lora_rank + m.qk_rope_head_dim
    else:
        per_layer = 2 * max(m.num_kv_heads // p.tp, 1) * m.head_dim
    return layers * per_layer * (4 if dtype == "float32" else 2)  # quantized formats keep a bf16 KV cache
