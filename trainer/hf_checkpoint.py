"""The tensors an HF checkpoint stores, from its safetensors headers alone (no weight is read).

Which file holds each tensor, its dtype and shape; which weights are quantized and in which parts; which tensors
composer carries without training them (multi-token-prediction layers, a multimodal wrapper's vision tower and
projector). `CheckpointLayout.problems` finds, before any rank starts, a truncated shard, missing or unexpected
tensors and scales of the wrong shape. Names are the language model's HF names (`model.layers.3.mlp.gate.weight`,
`lm_head.weight`); `stored` adds a wrapper's prefix (`language_model.`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from composer.recipes.errors import UserError
from composer.recipes.schema import ModelSection
from composer.trainer.hf_config import WRAPPED_LANGUAGE_MODEL, Quantization, parse_quantization, read_hf_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FP8_PARTS = ("weight", "weight_scale_inv")
INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str
    """safetensors dtype: F32, BF16, F8_E4M3, I32, ..."""
    shape: tuple[int, ...]
    offset: int = 0
    """Where its bytes start in the file."""


def _read_header(path: Path) -> dict[str, StoredTensor]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            raw = f.read(length) if length is not None and length <= size else b""
        header = json.loads(raw) if raw and len(raw) == length else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (unreadable header)")
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if size < 8 + length + end:
        raise UserError(f"{path}: truncated ({size} bytes; its header describes {8 + length + end}): download it again")
    return {
        name: StoredTensor(path, entry["dtype"], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0])
        for name, entry in header.items()
    }


def read_stored_tensors(hf_dir: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint's shards (all headers read and checked against the index)."""
    root = Path(hf_dir)
    if not root.is_dir():
        raise UserError(f"{root}: no such checkpoint directory")
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{root / INDEX}: not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE).is_file():
        weight_map, files = None, [SINGLE]
    else:
        raise UserError(f"{root}: no safetensors weights ({SINGLE} or {INDEX})")
    tensors: dict[str, StoredTensor] = {}
    for name in files:
        if not (root / name).is_file():
            raise UserError(f"{root / INDEX}: names shard {name}, which is missing")
        tensors.update(_read_header(root / name))
    if weight_map is not None:
        absent = sorted(n for n, file in weight_map.items() if n not in tensors or tensors[n].file.name != file)
        if absent:
            raise UserError(f"{root / INDEX}: {_listed(absent)} not in the shard the index names")
    return tensors


Dim = tuple[int, str]
"""A dimension the model gives a weight, with the config.json key(s) it comes from."""


def hf_shapes(m: ModelSection) -> list[tuple[re.Pattern, tuple[Dim, ...]]]:
    """(HF name pattern, [rows, columns] or [size]) of every weight of architecture `m`, as its config.json keys
    make them."""
    h, vocab = (m.hidden_size, "hidden_size"), (m.vocab_size, "vocab_size")
    heads = m.num_attention_heads
    norm = (h,)
    table: dict[str, tuple[Dim, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "lm_head.weight": (vocab, h),
        "model.norm.weight": norm,
        r"model.layers.\d+.(input|post_attention)_layernorm.weight": norm,
        r"model.layers.\d+.mlp.(gate|up)_proj.weight": ((m.ffn_hidden_size, "intermediate_size"), h),
        r"model.layers.\d+.mlp.down_proj.weight": (h, (m.ffn_hidden_size, "intermediate_size")),
    }
    if m.is_moe:
        expert = (m.moe_ffn_hidden_size, "moe_intermediate_size")
        experts = (m.num_experts, "n_routed_experts" if m.family == "deepseek_v3" else "num_experts")
        table |= {
            r"model.layers.\d+.mlp.gate.weight": (experts, h),
            r"model.layers.\d+.mlp.gate.e_score_correction_bias": (experts,),
            r"model.layers.\d+.mlp.experts.\d+.(gate|up)_proj.weight": (expert, h),
            r"model.layers.\d+.mlp.experts.\d+.down_proj.weight": (h, expert),
        }
        if m.num_shared_experts:
            shared = (m.moe_ffn_hidden_size * m.num_shared_experts, "moe_intermediate_size x n_shared_experts")
            table |= {
                r"model.layers.\d+.mlp.shared_experts.(gate|up)_proj.weight": (shared, h),
                r"model.layers.\d+.mlp.shared_experts.down_proj.weight": (h, shared),
            }
    a = r"model.layers.\d+.self_attn."
    if m.family == "deepseek_v3":
        q = (heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)")
        kv_lora = (m.kv_lora_rank, "kv_lora_rank")
        table |= {
            a + "kv_a_proj_with_mqa.weight": ((m.kv_lora_rank + m.qk_rope_head_dim, "kv_lora_rank + qk_rope_head_dim"), h),
            a + "kv_a_layernorm.weight": (kv_lora,),
            a + "kv_b_proj.weight": (
                (heads * (m.qk_nope_head_dim + m.v_head_dim), "num_attention_heads x (qk_nope_head_dim + v_head_dim)"),
                kv_lora,
            ),
            a + "o_proj.weight": (h, (heads * m.v_head_dim, "num_attention_heads x v_head_dim")),
        }
        if m.q_lora_rank:
            q_lora = (m.q_lora_rank, "q_lora_rank")
            table |= {a + "q_a_proj.weight": (q_lora, h), a + "q_a_layernorm.weight": (q_lora,), a + "q_b_proj.weight": (q, q_lora)}
        else:
            table[a + "q_proj.weight"] = (q, h)
    else:
        d = (m.head_dim, "head_dim")
        q = (heads * m.head_dim, "num_attention_heads x head_dim")
        kv = (m.num_kv_heads * m.head_dim, "num_key_value_heads x head_dim")
        table |= {a + "q_proj.weight": (q, h), a + "(k|v)_proj.weight": (kv, h), a + "o_proj.weight": (h, q), a + "(q|k)_norm.weight": (d,)}
    return [(re.compile(pattern.replace(".", r"\.") + "$"), dims) for pattern, dims in table.items()]


def _listed(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


class CheckpointLayout:
    """One checkpoint's stored tensors, as the language model's names see them."""

    def __init__(self, root: Path, tensors: dict[str, StoredTensor], prefix: str, quantization: Quantization | None):
        self.root, self.tensors, self.prefix, self.quantization = root, tensors, prefix, quantization

    @classmethod
    def of(cls, hf_dir: str | Path) -> CheckpointLayout:
        config = read_hf_config(hf_dir)
        quantization = parse_quantization(config, Path(hf_dir) / "config.json")
        return cls(Path(hf_dir), read_stored_tensors(hf_dir), WRAPPED_LANGUAGE_MODEL.get(config.get("model_type"), ""), quantization)

    def stored(self, name: str) -> str:
        return self.prefix + name

    def parts(self, name: str) -> dict[str, str]:
        """Stored names of weight `name`: {"weight": ...} when stored as is, else its quantized parts."""
        stored = self.stored(name)
        base = stored.removesuffix(".weight")
        if self.quantization and self.quantization.method == "int4" and f"{base}.weight_packed" in self.tensors:
            return {part: f"{base}.{part}" for part in INT4_PARTS}
        if self.quantization and self.quantization.method == "fp8" and f"{base}.weight_scale_inv" in self.tensors:
            return {part: f"{base}.{part}" for part in FP8_PARTS}
        return {"weight": stored}

    def is_quantized(self, name: str) -> bool:
        return len(self.parts(name)) > 1

    def mtp_names(self, m: ModelSection) -> list[str]:
        """Stored tensors of the multi-token-prediction layers (after the model's last layer)."""
        layers = "|".join(str(m.num_layers + i) for i in range(m.num_mtp_layers))
        pattern = re.compile(re.escape(self.stored("model.layers.")) + f"({layers})\\.") if layers else None
        return sorted(n for n in self.tensors if pattern and pattern.match(n))

    def carried(self, m: ModelSection) -> list[str]:
        """Stored tensors composer copies bit-exactly into every export: outside a wrapper's language model (vision
        tower, projector) and, with model.mtp carry, the MTP layers."""
        outside = [n for n in self.tensors if not n.startswith(self.prefix)] if self.prefix else []
        return sorted(outside + (self.mtp_names(m) if m.mtp == "carry" else []))

    def problems(self, m: ModelSection, expected: set[str]) -> list[str]:
        """Missing and unexpected tensors, quantized parts of the wrong shape or dtype (`expected`: the language
        model's weight names)."""
        used = set(self.carried(m)) | set(self.mtp_names(m))
        missing, shapes, present = [], [], []
        for name in sorted(expected):
            parts = self.parts(name)
            if any(p not in self.tensors for p in parts.values()):
                missing.append(self.stored(name))
                continue
            used.update(parts.values())
            problems = self._part_problems(parts)
            shapes += problems
            if not problems:
                present.append(name)
        # a tied checkpoint may still store lm_head; old ones store RoPE tables; neither is a weight of the model
        unused = {n for n in set(self.tensors) - used if not (n == self.stored("lm_head.weight") or n.endswith("rotary_emb.inv_freq"))}
        out = []
        for problem, names in (("lacks tensors the model needs", missing), ("has tensors the model would not use", unused)):
            if names:
                out.append(f"{self.root}: checkpoint {problem}: {_listed(names)}")
        return out + [f"{self.root}: {problem}" for problem in shapes + self._shape_problems(m, present)]

    def _shape_problems(self, m: ModelSection, names: list[str]) -> list[str]:
        """Weights whose stored shape (a quantized one's: its codes' rows and the columns its weight_shape says) is not
        the one config.json makes, one message per config key, naming the first tensor; an INT4 weight_shape that
        contradicts its codes; a weight stored without scales in a dtype that needs them."""
        out, wrong, unscaled = [], {}, []
        int4 = [n for n in names if "weight_packed" in self.parts(n)]
        declared = self._weight_shapes([self.parts(n)["weight_shape"] for n in int4])
        patterns = hf_shapes(m)
        key_prefix = "text_config." if self.prefix else ""
        for name in names:
            parts = self.parts(name)
            if "weight_packed" in parts:
                packed, scale = self.tensors[parts["weight_packed"]], self.tensors[parts["weight_scale"]]
                shape = declared[parts["weight_shape"]]
                q = self.quantization
                if len(shape) != 2 or (packed.shape[0], math.ceil(shape[1] / 8), shape[1] // q.group_size) != (
                    shape[0],
                    packed.shape[1],
                    scale.shape[1],
                ):
                    out.append(
                        f"{parts['weight_shape']} = {list(shape)} contradicts its codes {list(packed.shape)} and scales "
                        f"{list(scale.shape)} (8 codes per int32, groups of {q.group_size})"
                    )
                    continue
            else:
                stored = self.tensors[parts["weight"]]
                shape = stored.shape
                if len(parts) == 1 and stored.dtype not in ("F32", "BF16", "F16"):
                    unscaled.append(parts["weight"])
                    continue
            dims = next((dims for pattern, dims in patterns if pattern.match(name)), None)
            if dims is None or tuple(size for size, _ in dims) == tuple(shape):
                continue
            keys = [f"{key_prefix}{key} {size}" for i, (size, key) in enumerate(dims) if i >= len(shape) or shape[i] != size]
            cause = ", ".join(keys) or f"{len(dims)} dimension(s)"
            wrong.setdefault(cause, []).append((name, shape, tuple(size for size, _ in dims)))
        if unscaled:
            dtypes = sorted({self.tensors[n].dtype for n in unscaled})
            out.append(f"{_listed(unscaled)}: stored as {', '.join(dtypes)} without scales; a weight stored as is is F32, BF16 or F16")
        for cause, tensors in wrong.items():
            name, shape, want = tensors[0]
            more = f" (and {len(tensors) - 1} more tensor(s) like it)" if len(tensors) > 1 else ""
            out.append(f"{self.stored(name)} is stored {list(shape)}, but config.json's {cause} make(s) it {list(want)}{more}")
        return out

    def _weight_shapes(self, names: list[str]) -> dict[str, tuple[int, ...]]:
        """The values of INT4 weight_shape vectors, read where each file's header says they are (a few bytes each)."""
        out = {}
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        for file, in_file in by_file.items():
            with file.open("rb") as f:
                for name in sorted(in_file, key=lambda n: self.tensors[n].offset):
                    t = self.tensors[name]
                    fmt = {"I32": "<2i", "I64": "<2q"}.get(t.dtype)
                    if fmt is None or t.shape != (2,):
                        out[name] = ()
                        continue
                    f.seek(t.offset)
                    out[name] = struct.unpack(fmt, f.read(struct.calcsize(fmt)))
        return out

    def _part_problems(self, parts: dict[str, str]) -> list[str]:
        if len(parts) == 1:
            return []
        q = self.quantization
        t = {part: self.tensors[name] for part, name in parts.items()}
        if q.method == "fp8":
            weight, scale = t["weight"], t["weight_scale_inv"]
            if weight.dtype != "F8_E4M3" or len(weight.shape) != 2:
                return [f"{parts['weight']}: a block-fp8 weight is 2-D F8_E4M3, found {weight.dtype} {list(weight.shape)}"]
            want = (math.ceil(weight.shape[0] / q.block[0]), math.ceil(weight.shape[1] / q.block[1]))
            if scale.shape != want or scale.dtype != "F32":
                return [
                    f"{parts['weight_scale_inv']}: scales of shape {list(scale.shape)} ({scale.dtype}); a {list(weight.shape)} weight in "
                    f"{q.block[0]}x{q.block[1]} blocks has {list(want)} (F32)"
                ]
            return []
        packed, scale, shape = t["weight_packed"], t["weight_scale"], t["weight_shape"]
        if packed.dtype != "I32" or len(packed.shape) != 2 or shape.shape != (2,):
            return [f"{parts['weight_packed']}: pack-quantized INT4 is 2-D I32 codes with a 2-element weight_shape"]
        columns = scale.shape[1] * q.group_size if len(scale.shape) == 2 else -1
        if len(scale.shape) != 2 or scale.shape[0] != packed.shape[0] or not 8 * (packed.shape[1] - 1) < columns <= 8 * packed.shape[1]:
            return [
                f"{parts['weight_scale']}: scales of shape {list(scale.shape)} do not fit codes {list(packed.shape)} in groups of {q.group_size} "
                f"(rows x columns / {q.group_size} for columns up to {8 * packed.shape[1]})"
            ]
        return []
