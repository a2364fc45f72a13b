"""Sizes of a model from its recipe section: parameters, and what one device of a vLLM engine holds.

Pure arithmetic on the schema, so recipes are checked (and `--dry-run` plans printed) without torch or vLLM.
"""

from __future__ import annotations

from recipes.schema import EngineParallelismSection, ModelSection

WEIGHT_BYTES = {"float32": (4, 4), "bfloat16": (2, 2), "fp8": (1, 1), "int4": (2, 0.5)}
"""Bytes per parameter (outside the routed experts, of a routed expert) of each rollout.dtype: fp8 quantizes every
linear, int4 the routed experts only (their scales and the bf16 embeddings and norms left out: a lower bound)."""


def sized_dtype(dtype: str, kind: str | None) -> str:
    """`rollout.dtype` for sizing before the machine decides `auto`: bfloat16 on GPUs, float32 on CPUs or unknown
    devices (the larger of the two it may become there)."""
    return ("bfloat16" if kind == "gpu" else "float32") if dtype == "auto" else dtype


def parameter_counts(m: ModelSection) -> tuple[int, int]:
    """(total, active per token) parameters of architecture `m`: embeddings and every layer; active counts only
    moe_top_k of each MoE layer's routed experts (routers and shared experts always run)."""
    common, expert = _common_and_expert(m)
    moe_layers = len(m.moe_layers)
    return common + moe_layers * m.num_experts * expert, common + moe_layers * m.moe_top_k * expert


def routed_expert_parameters(m: ModelSection) -> int:
    """Parameters of all routed experts of all MoE layers (what expert parallelism shards)."""
    return len(m.moe_layers) * m.num_experts * _common_and_expert(m)[1]


def _common_and_expert(m: ModelSection) -> tuple[int, int]:
    """(parameters outside the routed experts, parameters of one routed expert)."""
    h = m.hidden_size
    if m.family == "deepseek_v3":
        q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        query = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.num_attention_heads * q_head if m.q_lora_rank else h * m.num_attention_heads * q_head
        key_value = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
        attention = query + key_value + m.num_attention_heads * m.v_head_dim * h
    else:
        attention = h * m.head_dim * (2 * m.num_attention_heads + 2 * m.num_kv_heads) + (2 * m.head_dim if m.family == "qwen3_moe" else 0)
    per_layer = attention + 2 * h  # + input and pre-MLP norms
    moe_layers = len(m.moe_layers)
    dense = (m.num_layers - moe_layers) * 3 * h * m.ffn_hidden_size
    router = m.num_experts * h + (m.num_experts if m.family == "deepseek_v3" else 0)  # + expert bias
    always = moe_layers * (router + 3 * h * m.moe_ffn_hidden_size * m.num_shared_experts)
    common = m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + h + m.num_layers * per_layer + dense + always
    return common, 3 * h * m.moe_ffn_hidden_size


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
