"""What an HF checkpoint's config.json says, read without torch (recipe checks before launch, `composer model info`).

Families: `qwen3_moe`, `llama` and `deepseek_v3`, which also covers the published names of its checkpoints:
`kimi_k2` (Kimi-K2: DeepSeek-V3 under Kimi's name) and `kimi_k25` (Kimi-K2.5: a multimodal wrapper whose
`text_config` is the DeepSeek-V3 language model composer trains; its vision tower and projector are carried).
`quantization_config` may say block fp8 (DeepSeek-V3, Kimi-K2) or compressed-tensors INT4 (Kimi-K2-Thinking, K2.5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from composer.recipes.errors import UserError
from composer.recipes.schema import ARCHITECTURE_FIELDS, ModelSection

FAMILIES = {"qwen3_moe": "qwen3_moe", "llama": "llama", "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "kimi_k25": "deepseek_v3"}
"""config.json model_type -> the family composer builds it as."""
HF_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
WRAPPED_LANGUAGE_MODEL = {"kimi_k25": "language_model."}
"""Multimodal wrappers: the prefix of their language model's tensor names (the rest is carried, never trained)."""


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


def language_config(cfg: dict, where: Path) -> dict:
    """The config of the language model: `text_config` of a multimodal wrapper, else the config itself."""
    model_type = cfg.get("model_type")
    if model_type not in WRAPPED_LANGUAGE_MODEL:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UserError(
            f"{where}: model_type {model_type} wraps a language model, but text_config is "
            f"{'missing' if text is None else 'not an object'}; a {model_type} config.json holds it there"
        )
    if FAMILIES.get(text.get("model_type", "deepseek_v3")) != "deepseek_v3":
        raise UserError(f"{where}: text_config.model_type {text.get('model_type')!r}: {model_type} wraps a DeepSeek-V3 language model")
    return text


# --- quantization_config ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantization:
    """How the checkpoint's quantized weights are stored."""

    method: Literal["fp8", "int4"]
    """`fp8`: e4m3 weights, one fp32 `weight_scale_inv` per block; `int4`: compressed-tensors pack-quantized
    (`weight_packed` int32 with 8 codes each, `weight_scale` per group, `weight_shape`), symmetric."""
    block: tuple[int, int] = (128, 128)
    """fp8: rows x columns sharing one scale."""
    group_size: int = 32
    """int4: consecutive input channels sharing one scale."""
    scale_fmt: Literal["float32", "ue8m0"] = "float32"
    """fp8: `ue8m0` (DeepSeek-V3.1): every scale a power of two, stored as F32; fresh scales are rounded up to one."""

    def describe(self) -> str:
        if self.method == "fp8":
            powers = ", ue8m0: powers of two" if self.scale_fmt == "ue8m0" else ""
            return f"fp8 e4m3 blocks {self.block[0]}x{self.block[1]} (weight_scale_inv{powers})"
        return f"INT4 compressed-tensors pack-quantized, symmetric, group {self.group_size}"


SUPPORTED_QUANTIZATION = "fp8 (block e4m3 with weight_scale_inv) and compressed-tensors (pack-quantized symmetric INT4 groups)"


def quantization_config(cfg: dict) -> tuple[str, dict | None]:
    """(key path, quantization_config) of the config: at the top, or in a wrapper's text_config."""
    if cfg.get("quantization_config") is not None or not isinstance(cfg.get("text_config"), dict):
        return "quantization_config", cfg.get("quantization_config")
    return "text_config.quantization_config", cfg["text_config"].get("quantization_config")


def parse_quantization(cfg: dict, where: Path) -> Quantization | None:
    """The checkpoint's weight format; refuses, naming the key, what composer cannot read or write back."""
    key, qc = quantization_config(cfg)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UserError(f"{where}: {key}: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc, key, where)
    if method == "compressed-tensors":
        return _int4(qc, key, where)
    raise UserError(f"{where}: {key}.quant_method {method!r} is not supported; supported: {SUPPORTED_QUANTIZATION}")


def _fp8(qc: dict, key: str, where: Path) -> Quantization:
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UserError(f"{where}: {key}.weight_block_size {block!r}: block fp8 needs [rows, columns] (per-tensor fp8 is not supported)")
    refused = {
        "fmt": qc.get("fmt", "e4m3") != "e4m3",
        "activation_scheme": qc.get("activation_scheme", "dynamic") != "dynamic",
        "scale_fmt": qc.get("scale_fmt") not in (None, "float32", "ue8m0"),
    }
    bad = [f"{key}.{k} {qc.get(k)!r}" for k, is_bad in refused.items() if is_bad]
    if bad:
        raise UserError(
            f"{where}: not supported for fp8 checkpoints: {', '.join(bad)} (supported: e4m3 weights, fp32 block scales "
            "(scale_fmt float32 or ue8m0), dynamic activations)"
        )
    return Quantization("fp8", block=(block[0], block[1]), scale_fmt=qc.get("scale_fmt") or "float32")


def _int4(qc: dict, key: str, where: Path) -> Quantization:
    if qc.get("format") != "pack-quantized":
        raise UserError(
            f"{where}: {key}.format {qc.get('format')!r} is not supported; compressed-tensors checkpoints in pack-quantized only"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UserError(f"{where}: {key}.config_groups: expected the quantization scheme(s), got {groups!r}")
    wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    sizes = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise UserError(f"{where}: {key}.config_groups.{name}.weights: expected an object")
        bad = [f"{k} {weights.get(k)!r} (needs {v!r})" for k, v in wanted.items() if weights.get(k) != v]
        bad += [f"{k} {weights.get(k)!r}" for k in ("actorder", "dynamic") if weights.get(k) not in (None, False)]
        bad += [f"{k} (weight-only INT4 has none)" for k in ("input_activations", "output_activations") if group.get(k) is not None]
        if bad:
            raise UserError(f"{where}: {key}.config_groups.{name}: not supported: {', '.join(bad)}")
        sizes.add(weights.get("group_size"))
    if len(sizes) != 1 or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise UserError(f"{where}: {key}.config_groups: group_size {sorted(map(str, sizes))}: one positive group size for all groups")
    return Quantization("int4", group_size=sizes.pop())


# --- config.json -> ModelSection ----------------------------------------------------------------------


def model_section_from_hf(hf_dir: str | Path, dtype: str = "float32", unbuilt: list[str] | None = None) -> ModelSection:
    """The ModelSection equal to the HF checkpoint at `hf_dir`; refuses what Megatron would build differently.

    With `unbuilt` (a list), settings the provider does not build are appended to it instead of refused: the
    section then describes the checkpoint's shape (for `composer model info`), not a model the provider builds.
    """
    top = read_hf_config(hf_dir)
    where = Path(hf_dir) / "config.json"
    model_type = top.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        supported = ", ".join(f"{k} ({HF_ARCHITECTURES[v]})" for k, v in FAMILIES.items())
        raise UserError(f"{where}: model_type {model_type!r} is not supported; supported: {supported}")
    family = FAMILIES[model_type]
    cfg = language_config(top, where)
    rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise UserError(f"{where}: {rope_key}: expected an object, got {type(rope).__name__}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    type_key = f"{rope_key}.{'rope_type' if 'rope_type' in rope else 'type'}"
    refused = {
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
        f"{type_key} {rope_type!r} (default, and yarn for deepseek_v3)": rope_type not in ("default", "yarn")
        or (rope_type == "yarn" and family != "deepseek_v3"),
        "use_sliding_window": bool(cfg.get("use_sliding_window", False)),
        "decoder_sparse_step": cfg.get("decoder_sparse_step", 1) != 1,
        "mlp_only_layers": bool(cfg.get("mlp_only_layers")),
    }
    if rope_type == "yarn":
        refused.update(_yarn_refusals(rope, rope_key))
    if family == "deepseek_v3":
        refused.update(_deepseek_v3_refusals(cfg))
    try:
        parse_quantization(top, where)
    except UserError as e:
        if unbuilt is None:
            raise
        unbuilt.append(str(e).removeprefix(f"{where}: "))
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
    if rope_type == "yarn":
        absent += [f"{rope_key}.{key}" for key in ("factor", "original_max_position_embeddings") if rope.get(key) is None]
    if absent:
        raise UserError(f"{where}: missing key(s) for a {model_type} model: {', '.join(absent)}")
    try:
        fields = _model_fields(cfg, family, rope, hf_dir, dtype)
        if rope_type == "yarn" and family == "deepseek_v3":
            fields["yarn"] = _yarn_fields(rope)
        return ModelSection(**fields)
    except ValidationError as e:
        error = e.errors()[0]
        raise UserError(f"{where}: {'.'.join(map(str, error['loc']))}: {error['msg']}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{where}: a value has the wrong type ({e})") from None


def _yarn_refusals(rope: dict, key: str) -> dict[str, bool]:
    """YaRN settings HF computes in ways Megatron's MLA YaRN does not."""
    return {
        f"{key}.attention_factor (derived from factor and mscale only)": rope.get("attention_factor") is not None,
        f"{key}.truncate false (correction range rounded only)": rope.get("truncate", True) is not True,
        # HF takes mscale into the cos/sin factor only together with mscale_all_dim
        f"{key}.mscale without mscale_all_dim": not rope.get("mscale") and bool(rope.get("mscale_all_dim")),
    }


def _yarn_fields(rope: dict) -> dict:
    both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))
    return dict(
        factor=float(rope["factor"]),
        original_max_position_embeddings=rope["original_max_position_embeddings"],
        beta_fast=float(rope.get("beta_fast") or 32),  # HF's defaults, also for a 0 or null
        beta_slow=float(rope.get("beta_slow") or 1),
        # HF's cos/sin factor: mscale over mscale_all_dim when both are set, else plain (mscale 1, nothing below)
        mscale=float(rope["mscale"]) if both else 1.0,
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )


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
            num_mtp_layers=cfg.get("num_nextn_predict_layers") or 0,
        )
    else:
        fields.update(ffn_hidden_size=cfg["intermediate_size"])
    return fields


DEEPSEEK_V3_REQUIRED = (
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense_replace",
    "intermediate_size",
)


def _deepseek_v3_refusals(cfg: dict) -> dict[str, bool]:
    """DeepseekV3 settings the provider would compute differently (real DeepSeek-V3 / Kimi-K2 configs pass)."""
    return {
        "scoring_func (only sigmoid)": cfg.get("scoring_func", "sigmoid") != "sigmoid",
        "topk_method (only noaux_tc)": cfg.get("topk_method", "noaux_tc") != "noaux_tc",
        "rope_interleave (only true: the layout vLLM and Megatron's MLA apply)": cfg.get("rope_interleave", True) is not True,
        "moe_layer_freq (only 1)": cfg.get("moe_layer_freq", 1) != 1,
        "ep_size": cfg.get("ep_size", 1) != 1,
    }


def check_matches_checkpoint(m: ModelSection, hf_dir: str | Path) -> None:
    """Refuse a recipe model section that describes a different architecture than the checkpoint's config.json."""
    found = model_section_from_hf(hf_dir)
    differences = [
        f"model.{key}: recipe {_shown(getattr(m, key))}, checkpoint {_shown(getattr(found, key))}"
        for key in ARCHITECTURE_FIELDS
        if getattr(m, key) != getattr(found, key) and not (key == "rope_theta" and m.rescale_rope)
    ]
    if differences:
        raise UserError(f"{hf_dir}: the recipe's model section does not match config.json: " + "; ".join(differences))


def _shown(value: object) -> str:
    return repr(value.model_dump()) if hasattr(value, "model_dump") else repr(value)
