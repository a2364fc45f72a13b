"""HF checkpoints <-> Megatron GPTModel weights, for any tp/ep split.

The name mapping of each family is data: a table of rules `Megatron name pattern <- HF name(s) + transform`.
A transform turns the HF tensors into the *full* (unsharded) Megatron tensor and back; sharding is then the
generic split along the parameter's tensor-parallel `partition_dim`. Experts carry a global index in HF names
and a local one in Megatron's, offset by the expert-parallel rank.

`load_hf_into(model, m, hf_dir)` reads only the tensors this rank holds, shard by shard, dequantizing block-fp8
and INT4 weights (`trainer.quantization`). `export_hf(model, m, out_dir)` gathers one tensor at a time to global
rank 0, which streams them, in a dense dtype or quantized again, into safetensors shards in a temporary
directory renamed into place at the end, with the tensors composer carries untrained (MTP layers, a wrapper's
vision tower and projector) copied from the source checkpoint. Checkpoint files are described by
`trainer.hf_checkpoint`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from composer.recipes.errors import UserError
from composer.recipes.schema import ModelSection
from composer.runtime.run_dir import atomic_write_text, publish_dir
from composer.trainer.hf_checkpoint import INT4_PARTS, CheckpointLayout, read_stored_tensors
from composer.trainer.hf_config import Quantization, check_matches_checkpoint, language_config, read_hf_config
from composer.trainer.model import hf_config_from_model_section
from composer.trainer.quantization import fp8_dequantize, fp8_quantize, int4_dequantize, int4_parts_shapes, int4_quantize, is_power_of_two

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
SHARD_BYTES = 2 * 2**30


# --- transforms: HF tensors -> full Megatron tensor, and back -------------------------------------


@dataclass(frozen=True)
class Transform:
    to_megatron: Callable[[list[torch.Tensor], ModelSection, int], torch.Tensor]
    to_hf: Callable[[torch.Tensor, ModelSection, int], list[torch.Tensor]]


def _qkv_to_megatron(ts: list[torch.Tensor], m: ModelSection, shards: int) -> torch.Tensor:
    # Megatron interleaves per KV group: [q heads of group g ; k_g ; v_g], so each TP shard holds whole groups.
    q, k, v = ts
    groups, per_group, d, h = m.num_kv_heads, m.num_attention_heads // m.num_kv_heads, m.head_dim, q.shape[1]
    return torch.cat([q.view(groups, per_group * d, h), k.view(groups, d, h), v.view(groups, d, h)], 1).reshape(-1, h)


def _qkv_to_hf(t: torch.Tensor, m: ModelSection, shards: int) -> list[torch.Tensor]:
    groups, per_group, d, h = m.num_kv_heads, m.num_attention_heads // m.num_kv_heads, m.head_dim, t.shape[1]
    q, k, v = t.view(groups, (per_group + 2) * d, h).split([per_group * d, d, d], 1)
    return [q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]


def _glu_to_megatron(ts: list[torch.Tensor], m: ModelSection, shards: int) -> torch.Tensor:
    # Megatron's GLU computes silu(first half) * second half of *each shard's* output: [gate_r ; up_r] per shard.
    gate, up = ts
    return torch.cat([torch.cat(pair) for pair in zip(gate.chunk(shards), up.chunk(shards))])


def _glu_to_hf(t: torch.Tensor, m: ModelSection, shards: int) -> list[torch.Tensor]:
    halves = [shard.chunk(2) for shard in t.chunk(shards)]
    return [torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])]


COPY = Transform(lambda ts, m, shards: ts[0], lambda t, m, shards: [t])
QKV = Transform(_qkv_to_megatron, _qkv_to_hf)
GLU = Transform(_glu_to_megatron, _glu_to_hf)


# --- per-family tables -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    megatron: str
    """Megatron parameter name; `{layer}` and `{expert}` (local index) are placeholders."""
    hf: tuple[str, ...]
    """HF tensor names; `{expert}` is the global expert index."""
    transform: Transform = COPY
    layers: str = "all"
    """Which layers hold the tensor: `all`, `dense` (the first first_k_dense ones) or `moe`."""

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.megatron


_L, _ML = "model.layers.{layer}", "decoder.layers.{layer}"
_ATTENTION_OUT = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Rule(f"{_ML}.input_layernorm.weight", (f"{_L}.input_layernorm.weight",)),
    Rule(f"{_ML}.self_attention.linear_proj.weight", (f"{_L}.self_attn.o_proj.weight",)),
    Rule(f"{_ML}.pre_mlp_layernorm.weight", (f"{_L}.post_attention_layernorm.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",)),
)
_COMMON = _ATTENTION_OUT + (
    Rule(
        f"{_ML}.self_attention.linear_qkv.weight",
        (f"{_L}.self_attn.q_proj.weight", f"{_L}.self_attn.k_proj.weight", f"{_L}.self_attn.v_proj.weight"),
        QKV,
    ),
)
_EXPERTS = (
    Rule(f"{_ML}.mlp.router.weight", (f"{_L}.mlp.gate.weight",), layers="moe"),
    Rule(
        f"{_ML}.mlp.experts.local_experts.{{expert}}.linear_fc1.weight",
        (f"{_L}.mlp.experts.{{expert}}.gate_proj.weight", f"{_L}.mlp.experts.{{expert}}.up_proj.weight"),
        GLU,
        layers="moe",
    ),
    Rule(f"{_ML}.mlp.experts.local_experts.{{expert}}.linear_fc2.weight", (f"{_L}.mlp.experts.{{expert}}.down_proj.weight",), layers="moe"),
)
_DENSE_MLP = (
    Rule(f"{_ML}.mlp.linear_fc1.weight", (f"{_L}.mlp.gate_proj.weight", f"{_L}.mlp.up_proj.weight"), GLU, layers="dense"),
    Rule(f"{_ML}.mlp.linear_fc2.weight", (f"{_L}.mlp.down_proj.weight",), layers="dense"),
)
_MLA = (
    Rule(f"{_ML}.self_attention.linear_kv_down_proj.weight", (f"{_L}.self_attn.kv_a_proj_with_mqa.weight",)),
    Rule(f"{_ML}.self_attention.kv_layernorm.weight", (f"{_L}.self_attn.kv_a_layernorm.weight",)),
    Rule(f"{_ML}.self_attention.linear_kv_up_proj.weight", (f"{_L}.self_attn.kv_b_proj.weight",)),
)
_MLA_Q_LORA = (
    Rule(f"{_ML}.self_attention.linear_q_down_proj.weight", (f"{_L}.self_attn.q_a_proj.weight",)),
    Rule(f"{_ML}.self_attention.q_layernorm.weight", (f"{_L}.self_attn.q_a_layernorm.weight",)),
    Rule(f"{_ML}.self_attention.linear_q_up_proj.weight", (f"{_L}.self_attn.q_b_proj.weight",)),
)
_MLA_Q = (Rule(f"{_ML}.self_attention.linear_q_proj.weight", (f"{_L}.self_attn.q_proj.weight",)),)
_BIAS_AND_SHARED_EXPERTS = (
    # a buffer in both: Megatron updates it aux-loss-free from the expert load, HF adds it to the scores for top-k
    Rule(f"{_ML}.mlp.router.expert_bias", (f"{_L}.mlp.gate.e_score_correction_bias",), layers="moe"),
    Rule(
        f"{_ML}.mlp.shared_experts.linear_fc1.weight",
        (f"{_L}.mlp.shared_experts.gate_proj.weight", f"{_L}.mlp.shared_experts.up_proj.weight"),
        GLU,
        layers="moe",
    ),
    Rule(f"{_ML}.mlp.shared_experts.linear_fc2.weight", (f"{_L}.mlp.shared_experts.down_proj.weight",), layers="moe"),
)
FAMILY_RULES: dict[str, tuple[Rule, ...]] = {
    "qwen3_moe": _COMMON
    + (
        Rule(f"{_ML}.self_attention.q_layernorm.weight", (f"{_L}.self_attn.q_norm.weight",)),
        Rule(f"{_ML}.self_attention.k_layernorm.weight", (f"{_L}.self_attn.k_norm.weight",)),
    )
    + _EXPERTS,
    "llama": _COMMON + _DENSE_MLP,
    "deepseek_v3": _ATTENTION_OUT + _MLA + _DENSE_MLP + _EXPERTS + _BIAS_AND_SHARED_EXPERTS,
}


def family_rules(m: ModelSection) -> tuple[Rule, ...]:
    """The rules of `m`'s family that apply to its shape."""
    if m.family == "deepseek_v3":
        return FAMILY_RULES["deepseek_v3"] + (_MLA_Q_LORA if m.q_lora_rank else _MLA_Q)
    return FAMILY_RULES[m.family]


def _rule_layers(rule: Rule, m: ModelSection) -> list[int]:
    moe = set(m.moe_layers)
    if rule.layers == "moe":
        return sorted(moe)
    if rule.layers == "dense" and m.is_moe:
        return [layer for layer in range(m.num_layers) if layer not in moe]
    return list(range(m.num_layers))


def expected_hf_names(m: ModelSection) -> set[str]:
    """Every tensor name an HF checkpoint of architecture `m` holds."""
    names = set()
    for rule in family_rules(m):
        if rule.megatron == "output_layer.weight" and m.tie_word_embeddings:
            continue
        for layer in _rule_layers(rule, m) if "{layer}" in rule.megatron else [None]:
            for expert in range(m.num_experts) if rule.is_expert else [None]:
                names.update(name.format(layer=layer, expert=expert) for name in rule.hf)
    return names


def _compile(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)") + "$")


@dataclass(frozen=True)
class ParamPlan:
    """How one local Megatron parameter relates to the HF checkpoint."""

    rule: Rule
    hf_names: tuple[str, ...]
    layer: int | None
    local_expert: int | None


def plan_params(model, m: ModelSection) -> Iterator[tuple[torch.nn.Parameter, ParamPlan]]:
    """Every parameter of `model` with the HF tensors it is made of."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    rules = [(rule, _compile(rule.megatron)) for rule in family_rules(m)]
    # Megatron numbers a pipeline stage's layers from 0; HF names carry the global layer
    layer_offset = get_transformer_layer_offset(model.config)
    experts_per_rank = m.num_experts // parallel_state.get_expert_model_parallel_world_size()
    expert_offset = parallel_state.get_expert_model_parallel_rank() * experts_per_rank
    # persistent per-expert buffers (the router's expert bias) are weights of the checkpoint too
    buffers = ((name, b) for name, b in model.named_buffers() if name.endswith(".router.expert_bias"))
    for name, param in itertools.chain(model.named_parameters(), buffers):
        for rule, regex in rules:  # noqa: B007 (the matching rule is used after the loop)
            match = regex.match(name)
            if match:
                break
        else:
            raise KeyError(f"no {m.family} weight rule for Megatron parameter {name}")
        parts = match.groupdict()
        layer = int(parts["layer"]) + layer_offset if "layer" in parts else None
        local = int(parts["expert"]) if "expert" in parts else None
        fill = {"layer": layer, "expert": None if local is None else local + expert_offset}
        hf_names = tuple(n.format(**fill) for n in rule.hf)
        yield param, ParamPlan(rule, hf_names, layer, local)


def _tp_group_of(param: torch.nn.Parameter, rule: Rule):
    from megatron.core import parallel_state

    if rule.is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    return parallel_state.get_tensor_model_parallel_group()


def _tp_size_rank(param: torch.nn.Parameter, rule: Rule) -> tuple[int, int]:
    import torch.distributed as dist

    group = _tp_group_of(param, rule)
    if not getattr(param, "tensor_model_parallel", False) or group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


# --- import ----------------------------------------------------------------------------------------


def hf_weight_files(hf_dir: str | Path) -> dict[str, Path]:
    """Stored tensor name -> safetensors file holding it."""
    return {name: t.file for name, t in read_stored_tensors(hf_dir).items()}


def check_checkpoint(m: ModelSection, hf_dir: str | Path) -> CheckpointLayout:
    """The checkpoint's layout, once its config is `m`'s architecture and its files hold what the model needs and
    nothing it would drop (carried tensors aside), quantized parts of the right shapes, no shard truncated."""
    check_matches_checkpoint(m, hf_dir)
    layout = CheckpointLayout.of(hf_dir)
    problems = layout.problems(m, expected_hf_names(m))
    if problems:
        raise UserError("; ".join(problems))
    return layout


def check_checkpoint_before_launch(m: ModelSection) -> None:
    """Before any rank starts: a model.checkpoint this machine can read is checked as the ranks will check it (one on
    storage only the training hosts see is left to them)."""
    if m.checkpoint and (Path(m.checkpoint) / "config.json").is_file():
        check_checkpoint(m, m.checkpoint)


SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I32": torch.int32,
    "I64": torch.int64,
}


class ShardReader:
    """Tensors of a checkpoint, read with at most `max_open` shards mapped at a time (the least recently used one is
    closed first), so reading in shard order holds one shard's pages, not the checkpoint's."""

    def __init__(self, layout: CheckpointLayout, max_open: int = 1):
        self.layout, self.max_open = layout, max_open
        self.handles: dict[Path, object] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()

    def raw(self, stored: str) -> torch.Tensor:
        """A stored tensor as it is in the file."""
        from safetensors import safe_open

        path = self.layout.tensors[stored].file
        handle = self.handles.pop(path, None)
        if handle is None:
            if len(self.handles) >= self.max_open:
                oldest = next(iter(self.handles))
                self.handles.pop(oldest).__exit__(None, None, None)
            handle = safe_open(path, framework="pt").__enter__()
        self.handles[path] = handle  # most recently used last
        return handle.get_tensor(stored)

    def weight(self, name: str) -> torch.Tensor:
        """Weight `name` of the language model, dequantized to fp32 when it is stored quantized."""
        parts = self.layout.parts(name)
        if len(parts) == 1:
            return self.raw(parts["weight"])
        t = {part: self.raw(stored) for part, stored in parts.items()}
        q = self.layout.quantization
        if q.method == "fp8":
            if q.scale_fmt == "ue8m0" and not bool(is_power_of_two(t["weight_scale_inv"]).all()):
                raise UserError(
                    f"{self.layout.root}: {parts['weight_scale_inv']}: quantization_config.scale_fmt ue8m0, but a scale is no power of two"
                )
            return fp8_dequantize(t["weight"], t["weight_scale_inv"], q.block)
        shape = tuple(t["weight_shape"].tolist())
        if int4_parts_shapes(shape, q.group_size) != {part: tuple(t[part].shape) for part in INT4_PARTS}:
            raise UserError(
                f"{self.layout.root}: {parts['weight_shape']} = {list(shape)} does not match its codes {list(t['weight_packed'].shape)} "
                f"and scales {list(t['weight_scale'].shape)} (groups of {q.group_size})"
            )
        return int4_dequantize(t["weight_packed"], t["weight_scale"], t["weight_shape"], q.group_size)

    def files_of(self, names: tuple[str, ...]) -> list[str]:
        return sorted(str(self.layout.tensors[p].file) for n in names for p in self.layout.parts(n).values())


@torch.no_grad()
def load_hf_into(model, m: ModelSection, hf_dir: str | Path) -> None:
    """Copy the HF checkpoint's weights into this rank's shards of `model` (built by build_model from `m`): shard
    by shard, quantized weights dequantized, the tensors composer only carries left in the files."""
    layout = check_checkpoint(m, hf_dir)
    with ShardReader(layout) as reader:
        plans = sorted(plan_params(model, m), key=lambda item: reader.files_of(item[1].hf_names))
        for param, plan in plans:
            size, rank = _tp_size_rank(param, plan.rule)
            full = plan.rule.transform.to_megatron([reader.weight(n) for n in plan.hf_names], m, size)
            shard = full.chunk(size, dim=param.partition_dim)[rank] if size > 1 else full
            if shard.shape != param.shape:
                raise UserError(
                    f"{hf_dir}: {', '.join(plan.hf_names)} has shape {tuple(full.shape)}, which does not fit the model config (Megatron shard {tuple(param.shape)})"
                )
            param.copy_(shard)


# --- export ----------------------------------------------------------------------------------------


class _ShardWriter:
    """Accumulates tensors and writes a safetensors shard whenever `max_bytes` is reached; `in_memory` keeps each
    shard's tensors (on their device) instead of writing them, and their layout (file -> names)."""

    def __init__(self, directory: Path, max_bytes: int, in_memory: bool = False):
        self.directory, self.max_bytes, self.in_memory = directory, max_bytes, in_memory
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.kept: dict[str, torch.Tensor] = {}
        self.layout: dict[str, list[str]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.in_memory:  # a copy: an export tensor may be a view of a parameter the next step changes
            self.pending[name] = tensor.detach().clone(memory_format=torch.contiguous_format)
        else:
            self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.directory / f"part-{len(self.files):05d}.safetensors"
        if self.in_memory:
            self.kept.update(self.pending)
        else:
            save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, sorted(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        count = len(self.files)
        weight_map = {}
        for i, (path, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            if not self.in_memory:
                path.rename(self.directory / final)
            self.layout[final] = names
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


@dataclass(frozen=True)
class HFTensors:
    """An HF export held in memory: its tensors as the export stores them (names, dtypes, quantized layout), on
    the device they were gathered to, the files they would be written as, and the directory of its other files."""

    tensors: dict[str, torch.Tensor]
    files: dict[str, list[str]]
    directory: Path


def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _stage_hf_tensors(model, m: ModelSection) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every weight of this pipeline stage, gathered over tp and ep."""
    from megatron.core import parallel_state

    ep_group = parallel_state.get_expert_model_parallel_group(check_initialized=False)
    experts_per_rank = m.num_experts // parallel_state.get_expert_model_parallel_world_size()
    for param, plan in plan_params(model, m):
        size, _ = _tp_size_rank(param, plan.rule)
        data = param.detach()
        full = torch.cat(_gather(data, _tp_group_of(param, plan.rule)), dim=param.partition_dim) if size > 1 else data
        if plan.rule.is_expert:
            per_rank = _gather(full, ep_group)
            for ep_rank, tensor in enumerate(per_rank):
                fill = {"layer": plan.layer, "expert": ep_rank * experts_per_rank + plan.local_expert}
                names = [n.format(**fill) for n in plan.rule.hf]
                yield from zip(names, plan.rule.transform.to_hf(tensor, m, size))
        else:
            yield from zip(plan.hf_names, plan.rule.transform.to_hf(full, m, size))


def iter_hf_tensors(model, m: ModelSection) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every weight, gathered over tp and ep, and over pipeline stages (each stage's
    tensors broadcast over its pipeline group, stage after stage), one parameter at a time.

    A collective: every rank must iterate it to the end. Tensors that needed no gather are views of the live
    parameters; copy them if the model changes before they are used.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages == 1:
        yield from _stage_hf_tensors(model, m)
        return
    group = parallel_state.get_pipeline_model_parallel_group()
    mine = parallel_state.get_pipeline_model_parallel_rank()
    for stage in range(stages):
        src = dist.get_global_rank(group, stage)
        tensors = _stage_hf_tensors(model, m) if stage == mine else None
        while True:
            item = next(tensors, None) if tensors is not None else None
            header = [None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
            dist.broadcast_object_list(header, src=src, group=group)
            if header[0] is None:
                break
            name, shape, dtype = header[0]
            tensor = item[1].contiguous() if item is not None else torch.empty(shape, dtype=dtype)
            dist.broadcast(tensor, src=src, group=group)
            yield name, tensor


QUANTIZED_BY_DEFAULT = {
    "fp8": re.compile(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$"),  # every linear of the layers (DeepSeek-V3's layout)
    "int4": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\..*_proj\.weight$"),  # routed experts (Kimi-K2-Thinking's)
}
"""Which weights a quantized export quantizes when its source checkpoint is not stored that way itself."""
DEFAULT_QUANTIZATION_CONFIG = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "int4": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "dynamic": False,
                    "actorder": None,
                },
            }
        },
        # Kimi-K2.6's list: everything but the routed experts stays dense
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:vision_tower.*",
            "re:mm_projector.*",
        ],
    },
}


class _Encoder:
    """Turns (HF name, full tensor) into the stored tensors of the export: a dense dtype, or a quantized layout
    (`fp8`, `int4`) in which the source checkpoint's own quantized weights keep the scales they still fit and the
    other tensors keep the source's dtype."""

    def __init__(self, source: CheckpointLayout | None, reader: ShardReader | None, dtype: torch.dtype | None, quantize: str | None):
        self.source, self.reader, self.dtype, self.quantize = source, reader, dtype, quantize
        # stored that way already: the source's quantized weights are the layout, their scales the reference
        self.published = source is not None and source.quantization is not None and source.quantization.method == quantize
        self.format = source.quantization if self.published else Quantization(quantize) if quantize else None

    def _stored(self, name: str) -> str:
        return self.source.stored(name) if self.source else name

    def _quantized(self, name: str) -> bool:
        if self.quantize is None:
            return False
        return self.source.is_quantized(name) if self.published else bool(QUANTIZED_BY_DEFAULT[self.quantize].match(name))

    def encode(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if not self._quantized(name):
            return [(self._stored(name), tensor.to(self._dense_dtype(name, tensor)))]
        parts = self.source.parts(name) if self.published else None
        base = self._stored(name).removesuffix(".weight")
        if self.quantize == "fp8":
            published = self.reader.raw(parts["weight_scale_inv"]) if parts else None
            weight, scale = fp8_quantize(tensor, self.format.block, published, power_of_two=self.format.scale_fmt == "ue8m0")
            return [(f"{base}.weight", weight), (f"{base}.weight_scale_inv", scale)]
        published = self.reader.raw(parts["weight_scale"]) if parts else None
        dtypes = {}
        if parts:
            dtypes = dict(scale_dtype=published.dtype, shape_dtype=SAFETENSORS_DTYPES[self.source.tensors[parts["weight_shape"]].dtype])
        stored = int4_quantize(tensor, self.format.group_size, published, **dtypes)
        return [(f"{base}.{part}", stored[part]) for part in INT4_PARTS]

    def carried(self, m: ModelSection, dense: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The source's carried tensors in the export's format: outside the language model (vision tower, projector)
        and MTP layers in the source's own format as stored, bit for bit; MTP layers of an export in another format
        (dense, or quantized another way) dequantized and encoded as the model's weights are, never a mix."""
        if self.source is None:
            return
        mtp = set(self.source.mtp_names(m)) if m.mtp == "carry" else set()
        as_stored = self.published or (self.source.quantization is None and self.quantize is None and self.dtype is None)
        for stored in self.source.carried(m):
            if as_stored or stored not in mtp:
                yield stored, self.reader.raw(stored)
        if as_stored:
            return
        # one weight per quantized group of parts (weight + weight_scale_inv, or weight_packed + weight_scale + weight_shape)
        parts = re.compile(r"\.(weight_scale_inv|weight_packed|weight_scale|weight_shape)$")
        names = sorted({parts.sub(".weight", stored).removeprefix(self.source.prefix) for stored in mtp})
        for name in names:
            tensor = self.reader.weight(name)  # a dequantized weight in the export's dense dtype, the others as stored
            yield from self.encode(name, tensor.to(dense) if self.source.is_quantized(name) and not self.quantize else tensor)

    def _dense_dtype(self, name: str, tensor: torch.Tensor) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        if self.quantize is None:
            return tensor.dtype
        found = self.source.tensors.get(self._stored(name)) if self.source else None
        # a weight the source quantizes another way (fp8 -> int4 keeps attention dense) is written in bf16, not as fp8 codes
        return SAFETENSORS_DTYPES[found.dtype] if found and found.dtype in ("F32", "BF16", "F16") else torch.bfloat16


@torch.no_grad()
def export_hf(
    model,
    m: ModelSection,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = SHARD_BYTES,
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> None:
    """Write `model` as an HF checkpoint at `out_dir`: per-expert names, shard by shard; the source checkpoint's
    (model.checkpoint) config.json, wrapper prefix, other files and carried tensors (MTP layers, vision tower),
    or composer's own config without one. Tensors in `dtype` when given (the RL policy in its engines' dtype), else
    in the model's own; `quantize` (`fp8`, `int4`) writes the quantized layout, the other tensors in `dtype` or as
    the source stores them.

    Collective: call it on every rank. Global rank 0 writes; `out_dir` must not exist yet.
    """
    _export(model, m, Path(out_dir), tokenizer_dir, max_shard_bytes, dtype, quantize, in_memory=False)


@torch.no_grad()
def export_hf_tensors(
    model,
    m: ModelSection,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = SHARD_BYTES,
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> HFTensors | None:
    """`export_hf` without writing the tensors: global rank 0 gets them (copies, on the device they were gathered
    to) with the files they would be in, and `out_dir` holds the export's other files (config.json, tokenizer,
    index). None on the other ranks. Collective."""
    return _export(model, m, Path(out_dir), tokenizer_dir, max_shard_bytes, dtype, quantize, in_memory=True)


def _export(model, m: ModelSection, out: Path, tokenizer_dir, max_shard_bytes: int, dtype, quantize, in_memory: bool) -> HFTensors | None:
    import torch.distributed as dist

    # rank 0's file system decides (other nodes may not see it); every rank must stop together or none
    exists = [out.exists()]
    dist.broadcast_object_list(exists, src=0)
    if exists[0]:
        raise UserError(f"{out}: already exists; export into a new directory")
    writing = dist.get_rank() == 0
    writer = _write_checkpoint(iter_hf_tensors(model, m), m, out, writing, tokenizer_dir, max_shard_bytes, dtype, quantize, in_memory)
    dist.barrier()
    return HFTensors(writer.kept, writer.layout, out) if writing and in_memory else None


@torch.no_grad()
def convert_hf(
    m: ModelSection, out_dir: str | Path, dtype: torch.dtype | None = None, quantize: str | None = None, max_shard_bytes: int = SHARD_BYTES
) -> Path:
    """model.checkpoint rewritten as `export_hf` would write a model loaded from it, without building one (the RL
    starting policy in its engines' format), shard by shard."""
    out = Path(out_dir)
    if out.exists():
        raise UserError(f"{out}: already exists; convert into a new directory")
    layout = check_checkpoint(m, m.checkpoint)
    with ShardReader(layout) as reader:
        names = sorted(expected_hf_names(m), key=lambda name: (reader.files_of((name,)), name))
        _write_checkpoint(((name, reader.weight(name)) for name in names), m, out, True, m.checkpoint, max_shard_bytes, dtype, quantize)
    return out


def _write_checkpoint(
    tensors: Iterator[tuple[str, torch.Tensor]],
    m: ModelSection,
    out: Path,
    writing: bool,
    tokenizer_dir,
    max_shard_bytes: int,
    dtype: torch.dtype | None,
    quantize: str | None,
    in_memory: bool = False,
) -> _ShardWriter:
    """Consume `tensors` (HF name, full tensor); when `writing`, write them as an HF checkpoint at `out`,
    atomically (a temporary directory renamed into place), or with `in_memory` keep the tensors in the returned
    writer and write the other files only."""
    source = CheckpointLayout.of(m.checkpoint) if m.checkpoint else None
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if writing:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    try:
        with ShardReader(source) if source else nullcontext() as reader:
            writer = _ShardWriter(tmp, max_shard_bytes, in_memory)
            encoder = _Encoder(source, reader, dtype, quantize)
            written_dtype = dtype
            for name, tensor in tensors:
                written_dtype = written_dtype or tensor.dtype
                if writing:
                    for stored, part in encoder.encode(name, tensor):
                        writer.add(stored, part)
            if writing:
                dense = dtype or (torch.bfloat16 if quantize else written_dtype)
                for stored, part in encoder.carried(m, dense):
                    writer.add(stored, part)
                writer.finish()
                _write_config_and_files(tmp, m, dense, quantize, source, tokenizer_dir)
                publish_dir(tmp, out)
    finally:
        if writing and tmp.exists():
            shutil.rmtree(tmp)
    return writer


WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)$|.*\.safetensors\.index\.json$|config\.json$")


def _write_config_and_files(
    directory: Path, m: ModelSection, dtype: torch.dtype, quantize: str | None, source: CheckpointLayout | None, tokenizer_dir
) -> None:
    """config.json (the source's, describing what was written, or composer's own) and the other files: the source
    checkpoint's (tokenizer, chat template, remote code), then `tokenizer_dir`'s tokenizer files over them."""
    if source is not None:
        for path in source.root.iterdir():
            if path.is_file() and not path.name.startswith(".") and not WEIGHT_FILES.match(path.name):
                shutil.copy2(path, directory / path.name)
    special: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None}
    if tokenizer_dir is not None:
        tokenizer = Path(tokenizer_dir)
        if not tokenizer.is_dir():
            raise UserError(f"{tokenizer}: no such tokenizer directory")
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, directory / name)
        if (tokenizer / "config.json").is_file():
            tokenizer_config = json.loads((tokenizer / "config.json").read_text())
            special = {k: tokenizer_config.get(k) for k in special}
    if source is not None:
        config = _source_config(source, m, dtype, quantize)
    else:
        config = hf_config_from_model_section(m, dtype, **special)
        if quantize:
            config["quantization_config"] = DEFAULT_QUANTIZATION_CONFIG[quantize]
    atomic_write_text(directory / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")


def _source_config(source: CheckpointLayout, m: ModelSection, dtype: torch.dtype, quantize: str | None) -> dict:
    """The source's config.json with the dtype, quantization, MTP layers and (model.rescale_rope) RoPE of this export."""
    config = read_hf_config(source.root)
    language = language_config(config, source.root / "config.json")
    name = str(dtype).removeprefix("torch.")
    for section in {id(config): config, id(language): language}.values():
        for key in [k for k in ("dtype", "torch_dtype") if k in section] or ["dtype"]:
            section[key] = name
        if m.mtp == "drop" and "num_nextn_predict_layers" in section:
            section["num_nextn_predict_layers"] = 0
    if m.rescale_rope:  # a long-context stage: the RoPE base and length the model now has, not its source's
        rope = language.get("rope_parameters")
        (rope if isinstance(rope, dict) and "rope_theta" in rope else language)["rope_theta"] = m.rope_theta
        language["max_position_embeddings"] = m.max_position_embeddings
    keep = quantize is not None and source.quantization is not None and source.quantization.method == quantize
    if not keep:
        config.pop("quantization_config", None)
        language.pop("quantization_config", None)
        if quantize:
            config["quantization_config"] = DEFAULT_QUANTIZATION_CONFIG[quantize]
    return config
