"""Worker for test_policy_push: the RL learner's two ways of pushing a policy, on the same model, step after step.

One rank builds the tiny MoE from argv[2], and for 3 steps (a sparse change of the weights between them) exports it
in the engines' format (argv[3]: a dtype, or `fp8`) and pushes it twice: written as safetensors and pushed from the
files (`push_version`) into OUT/export-store, and held in memory (`export_hf_tensors` + `TensorPusher`) into
OUT/memory-store. Usage: policy_push.py OUT CHECKPOINT FORMAT.
"""

import sys
from pathlib import Path

import torch

from composer.recipes.schema import ParallelismSection, SyncSection
from composer.sync.pusher import TensorPusher, push_version
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.model import build_model
from composer.trainer.weights import export_hf, export_hf_tensors, load_hf_into


def main() -> None:
    out, checkpoint, fmt = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    dtype, quantize = (None, "fp8") if fmt == "fp8" else (getattr(torch, fmt), None)
    m = model_section_from_hf(checkpoint).model_copy(update={"checkpoint": checkpoint})
    init_distributed(ParallelismSection())
    model = build_model(m, ParallelismSection())
    load_hf_into(model, m, checkpoint)
    codec = {"chunk_mb": 1, "threads": 1}
    from_export = SyncSection(store=str(out / "export-store"), codec=codec)
    pusher = TensorPusher(SyncSection(store=str(out / "memory-store"), codec=codec), cache_dir=out / "memory-cache")
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        if step:
            with torch.no_grad():
                for param in model.parameters():
                    touched = torch.rand(param.shape, generator=generator) < 0.02
                    param.add_(touched * torch.randn(param.shape, generator=generator) * param.abs() * 0.1)
        export_hf(model, m, out / f"export-{step}", tokenizer_dir=checkpoint, dtype=dtype, quantize=quantize)
        push_version(out / f"export-{step}", from_export, cache_dir=out / "export-cache")
        policy = export_hf_tensors(model, m, out / f"memory-{step}", tokenizer_dir=checkpoint, dtype=dtype, quantize=quantize)
        pusher.push(policy.tensors, policy.files, policy.directory)
    shutdown_distributed()


if __name__ == "__main__":
    main()
