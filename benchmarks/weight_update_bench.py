"""Benchmark moving a live vLLM engine to the next policy: in place from the sync delta vs a full reload,
on the smoke model and on a ~1 GB synthetic MoE, at a given fraction of changed values, in the same run.

  full reload  what a rollout host did before: `pull` the new version (a complete second copy, written and
               fsynced), then the engine re-reads every tensor of it (`load_weights`)
  in place     `update_in_place` patches the receiver's one copy where the version differs, then the engine
               reloads only the layers whose tensors changed (`update_weights`), each checked against the
               manifest's piece hashes

After both, the engine's parameters and prepacked buffers are hashed: in place and full reload must agree bit
for bit. Models are fp32 Qwen3-MoE checkpoints (vLLM on CPU serves fp32); each next version changes
--density of the values of the tensors it touches, in --layers-touched of the decoder layers (1.0: all,
like a dense optimizer step; smaller: like an RL step whose changes stay in a few layers).

    PYTHONPATH=. python benchmarks/weight_update_bench.py
    PYTHONPATH=. python benchmarks/weight_update_bench.py --density 0.01 --layers-touched 0.25
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from composer.recipes.schema import ModelSection, RolloutSection, SamplingSection  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# ~1 GB of fp32: 4 layers of 18 experts (hidden 1024, expert FFN 768), 32k vocabulary, untied head
SYNTHETIC = dict(
    family="qwen3_moe",
    num_layers=4,
    hidden_size=1024,
    num_attention_heads=8,
    num_kv_heads=4,
    head_dim=128,
    num_experts=18,
    moe_top_k=2,
    moe_ffn_hidden_size=768,
    vocab_size=32000,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    dtype="float32",
)


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM")


def write_model(m: ModelSection, out: Path, seed: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from composer.trainer.checkpoint_init import randomize_for_parity
    from composer.trainer.model import hf_config_from_model_section

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**hf_config_from_model_section(m, torch.float32))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_for_parity(model, seed=seed)
    model.save_pretrained(out)
    return out


def next_version(src: Path, dst: Path, density: float, layers_touched: float, seed: int) -> Path:
    """A copy of `src` with `density` of the values changed in the tensors of the first `layers_touched` share
    of decoder layers (and in the embeddings and head when every layer is touched)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    rng = np.random.default_rng(seed)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(file))
        layers = sorted({int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")})
        touched = set(layers[: max(1, round(len(layers) * layers_touched))])
        for name, array in tensors.items():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            if (layer in touched) if layer is not None else layers_touched >= 1.0:
                flat = array.reshape(-1)
                positions = rng.choice(flat.size, max(1, int(flat.size * density)), replace=False)
                flat[positions] *= np.float32(1.01)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def measure(label: str, m: ModelSection, work: Path, density: float, layers_touched: float, threads: int) -> dict:
    from composer.recipes.schema import SyncSection
    from composer.rollout.engines.vllm_engine import EmbeddedEngine
    from composer.sync.checkpoint import Checkpoint
    from composer.sync.pusher import push_version
    from composer.sync.receiver import pull, update_in_place
    from composer.sync.store import Store

    v0 = write_model(m, work / "v0", seed=0)
    v1 = next_version(v0, work / "v1", density, layers_touched, seed=1)
    with Checkpoint(v0) as ck:
        model_bytes = ck.nbytes
    section = SyncSection(store=str(work / "store"), anchor_every=100, codec={"threads": threads})
    push_version(v0, section, cache_dir=work / "cache")
    delta = push_version(v1, section, cache_dir=work / "cache")
    shutil.rmtree(work / "cache")
    rollout = RolloutSection(max_context=256, kv_cache_gib=0.0625, dtype="float32", sampling=SamplingSection(max_tokens=4))
    with Store.open(section.store) as store:
        for receiver in ("in_place", "full"):
            pull(store, work / receiver, "v00000001", threads)
        engine = EmbeddedEngine(work / "in_place" / "current", rollout, seed=0, routed_experts=False)
        prompt = [[(7 * i + 3) % 500 for i in range(64)]]
        engine.generate(prompt, max_tokens=2, seeds=[0])
        engine.load_weights((work / "full" / "current").resolve())  # warm-up: both measured reloads are not the first

        started = time.perf_counter()
        patched = update_in_place(store, work / "in_place", delta.id, threads)
        patch_s = time.perf_counter() - started
        target, before = store.manifest(delta.id), store.manifest("v00000001")
        applied = engine.update_weights((work / "in_place" / "current").resolve(), target.differing_tensors(before), target.piece_hashes())
        in_place_s = time.perf_counter() - started
        in_place_digest = engine.weights_digest()
        [[after_in_place]] = engine.generate(prompt, max_tokens=4, seeds=[0])

        started = time.perf_counter()
        pull(store, work / "full", delta.id, threads)
        pull_s = time.perf_counter() - started
        engine.load_weights((work / "full" / "current").resolve())
        full_s = time.perf_counter() - started
        full_digest = engine.weights_digest()
        [[after_full]] = engine.generate(prompt, max_tokens=4, seeds=[0])
    exact = (
        in_place_digest == full_digest
        and after_in_place.token_ids == after_full.token_ids
        and after_in_place.logprobs == after_full.logprobs
    )
    return dict(
        label=label,
        model_bytes=model_bytes,
        changed=100 * delta.changed_elements / delta.total_elements,
        delta_bytes=delta.stored_bytes,
        tensors=len(applied["tensors"]),
        layers=applied["layers"],
        reloaded_bytes=applied["bytes"],
        patch_s=patch_s,
        in_place_s=in_place_s,
        pull_s=pull_s,
        full_s=full_s,
        exact=exact,
        patched_bytes=patched.patched_bytes,
        worker=applied["seconds"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--density", type=float, default=0.01, help="fraction of a touched tensor's values changed")
    parser.add_argument("--layers-touched", type=float, default=1.0, help="share of decoder layers whose tensors change")
    parser.add_argument("--threads", type=int, default=0, help="sync codec threads (0 = one per core)")
    parser.add_argument("--skip-synthetic", action="store_true", help="only the smoke model")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    smoke = ModelSection(**yaml.safe_load((REPO / "recipes/base/tiny-moe.yaml").read_text())["model"])
    models = [("smoke (tiny-moe.yaml)", smoke)] + ([] if args.skip_synthetic else [("synthetic ~1 GB", ModelSection(**SYNTHETIC))])
    print(f"density {100 * args.density:g}% of values in {100 * args.layers_touched:g}% of layers; {os.cpu_count()} cores\n")
    header = (
        f"{'model':<22} {'size':>9} {'changed':>8} {'delta':>10} {'reloaded':>16} | {'patch':>7} {'in place':>9} | "
        f"{'pull':>7} {'full':>7} | {'speed-up':>8} {'bit-exact':>9}"
    )
    print(header)
    print("-" * len(header))
    for label, m in models:
        with tempfile.TemporaryDirectory(prefix="weight-update-bench-", dir=args.workdir) as tmp:
            r = measure(label, m, Path(tmp), args.density, args.layers_touched, args.threads)
        print(
            f"{r['label']:<22} {r['model_bytes'] / 1e9:7.3f}GB {r['changed']:7.2f}% {r['delta_bytes'] / 1e6:8.2f}MB "
            f"{r['layers']:3d} layers {r['reloaded_bytes'] / r['model_bytes']:4.0%} | {r['patch_s']:6.2f}s {r['in_place_s']:8.2f}s | "
            f"{r['pull_s']:6.2f}s {r['full_s']:6.2f}s | {r['full_s'] / r['in_place_s']:7.1f}x {str(r['exact']):>9}",
            flush=True,
        )
        worker = ", ".join(f"{k} {v:.2f}s" for k, v in r["worker"].items())
        print(f"{'':<22} in place, in the engine: {worker}; engine reload in the full path {r['full_s'] - r['pull_s']:.2f}s", flush=True)
    print(f"\npeak RSS {peak_rss() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
