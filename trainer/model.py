"""The model provider: one definition of each family as a Megatron-Core GPTModel.

`build_model(model_section, parallelism)` gives a GPTModel whose forward equals transformers' forward for
the same HF checkpoint (Qwen3-MoE: RMSNorm, QK-norm, GQA, RoPE, SwiGLU experts behind a softmax top-k router;
Llama: the dense counterpart). `model_section_from_hf(hf_dir)` reads an HF config.json into a ModelSection and
`hf_config_from_model_section` writes one back. Anything the provider does not implement is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.checks import split_problems
from recipes.errors import UserError
from recipes.schema import ARCHITECTURE_FIELDS, ModelSection, ParallelismSection

HF_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}


# --- HF config <-> ModelSection ------------------------------------------------------------------


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir)
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path}: not an HF checkpoint (no config.json)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{config_file}: invalid JSON ({e.msg} at line {e.lineno})") from None


def model_section_from_hf(hf_dir: str | Path, dtype: str = "float32") -> ModelSection:
    """The ModelSection equal to the HF checkpoint at `hf_dir`; refuses what Megatron would build differently."""
    cfg = read_hf_config(hf_dir)
    where = Path(hf_dir) / "config.json"
    family = cfg.get("model_type")
    if family not in HF_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in HF_ARCHITECTURES.items())
        raise UserError(f"{where}: model_type {family!r} is not supported; supported: {supported}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    refused = {
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
        "rope_parameters.rope_type": rope.get("rope_type", rope.get("type", "default")) != "default",
        "use_sliding_window": bool(cfg.get("use_sliding_window", False)),
        "decoder_sparse_step": cfg.get("decoder_sparse_step", 1) != 1,
        "mlp_only_layers": bool(cfg.get("mlp_only_layers")),
    }
    bad = [k for k, is_bad in refused.items() if is_bad]
    if bad:
        raise UserError(f"{where}: unsupported setting(s) for the Megatron provider: {', '.join(bad)}")
    required = ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings"]
    required += ["num_experts_per_tok", "moe_intermediate_size"] if family == "qwen3_moe" else ["intermediate_size"]
    absent = [key for key in required if key not in cfg]
    if family == "qwen3_moe" and "num_experts" not in cfg and "num_local_experts" not in cfg:
        absent.append("num_experts")
    if absent:
        raise UserError(f"{where}: missing key(s) for a {family} model: {', '.join(absent)}")
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
    else:
        fields.update(ffn_hidden_size=cfg["intermediate_size"])
    return ModelSection(**fields)


def check_matches_checkpoint(m: ModelSection, hf_dir: str | Path) -> None:
    """Refuse a recipe model section that describes a different architecture than the checkpoint's config.json."""
    found = model_section_from_hf(hf_dir)
    differences = [
        f"model.{key}: recipe {getattr(m, key)!r}, checkpoint {getattr(found, key)!r}"
        for key in ARCHITECTURE_FIELDS
        if getattr(m, key) != getattr(found, key)
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
    else:
        fields.update(intermediate_size=m.ffn_hidden_size, mlp_bias=False)
    return AutoConfig.for_model(m.family, **fields).to_dict()


# --- Megatron model ---------------------------------------------------------------------------------


def check_supported(m: ModelSection, p: ParallelismSection) -> None:
    """Refuse what this provider does not build, and sizes the model cannot be split by."""
    problems = []
    if m.num_shared_experts:
        problems.append("model.num_shared_experts > 0: shared experts are not mapped by the provider")
    if p.pp > 1:
        problems.append(f"parallelism.pp={p.pp}: pipeline parallelism is not wired; use pp=1")
    if p.cp > 1:
        problems.append(f"parallelism.cp={p.cp}: context parallelism is not wired; use cp=1")
    if m.num_attention_heads % m.num_kv_heads:
        problems.append(f"model.num_kv_heads={m.num_kv_heads} does not divide model.num_attention_heads={m.num_attention_heads}")
    problems += [str(problem) for problem in split_problems(m, p)]
    if problems:
        raise UserError("model cannot be built: " + "; ".join(problems))


def transformer_config(m: ModelSection, p: ParallelismSection, recompute_activations: bool = False):
    from megatron.core.transformer import TransformerConfig

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
            moe_grouped_gemm=False,
            moe_enable_routing_replay=True,
        )
        if m.is_moe
        else {}
    )
    # full recompute of every layer in backward (train.recompute_activations); routers then run twice per step
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute_activations else {}
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_kv_heads,
        kv_channels=m.head_dim,
        ffn_hidden_size=m.moe_ffn_hidden_size if m.is_moe else m.ffn_hidden_size,
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
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        **moe,
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


def layer_block_spec(m: ModelSection):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(
        num_experts=m.num_experts if m.is_moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=m.family == "qwen3_moe",
        normalization="RMSNorm",
    )
    layer = spec.submodules
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    if m.family == "qwen3_moe":
        layer.self_attention.submodules.q_layernorm = RMSNorm
        layer.self_attention.submodules.k_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * m.num_layers, layer_norm=RMSNorm)


def build_model(m: ModelSection, p: ParallelismSection, recompute_activations: bool = False):
    """A GPTModel for this rank; torch.distributed and Megatron's parallel state must be initialised.

    MoE routers have replay enabled (megatron.core.transformer.moe.router_replay): `trainer.router_replay.routing`
    drives this model's own routers; Megatron's static RouterReplay API acts on the newest MoE model built.
    `recompute_activations` recomputes every layer in backward (train.recompute_activations).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from trainer.cpu_compat import apply_cpu_patches, define_missing_transformer_engine_names

    apply_cpu_patches()
    define_missing_transformer_engine_names()
    check_supported(m, p)
    if m.is_moe:
        # Router-replay instances are process-global: the newest MoE model becomes the one recorded and replayed.
        RouterReplay.clear_global_router_replay_instances()
    model = GPTModel(
        config=transformer_config(m, p, recompute_activations),
        transformer_layer_spec=layer_block_spec(m),
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=m.rope_theta,
        share_embeddings_and_output_weights=m.tie_word_embeddings,
        pre_process=True,
        post_process=True,
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
    return model


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked); passed explicitly since its default is built on CUDA."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, vocab] of `tokens` [batch, seq] (gathered over tensor parallelism)."""
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=tokens.device).expand(batch, seq)
    return model(tokens, position_ids, causal_mask(seq, tokens.device), runtime_gather_output=True)
