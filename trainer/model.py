"""The model provider: one definition of each family as a Megatron-Core GPTModel.

`build_model(model_section, parallelism)` gives a GPTModel whose forward equals transformers' forward for
the same HF checkpoint (Qwen3-MoE: RMSNorm, QK-norm, GQA, RoPE, SwiGLU experts behind a softmax top-k router;
Llama: the dense counterpart; DeepSeek-V3 / Kimi-K2: multi-head latent attention, dense first layers, routed and
shared experts behind a sigmoid router with expert bias and group-limited top-k), or this pipeline stage's part.
`hf_config_from_model_section` writes the config.json of a ModelSection (`trainer.hf_config` reads one).
Anything the provider does not implement is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from composer.recipes.checks import model_problems, split_problems
from composer.recipes.errors import UserError
from composer.recipes.schema import ModelSection, ParallelismSection
from composer.trainer.hf_config import HF_ARCHITECTURES
from composer.trainer.kernels import KernelChoice, grouped_gemm_experts, local_attention, resolve_kernels, sdp_attention
from composer.trainer.qk_clip import ALPHA as QK_CLIP_ALPHA


def hf_config_from_model_section(
    m: ModelSection, dtype: torch.dtype, bos_token_id: int | None = None, eos_token_id: int | None = None
) -> dict:
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
        rope_parameters=_rope_parameters(m),
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
            num_nextn_predict_layers=m.num_mtp_layers if m.mtp == "carry" else 0,
        )
        del fields["head_dim"]  # DeepseekV3Config derives it (= qk_rope_head_dim)
    else:
        fields.update(intermediate_size=m.ffn_hidden_size, mlp_bias=False)
    config = AutoConfig.for_model(m.family, **fields).to_dict()
    if m.family == "deepseek_v3":
        # transformers omits these; vLLM builds no expert bias without noaux_tc (real checkpoints carry both)
        config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    return config


def _rope_parameters(m: ModelSection) -> dict:
    if m.yarn is None:
        return {"rope_type": "default", "rope_theta": m.rope_theta}
    return {"rope_type": "yarn", "rope_theta": m.rope_theta, **m.yarn.model_dump()}


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
    """MLA with interleaved-pair RoPE (YaRN-scaled when the checkpoint is), DeepSeek's sigmoid router with expert
    bias, shared experts."""
    # without YaRN: softmax scale 1/sqrt(qk head dim), as HF without rope scaling
    rope = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale_all_dim=0.0)
    if m.yarn is not None:
        # Megatron's MLA YaRN: the same frequency blend, cos/sin factor and softmax scale (mscale_all_dim squared) as HF
        rope = dict(
            rope_type="yarn",
            rotary_scaling_factor=m.yarn.factor,
            original_max_position_embeddings=m.yarn.original_max_position_embeddings,
            beta_fast=m.yarn.beta_fast,
            beta_slow=m.yarn.beta_slow,
            mscale=m.yarn.mscale,
            mscale_all_dim=m.yarn.mscale_all_dim,
        )
    return dict(
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        kv_channels=m.v_head_dim,
        rotary_base=m.rope_theta,
        **rope,
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


def transformer_config(m: ModelSection, p: ParallelismSection, recompute_activations: bool = False, qk_clip: float | None = None):
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
    # the attention modules record their largest logits, trainer.qk_clip clips them after each step
    clipping = dict(qk_clip=True, qk_clip_threshold=qk_clip, qk_clip_alpha=QK_CLIP_ALPHA) if qk_clip is not None else {}
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
        **clipping,
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
    attention.core_attention = sdp_attention() if kernels.attention == "sdpa" else local_attention()
    if mla:
        from megatron.core.post_training.modelopt.layers import Linear

        # the norms of the compressed query and key/value latents (HF q_a_layernorm, kv_a_layernorm)
        attention.q_layernorm = RMSNorm
        attention.kv_layernorm = RMSNorm
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


def build_model(m: ModelSection, p: ParallelismSection, recompute_activations: bool = False, qk_clip: float | None = None):
    """A GPTModel for this rank; torch.distributed and Megatron's parallel state must be initialised.

    MoE routers have replay enabled (megatron.core.transformer.moe.router_replay): `trainer.router_replay.routing`
    drives this model's own routers; Megatron's static RouterReplay API acts on the newest MoE model built.
    `recompute_activations` recomputes every layer in backward (train.recompute_activations); `qk_clip` (a threshold,
    optim.qk_clip) makes attention record its largest logits for trainer.qk_clip.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from composer.trainer.cpu_compat import apply_cpu_patches, define_missing_transformer_engine_names, fix_expert_bias_padding

    apply_cpu_patches()
    define_missing_transformer_engine_names()
    fix_expert_bias_padding()
    check_supported(m, p)
    if m.is_moe:
        # Router-replay instances are process-global: the newest MoE model becomes the one recorded and replayed.
        RouterReplay.clear_global_router_replay_instances()
    config = transformer_config(m, p, recompute_activations, qk_clip)
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
