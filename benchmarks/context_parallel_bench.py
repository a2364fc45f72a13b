"""Context parallelism on long sequences: cp2 vs cp1 step time and peak memory per rank, in one run.

Both layouts train the recipe's model (random weights, fp32) on 2 gloo ranks through mid-training's own step
(`trainer.midtrain.train_step`, the sample rows split zigzag over the cp group): cp1 holds one `--seq`-token sequence
per rank (2 data-parallel replicas), cp2 splits each of the two sequences over both ranks (ring attention). The same
tokens per step either way. Peak memory per rank is the resident set's high-water mark during the steps above the
process before its model was built, with its process groups and Megatron loaded (glibc's mmap threshold fixed, so
freed tensors leave the resident set), printed beside what `composer plan` predicts for the layout. On CPU
the point is the memory ratio; two gloo ranks on shared cores pay the ring's exchanges in time.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/context_parallel_bench.py [--seq 8192] [--steps 2] [--recipe R]
    (each layout runs as: torchrun --nproc-per-node 2 benchmarks/context_parallel_bench.py --worker CP SEQ STEPS RECIPE OUT)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def layout_overrides(cp: int, seq: int) -> list[str]:
    return [
        "model.checkpoint=null",
        "model.dtype=float32",
        "parallelism.ep=1",
        f"parallelism.cp={cp}",
        f"model.max_position_embeddings={seq}",
        f"data.seq_length={seq}",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
    ]


def worker(cp: int, seq: int, steps: int, recipe_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from composer.recipes.loader import load_recipe
    from composer.runtime.processes import reset_peak_resident, resident_bytes
    from composer.trainer.core import TrainerCore
    from composer.trainer.distributed import init_distributed, shutdown_distributed
    from composer.trainer.midtrain import BatchPlacement, train_step

    torch.set_num_threads(1)
    recipe = load_recipe(Path(recipe_path), layout_overrides(cp, seq))
    # the baseline: the process with its process groups and Megatron loaded (what a rank holds before its model)
    init_distributed(recipe.parallelism, seed=recipe.train.seed)
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    before = resident_bytes()[0]
    core = TrainerCore(recipe.model, recipe.parallelism, recipe.optim, recipe.train, Path(tempfile.mkdtemp()) / "checkpoints")
    from megatron.core import parallel_state

    placement = BatchPlacement("causal", eod=0, cp_size=cp, cp_rank=parallel_state.get_context_parallel_rank())
    generator = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    micro = 2 // parallel_state.get_data_parallel_world_size()
    times = []
    for step in range(steps + 1):
        batches = []
        for _ in range(micro):
            tokens = torch.randint(1, recipe.model.vocab_size, (1, seq + 1), generator=generator)
            batches.append(
                placement(
                    {
                        "tokens": tokens[:, :-1],
                        "labels": tokens[:, 1:],
                        "loss_mask": torch.ones(1, seq),
                        "position_ids": torch.arange(seq)[None],
                    }
                )
            )
        if step == 1:
            reset_peak_resident()  # the first step allocates the optimizer state, which stays
        started = time.perf_counter()
        train_step(core.ddp, core.optimizer, batches, None)
        if step:
            times.append(time.perf_counter() - started)
    peak = torch.tensor([resident_bytes()[1] - before], dtype=torch.float64)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"step_seconds": min(times), "peak_bytes": [float(p) for p in peaks]}))
    shutdown_distributed()


def run_layout(cp: int, seq: int, steps: int, recipe: str) -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "131072"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(29650 + cp),
        __file__,
        "--worker",
        str(cp),
        str(seq),
        str(steps),
        recipe,
        str(out),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"cp={cp} failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        cp, seq, steps, recipe, out = sys.argv[2:7]
        worker(int(cp), int(seq), int(steps), recipe, out)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes/smoke-deepseek-v3-midtrain.yaml"))
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence (the longest cp1 holds here)")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    from composer.cluster.plan import make_plan
    from composer.recipes.loader import load_recipe

    results = {cp: run_layout(cp, args.seq, args.steps, args.recipe) for cp in (1, 2)}
    for cp, r in results.items():
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_bytes"])
        planned = make_plan(load_recipe(Path(args.recipe), layout_overrides(cp, args.seq))).rank.total
        print(
            f"cp{cp}: {args.seq} tokens per sequence, step {r['step_seconds']:.2f} s, peak MiB per rank above the process: {peaks} "
            f"(composer plan: {planned / 2**20:.0f})"
        )
    one, two = results[1], results[2]
    print(
        f"cp2/cp1: step time x{two['step_seconds'] / one['step_seconds']:.2f}, "
        f"peak memory per rank x{max(two['peak_bytes']) / max(one['peak_bytes']):.2f}"
    )


if __name__ == "__main__":
    main()
