"""The model provider: one definition of each family as a Megatron-Core GPTModel.

`build_model(model_section, parallelism)` gives a GPTModel whose forward equals transformers' forward for
the same HF checkpoint (Qwen3-MoE: RMSNorm, QK-norm, GQA, RoPE, SwiGLU experts behind a softmax top-k router;
Llama: the dense counterpart; DeepSeek-V3 / Kimi-K2: multi-head latent attention, dense first layers, routed and
shared experts behind a sigmoid router with expert bias and group-limited top-k), or this pipeline stage's part.
`model_section_from_hf(hf_dir)` reads an HF config.json into a ModelSection and
`hf_config_from_model_section` writes one back. Anything the provider does not implement is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import ValidationError

from recipes.checks import model_problems, split_problems
from recipes.errors import UserError
from recipes.schema import ARCHITECTURE_FIELDS, ModelSection, ParallelismSection
from trainer.kernels import KernelChoice, grouped_gemm_experts, resolve_kernels, sdp_attention

HF_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


# --- HF config <-> ModelSection ------------------------------------------------------------------


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir)
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path}: not an HF checkpoint (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{config_file}: invalid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{config_file}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    return config


def model_section_from_hf(hf_dir: str | Path, dtype: str = "float32", unbuilt: list[str] | None = None) -> ModelSection:
    """The ModelSection equal to the HF checkpoint at `hf_dir`; refuses what Megatron would build differently.

    With `unbuilt` (a list), settings the provider does not build are appended to it instead of refused: the
    section then describes the checkpoint's shape (for `composer model info`), not a model the provider builds.
    """
    cfg = read_hf_config(hf_dir)
    where = Path(hf_dir) / "config.json"
    family = cfg.get("model_type")
    if not isinstance(family, str) or family not in HF_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in HF_ARCHITECTURES.items())
        raise UserError(f"{where}: model_type {family!r} is not supported; supported: {supported}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{where}: rope_parameters: expected an object, got {type(rope).__name__}")
    refused = {
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
        "rope_parameters.rope_type": rope.get("rope_type", rope.get("type", "default")) != "default",
        "use_sliding_window": bool(cfg.get("use_sliding_window", False)),
        "decoder_sparse_step": cfg.get("decoder_sparse_step", 1) != 1,
        "mlp_only_layers": bool(cfg.get("mlp_only_layers")),
    }
    if family == "deepseek_v3":
        refused.update(_deepseek_v3_refusals(cfg))
    bad = [k for k, is_bad in refused.items() if is_bad]
    if bad and unbuilt is not None:
        unbuilt += bad
    elif bad:
        raise UserError(f"{where}: unsupported setting(s) for the Megatron provider: {', '.join(bad)}")
    required = ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings"]
    required += {
        "qwen3_moe": ["num_experts_per_tok", "moe_intermediate_size"],
        "llama": ["intermediate_size"],
        "deepseek_v3": list(DEEPSEEK_V3_REQUIRED),
    }[family]
    absent = [key for key in required if key not in cfg]
    if family == "qwen3_moe" and "num_experts" not in cfg and "num_local_experts" not in cfg:
        absent.append("num_experts")
    if absent:
        raise UserError(f"{where}: missing key(s) for a {family} model: {', '.join(absent)}")
    try:
        return ModelSection(**_model_fields(cfg, family, rope, hf_dir, dtype))
    except ValidationError as e:
        error = e.errors()[0]
        raise UserError(f"{where}: {'.'.join(map(str, error['loc']))}: {error['msg']}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{where}: a value has the wrong type ({e})") from None


def _model_fields(cfg: dict, family: str, rope: dict, hf_dir, dtype: str) -> dict:
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    heads = cfg["num_attention_heads"]
    fields = dict(
        family=family,
        checkpoint=str(hf_dir),
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rope_theta=float(rope_theta),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype,
    )
    if family == "qwen3_moe":
        fields.update(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
            moe_top_k=cfg["num_experts_per_tok"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            moe_aux_loss_coeff=cfg.get("router_aux_loss_coef", 1e-3),
        )
    elif family == "deepseek_v3":
        fields.update(
            num_kv_heads=heads,
            head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
            ffn_hidden_size=cfg["intermediate_size"] if cfg["first_k_dense_replace"] else 0,
            num_experts=cfg["n_routed_experts"],
            moe_top_k=cfg["num_experts_per_tok"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            num_shared_experts=cfg["n_shared_experts"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            first_k_dense=cfg["first_k_dense_replace"],
            moe_router_groups=cfg.get("n_group") or 1,
            moe_router_group_top_k=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )
    else:
        fields.update(ffn_hidden_size=cfg["intermediate_size"])
    return fields


DEEPSEEK_V3_REQUIRED = (
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "intermediate_size",
)


def _deepseek_v3_refusals(cfg: dict) -> dict[str, bool]:
    """DeepseekV3 settings the provider would compute differently (real DeepSeek-V3 / Kimi-K2 configs pass)."""
    return {
        "scoring_func (only sigmoid)": cfg.get("scoring_func", "sigmoid") != "sigmoid",
        "topk_method (only noaux_tc)": cfg.get("topk_method", "noaux_tc") != "noaux_tc",
        "rope_interleave (only true: the layout vLLM and Megatron's MLA apply)": cfg.get("rope_interleave", True) is not True,
        "moe_layer_freq (only 1)": cfg.get("moe_layer_freq", 1) != 1,
        "num_nextn_predict_layers (multi-token prediction is not built)": bool(cfg.get("num_nextn_predict_layers", 0)),
        "ep_size": cfg.get("ep_size", 1) != 1,
    }


def parameter_counts(m: ModelSection) -> tuple[int, int]:
    """(total, active per token) parameters of architecture `m`: embeddings and every layer; active counts only
    moe_top_k of each MoE layer's routed experts (routers and shared experts always run)."""
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
    expert = 3 * h * m.moe_ffn_hidden_size
    common = m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + h + m.num_layers * per_layer + dense + always
    return common + moe_layers * m.num_experts * expert, common + moe_layers * m.moe_top_k * expert


def check_matches_checkpoint(m: ModelSection, hf_dir: str | Path) -> None:
    """Refuse a recipe model section that describes a different architecture than the checkpoint's config.json."""
    found = model_section_from_hf(hf_dir)
    differences = [
        f"model.{key}: recipe {getattr(m, key)!r}, checkpoint {getattr(found, key)!r}"
        for key in ARCHITECTURE_FIELDS
        if getattr(m, key) != getattr(found, key) and not (key == "rope_theta" and m.rescale_rope)
    ]
    if differences:
        raise UserError(f"{hf_dir}: the recipe's model section does not match config.json: " + "; ".join(differences))


def hf_config_from_model_section(m: ModelSection, dtype: torch.dtype, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """config.json content for `m`, as transformers itself writes it (vLLM and AutoModel read it)."""
    from transformers import AutoConfig

    fields = dict(
        architectures=[HF_ARCHITECTURES[m.family]],
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        hidden_act="silu",
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=m.tie_word_embeddings,
        attention_bias=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        dtype=str(dtype).removeprefix("torch."),
    )
    if m.family == "qwen3_moe":
        fields.update(
            intermediate_size=m.moe_ffn_hidden_size,
            moe_intermediate_size=m.moe_ffn_hidden_size,
            num_experts=m.num_experts,
            num_experts_per_tok=m.moe_top_k,
            norm_topk_prob=m.norm_topk_prob,
            router_aux_loss_coef=m.moe_aux_loss_coeff,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif m.family == "deepseek_v3":
        fields.update(
            num_key_value_heads=m.num_attention_heads,
            intermediate_size=m.ffn_hidden_size or m.moe_ffn_hidden_size,
            moe_intermediate_size=m.moe_ffn_hidden_size,
            n_routed_experts=m.num_experts,
            n_shared_experts=m.num_shared_experts,
            num_experts_per_tok=m.moe_top_k,
            norm_topk_prob=m.norm_topk_prob,
            routed_scaling_factor=m.routed_scaling_factor,
            n_group=m.moe_router_groups,
            topk_group=m.moe_router_group_top_k,
            first_k_dense_replace=m.first_k_dense,
            q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim,
            rope_interleave=True,
            num_nextn_predict_layers=0,
        )
        del fields["head_dim"]  # DeepseekV3Config derives it (= qk_rope_head_dim)
    else:
        fields.update(intermediate_size=m.ffn_hidden_size, mlp_bias=False)
    config = AutoConfig.for_model(m.family, **fields).to_dict()
    if m.family == "deepseek_v3":
        # transformers omits these; vLLM builds no expert bias without noaux_tc (real checkpoints carry both)
        config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    return config


# --- Megatron model ---------------------------------------------------------------------------------


def check_supported(m: ModelSection, p: ParallelismSection) -> None:
    """Refuse what this provider does not build, and sizes the model cannot be split by."""
    problems = []
    if m.num_shared_experts and m.family != "deepseek_v3":
        problems.append(f"model.num_shared_experts > 0: shared experts are built for family deepseek_v3 only, not {m.family}")
    if p.pp > 1 and m.tie_word_embeddings:
        problems.append(f"parallelism.pp={p.pp}: tied embeddings across pipeline stages are not built; use pp=1 or untied embeddings")
    if p.cp > 1 and m.kernels.attention == "local":
        problems.append(f"parallelism.cp={p.cp}: context parallelism runs in model.kernels.attention sdpa (or auto), not local")
    if m.num_attention_heads % m.num_kv_heads:
        problems.append(f"model.num_kv_heads={m.num_kv_heads} does not divide model.num_attention_heads={m.num_attention_heads}")
    problems += [str(problem) for problem in split_problems(m, p)]
    problems += [str(problem) for problem in model_problems(m)]
    if problems:
        raise UserError("model cannot be built: " + "; ".join(problems))


def _deepseek_v3_config(m: ModelSection) -> dict:
    """MLA with plain (interleaved-pair) RoPE, DeepSeek's sigmoid router with expert bias, shared experts."""
    return dict(
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        kv_channels=m.v_head_dim,
        rope_type="rope",
        rotary_base=m.rope_theta,
        rotary_scaling_factor=1.0,  # no YaRN: softmax scale 1/sqrt(qk head dim), as HF without rope scaling
        mscale_all_dim=0.0,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_router_num_groups=m.moe_router_groups if m.moe_router_groups > 1 else None,
        moe_router_group_topk=m.moe_router_group_top_k if m.moe_router_groups > 1 else None,
        moe_router_topk_scaling_factor=m.routed_scaling_factor,
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_router_dtype="fp32",  # HF and vLLM score DeepSeek routers in fp32
        moe_shared_expert_intermediate_size=m.moe_ffn_hidden_size * m.num_shared_experts,
        moe_layer_freq=[0] * m.first_k_dense + [1] * (m.num_layers - m.first_k_dense),
    )


def transformer_config(m: ModelSection, p: ParallelismSection, recompute_activations: bool = False):
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    dtype = getattr(torch, m.dtype)
    moe = (
        dict(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.moe_top_k,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size,
            moe_router_score_function="softmax",
            # softmax over the top-k logits == softmax over all, top-k, renormalise (HF norm_topk_prob)
            moe_router_pre_softmax=not m.norm_topk_prob,
            moe_router_topk_scaling_factor=None,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_token_dispatcher_type=m.moe_token_dispatcher,
            moe_grouped_gemm=False,  # selects Megatron's TE / grouped_gemm experts; model.kernels picks ours in the spec
            moe_enable_routing_replay=True,
        )
        if m.is_moe
        else {}
    )
    # full recompute of every layer in backward (train.recompute_activations); routers then run twice per step
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute_activations else {}
    if m.family == "deepseek_v3":
        moe.update(_deepseek_v3_config(m))
    config_class = MLATransformerConfig if m.family == "deepseek_v3" else TransformerConfig
    return config_class(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_kv_heads,
        ffn_hidden_size=m.moe_ffn_hidden_size if m.is_moe and not m.first_k_dense else m.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=m.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=m.family == "qwen3_moe",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        pipeline_dtype=dtype,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        **{"kv_channels": m.head_dim, **moe},
        **recompute,
    )


class RMSNorm(torch.nn.Module):
    """RMSNorm computed as HF does (fp32 statistics, weight applied in the input dtype).

    Megatron's torch-only norm refuses sequence parallelism, which MoE with tp > 1 requires; marking the
    weight `sequence_parallel` makes finalize_model_grads sum its gradient over the tensor-parallel group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _mla_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """Megatron's local attention for MLA, whose keys (nope + rope) are wider than its values.

        MLA passes `k_channels`/`v_channels`, which only Transformer Engine's attention takes in 0.16.1; the local
        one computes the same from the shapes it gets, with MLA's softmax scale passed explicitly and the output
        width from kv_channels (= v_head_dim here).
        """

        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
            super().__init__(*args, **kwargs)

    return MLADotProductAttention


def _layer_spec(m: ModelSection, moe: bool, kernels: KernelChoice):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mla = m.family == "deepseek_v3"
    spec = get_gpt_layer_local_spec(
        num_experts=m.num_experts if moe else None,
        moe_grouped_gemm=False,  # Megatron's grouped experts need TE or grouped_gemm; ours replace SequentialMLP below
        qk_layernorm=m.family == "qwen3_moe",
        multi_latent_attention=mla,
        normalization="RMSNorm",
    )
    layer = spec.submodules
    if moe and kernels.experts == "grouped":
        layer.mlp.submodules.experts.module = grouped_gemm_experts()
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    attention = layer.self_attention.submodules
    if m.family == "qwen3_moe":
        attention.q_layernorm = RMSNorm
        attention.k_layernorm = RMSNorm
    if not mla and kernels.attention == "sdpa":
        attention.core_attention = sdp_attention()
    if mla:
        from megatron.core.post_training.modelopt.layers import Linear

        # the norms of the compressed query and key/value latents (HF q_a_layernorm, kv_a_layernorm)
        attention.q_layernorm = RMSNorm
        attention.kv_layernorm = RMSNorm
        attention.core_attention = _mla_core_attention() if kernels.attention == "local" else sdp_attention()
        # Down-projections replicated over tensor parallelism, as with Transformer Engine. Split column-wise (the
        # local spec), MLA's backward never sums the shared RoPE key's gradient over the tensor-parallel heads:
        # measured, tp=2 moved kv_a_proj_with_mqa differently from tp=1 (loss after one step off by 1.4e-3).
        attention.linear_q_down_proj = Linear
        attention.linear_kv_down_proj = Linear
    return spec


def layer_block_spec(m: ModelSection, config, kernels: KernelChoice):
    """The layers this pipeline stage builds: dense ones for the first first_k_dense layers, MoE after."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    specs = {moe: _layer_spec(m, moe, kernels) for moe in ({m.is_moe, False} if m.first_k_dense else {m.is_moe})}
    everything = [specs[m.is_moe and layer >= m.first_k_dense] for layer in range(m.num_layers)]
    offset = get_transformer_layer_offset(config)
    return TransformerBlockSubmodules(layer_specs=everything[offset : offset + get_num_layers_to_build(config)], layer_norm=RMSNorm)


def build_model(m: ModelSection, p: ParallelismSection, recompute_activations: bool = False):
    """A GPTModel for this rank; torch.distributed and Megatron's parallel state must be initialised.

    MoE routers have replay enabled (megatron.core.transformer.moe.router_replay): `trainer.router_replay.routing`
    drives this model's own routers; Megatron's static RouterReplay API acts on the newest MoE model built.
    `recompute_activations` recomputes every layer in backward (train.recompute_activations).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from trainer.cpu_compat import apply_cpu_patches, define_missing_transformer_engine_names, fix_expert_bias_padding

    apply_cpu_patches()
    define_missing_transformer_engine_names()
    fix_expert_bias_padding()
    check_supported(m, p)
    if m.is_moe:
        # Router-replay instances are process-global: the newest MoE model becomes the one recorded and replayed.
        RouterReplay.clear_global_router_replay_instances()
    config = transformer_config(m, p, recompute_activations)
    kernels = resolve_kernels(m.kernels, config.params_dtype, "cuda" if torch.cuda.is_available() else "cpu")
    _log_kernels_once(m, kernels)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_block_spec(m, config, kernels),
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=m.rope_theta,
        share_embeddings_and_output_weights=m.tie_word_embeddings,
        # pipeline stages: the first holds the embedding, the last the final norm and output layer
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    if m.is_moe and p.ep == 1:
        # Megatron marks expert weights as expert-parallel only when ep > 1, so with ep=1 its DDP reduces them over
        # the dense data-parallel group. With etp < tp the tensor-parallel peers route different tokens through
        # the same experts, and those gradients must also be summed: the expert data-parallel group does that.
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.allreduce = False
    if torch.cuda.is_available():
        model.cuda()
    model.kernels = kernels
    return model


_logged_kernels: set[tuple] = set()


def _log_kernels_once(m: ModelSection, kernels: KernelChoice) -> None:
    """One line per process and choice (a frozen reference copy builds the same model again)."""
    key = (m.kernels.experts, m.kernels.attention, kernels)
    if key in _logged_kernels or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    _logged_kernels.add(key)
    experts = f"experts={kernels.experts} (asked {m.kernels.experts})" if m.is_moe else "experts=none (dense)"
    print(f"model kernels: {experts}, attention={kernels.attention} (asked {m.kernels.attention})", flush=True)


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked); passed explicitly since its default is built on CUDA."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, vocab] of `tokens` [batch, seq] (gathered over tensor parallelism)."""
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=tokens.device).expand(batch, seq)
    return model(tokens, position_ids, causal_mask(seq, tokens.device), runtime_gather_output=True)
