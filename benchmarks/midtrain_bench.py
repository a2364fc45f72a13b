"""Throughput and memory of `composer train midtrain` against a bare Megatron loop, in the same run.

Both train the smoke recipe's model on the same data with the same layout (2 gloo ranks, EP 2), from the same
`composer model init` checkpoint. The bare loop is the minimum: fetch the micro-batches, forward/backward, Megatron
optimizer step; no metrics, evaluation, checkpoints or progress. Evaluation and checkpointing of the composer run
happen only at its last step, which is left out of the steady-state window, as are the first `--skip` steps;
throughput is that of the lower-quartile step time in the window.
Peak RSS per rank is the VmHWM of each rank process, sampled while it runs. Exits non-zero when the best-vs-best
overhead misses its target (<= 10%).

    python benchmarks/midtrain_bench.py [--steps 60] [--repeats 2]
    (the bare loop itself runs as: torchrun ... benchmarks/midtrain_bench.py --bare RUN_DIR STEPS)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def bare_loop(run_dir: Path, steps: int) -> None:
    """One rank of the baseline: the smoke run's model, data and layout in a plain loop."""
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from composer.recipes.loader import load_recipe
    from composer.runtime.run_dir import RunDir
    from composer.trainer.distributed import init_distributed
    from composer.trainer.midtrain import prepare_batches
    from composer.trainer.model import build_model, causal_mask
    from composer.trainer.optimizer import TrainOptimizer, wrap_data_parallel
    from composer.trainer.weights import load_hf_into

    run = RunDir(run_dir)
    recipe = load_recipe(run.recipe_path)
    init_distributed(recipe.parallelism, seed=recipe.train.seed)
    data = prepare_batches(recipe, run, console=None)
    model = build_model(recipe.model, recipe.parallelism)
    load_hf_into(model, recipe.model, recipe.model.checkpoint)
    ddp = wrap_data_parallel(model, recipe.parallelism)
    optimizer = TrainOptimizer(ddp, recipe.optim, recipe.parallelism, steps, torch.float32)
    ddp.train()
    times = []
    for step in range(steps):
        micro_batches = data.train.micro_batches(step)
        optimizer.zero_grad()
        # the same load-balancing gradient as composer's step: the routing, and so the expert work, stay identical
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / len(micro_batches)))
        for batch in micro_batches:
            seq = batch["tokens"].shape[1]
            losses = ddp(batch["tokens"], batch["position_ids"], causal_mask(seq), labels=batch["labels"])
            ((losses * batch["loss_mask"]).sum() / (batch["loss_mask"].sum() * len(micro_batches))).backward()
        optimizer.step()
        times.append(time.perf_counter())
    if dist.get_rank() == 0:
        print(json.dumps({"times": times}), flush=True)
    dist.destroy_process_group()


# --- the driver ----------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def record_rank_peak_rss(pid: int, peaks: dict[int, float]) -> None:
    """VmHWM (peak RSS, MiB) of the ranks: the direct children of the torchrun process below `pid`."""
    frontier, torchrun = [pid], None
    while frontier and torchrun is None:
        current = frontier.pop()
        if "torch.distributed.run" in cmdline(current):
            torchrun = current
        frontier += children(current)
    for rank in children(torchrun) if torchrun else []:
        try:
            status = Path(f"/proc/{rank}/status").read_text()
        except OSError:
            continue
        hwm = next((line for line in status.splitlines() if line.startswith("VmHWM")), None)
        if hwm:
            peaks[rank] = max(peaks.get(rank, 0.0), int(hwm.split()[1]) / 1024)


def run_watched(cmd: list[str]) -> tuple[subprocess.CompletedProcess, list[float], float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}
    while process.poll() is None:
        record_rank_peak_rss(process.pid, peaks)
        time.sleep(0.1)
    out, err = process.communicate()
    wall = time.perf_counter() - started
    if process.returncode != 0:
        sys.exit(f"{' '.join(cmd[:6])}... failed:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, 0, out, err), [peaks[p] for p in sorted(peaks)], wall


def steady_tokens_per_s(times: list[float], tokens_per_step: int, skip: int) -> float:
    """Tokens/s of the lower-quartile step time between the end of step `skip` and the end of the second-to-last step.

    A low quantile rather than the mean, because the machine may be shared: steps slowed by other processes say
    nothing about either loop, and on a busy machine most steps are.
    """
    window = times[skip : len(times) - 1]
    return tokens_per_step / statistics.quantiles([b - a for a, b in zip(window, window[1:])], n=4)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the window")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the best of each is kept")
    parser.add_argument("--bare", nargs=2, metavar=("RUN_DIR", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare_loop(Path(args.bare[0]), int(args.bare[1]))
        return
    work = Path(tempfile.mkdtemp(prefix="midtrain-bench-"))
    try:
        measure(args, work)
    finally:
        shutil.rmtree(work)


def measure(args: argparse.Namespace, work: Path) -> None:
    from composer.runtime.processes import free_port
    from composer.runtime.run_dir import read_metrics

    python = sys.executable
    subprocess.run([python, "-m", "composer.cli", "model", "init", str(work / "init")], cwd=REPO, check=True, capture_output=True)
    recipe = str(REPO / "recipes" / "smoke-midtrain.yaml")
    common = [
        f"model.checkpoint={work / 'init'}",
        f"data.cache_dir={work / 'cache'}",
        f"run.dir={work / 'runs'}",
        f"train.steps={args.steps}",
        f"train.eval_every={args.steps}",
        f"train.checkpoint_every={args.steps}",
    ]
    results: dict[str, list[tuple[float, list[float], float]]] = {"composer": [], "bare": []}
    tokens_per_step = None
    for repeat in range(args.repeats):
        name = f"bench-{repeat}"
        cmd = [python, "-m", "composer.cli", "train", "midtrain", recipe, *[a for s in [*common, f"run.name={name}"] for a in ("--set", s)]]
        _, rss, wall = run_watched(cmd)
        rows = [r for r in read_metrics(work / "runs" / name / "metrics.jsonl") if r["step"] > 0]
        tokens_per_step = int(rows[0]["tokens"])
        results["composer"].append((steady_tokens_per_s([r["time"] for r in rows], tokens_per_step, args.skip), rss, wall))

        cmd = [
            python,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            __file__,
            "--bare",
            str(work / "runs" / name),
            str(args.steps),
        ]
        done, rss, wall = run_watched(cmd)
        times = json.loads(done.stdout.strip().splitlines()[-1])["times"]
        results["bare"].append((steady_tokens_per_s(times, tokens_per_step, args.skip), rss, wall))

    best = {k: max(v, key=lambda r: r[0]) for k, v in results.items()}
    pairs = [1 - c[0] / b[0] for c, b in zip(results["composer"], results["bare"])]
    print(
        f"smoke model, seq 256, global batch {tokens_per_step // 256}, 2 ranks EP 2, steps {args.steps} (window: steps {args.skip + 2}..{args.steps - 1})"
    )
    for kind, (tps, rss, wall) in best.items():
        runs = ", ".join(f"{r[0]:.0f}" for r in results[kind])
        print(
            f"  {kind:8s} {tps:8.0f} tokens/s (runs: {runs})  peak RSS per rank: {', '.join(f'{x:.0f}' for x in rss)} MiB  command wall {wall:.1f} s"
        )
    overhead = 1 - best["composer"][0] / best["bare"][0]
    print(
        f"composer overhead vs bare loop (1 - composer/bare tokens/s, target <= 10%): best vs best "
        f"{overhead * 100:+.1f}% {'met' if overhead <= 0.10 else 'MISSED'}, per alternating pair {', '.join(f'{x * 100:+.1f}%' for x in pairs)}"
    )
    if overhead > 0.10:
        sys.exit(f"MISSED its target: composer overhead {overhead * 100:+.1f}% > 10%")


if __name__ == "__main__":
    main()
