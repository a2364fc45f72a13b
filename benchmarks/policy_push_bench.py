"""The RL learner's per-step push, two ways, on the same tensors in the same run: from memory (`TensorPusher`:
the delta encoded where the tensors are, against the previous policy held there; only the small files written)
against the export path (the policy written as safetensors, then read back and encoded on the host by
`push_version`). The versions must be the same bytes; the ratio of wall times is printed.

A third column times the in-memory push with `sync.device`'s torch encoder forced onto these CPU tensors (what
a GPU learner runs; on a CPU the host codec on the tensors' memory is the default, and faster).

The policy is a checkpoint's tensors in bf16 (--checkpoint DIR, any HF safetensors checkpoint; default: the tiny
MoE of recipes/smoke-rl.yaml, made here); each step moves --density of the fp32 master values by a small
optimizer-like update before the bf16 cast, as in RL steps. The learner's gather (common to both ways) is not timed.

    PYTHONPATH=. python benchmarks/policy_push_bench.py --checkpoint /path/to/SmolLM2-135M --steps 4
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer.recipes.schema import SyncSection  # noqa: E402
from composer.sync.pusher import TensorPusher, push_version  # noqa: E402

SHARD_BYTES = 2**28


def load_master(checkpoint: Path) -> dict[str, torch.Tensor]:
    master = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            master.update({name: f.get_tensor(name).float() for name in f.keys()})
    return master


def shard_files(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Shards of at most SHARD_BYTES, in name order, named as an HF export names them."""
    shards, current, size = [], [], 0
    for name in sorted(tensors):
        current.append(name)
        size += tensors[name].numel() * tensors[name].element_size()
        if size >= SHARD_BYTES:
            shards, current, size = [*shards, current], [], 0
    shards += [current] if current else []
    return {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=None, help="an HF safetensors checkpoint (default: the smoke tiny MoE)")
    parser.add_argument("--steps", type=int, default=4, help="versions pushed (the first is an anchor)")
    parser.add_argument("--density", type=float, default=0.02, help="fraction of master values an update moves")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="policy-push-"))
    try:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from composer.recipes.loader import load_recipe
            from composer.trainer.checkpoint_init import init_hf_checkpoint

            model = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "smoke-rl.yaml").model
            checkpoint = init_hf_checkpoint(model, work / "init", tokenizer_bytes=2**18)
        master = load_master(checkpoint)
        nbytes = sum(t.numel() * 2 for t in master.values())
        print(f"policy: {checkpoint} as bf16, {len(master)} tensors, {nbytes / 1e6:.1f} MB; torch threads {torch.get_num_threads()}")
        codec = {"threads": args.threads, "chunk_mb": 64}
        from_export = SyncSection(store=str(work / "export-store"), codec=codec)
        pusher = TensorPusher(SyncSection(store=str(work / "memory-store"), codec=codec), cache_dir=work / "memory-cache")
        torch_pusher = TensorPusher(
            SyncSection(store=str(work / "torch-store"), codec=codec), cache_dir=work / "torch-cache", device_encoder=True
        )
        other = work / "other"
        other.mkdir()
        shutil.copy(checkpoint / "config.json", other / "config.json")
        g = torch.Generator().manual_seed(0)
        print(
            f"{'version':>10} | {'export+reread+encode':>21} | {'from memory':>12} {'ratio':>6} | {'memory, torch':>13} {'ratio':>6} | "
            f"{'stored MB':>9} {'same':>5}"
        )
        totals = [0.0, 0.0, 0.0]
        for step in range(args.steps):
            if step:
                for w in master.values():
                    touched = torch.rand(w.shape, generator=g) < args.density
                    w += touched * torch.randn(w.shape, generator=g) * w.abs() * 0.05
            tensors = {name: w.to(torch.bfloat16) for name, w in master.items()}
            files = shard_files(tensors)
            started = time.perf_counter()
            export = work / f"export-{step}"
            export.mkdir()
            for file, names in files.items():
                save_file({n: tensors[n] for n in names}, str(export / file), metadata={"format": "pt"})
            shutil.copy(other / "config.json", export / "config.json")
            written = push_version(export, from_export, cache_dir=work / "export-cache")
            export_s = time.perf_counter() - started
            started = time.perf_counter()
            pushed = pusher.push(tensors, files, other)
            memory_s = time.perf_counter() - started
            started = time.perf_counter()
            by_torch = torch_pusher.push(tensors, files, other)
            torch_s = time.perf_counter() - started
            same = {(v.id, v.stored_bytes, v.changed_elements) for v in (written, pushed, by_torch)}
            if step:
                for i, seconds in enumerate((export_s, memory_s, torch_s)):
                    totals[i] += seconds
                shutil.rmtree(work / f"export-{step - 1}")
            kind = "anchor" if pushed.is_anchor else "delta"
            print(
                f"{pushed.id[-3:]:>3} {kind:>6} | {export_s:20.2f}s | {memory_s:11.2f}s {export_s / memory_s:5.2f}x | "
                f"{torch_s:12.2f}s {export_s / torch_s:5.2f}x | {pushed.stored_bytes / 1e6:9.2f} {str(len(same) == 1):>5}"
            )
        if args.steps > 1:
            print(
                f"deltas: export path {totals[0]:.2f} s, from memory {totals[1]:.2f} s ({totals[0] / totals[1]:.2f}x), "
                f"from memory with the torch encoder {totals[2]:.2f} s ({totals[0] / totals[2]:.2f}x)"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
