"""Learner step time of asynchronous vs synchronous RL on the same recipe, in the same run.

Synchronous = `rl.max_staleness: 0` (the engine generates one step's groups with the newest policy, then waits for
the next one); asynchronous = `rl.max_staleness: 1` (rollouts continue while the learner trains). The target for the
asynchronous step is <= 1.2 x max(generation time, training time) of a step; the script exits non-zero when missed.

    python benchmarks/rl_bench.py [--steps 10] [--checkpoint HF_DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def run(mode: str, staleness: int, checkpoint: Path, root: Path, steps: int) -> dict[str, float]:
    runs = root / mode
    cmd = [
        sys.executable,
        "-m",
        "composer.cli",
        "train",
        "rl",
        str(REPO / "recipes/smoke-rl.yaml"),
        "--set",
        f"run.dir={runs}",
        "--set",
        f"model.checkpoint={checkpoint}",
        "--set",
        f"train.steps={steps}",
        "--set",
        f"rl.max_staleness={staleness}",
        "--set",
        f"train.checkpoint_every={steps}",
    ]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    steps_ = [json.loads(line) for line in (runs / "smoke-rl/metrics.jsonl").read_text().splitlines()][2:]  # warm-up
    groups = [json.loads(line) for line in (runs / "smoke-rl/rollout_metrics.jsonl").read_text().splitlines()]
    prompts = yaml.safe_load((runs / "smoke-rl/recipe.yaml").read_text())["rl"]["prompts_per_step"]
    return {
        "step_s": statistics.median(r["step_seconds"] for r in steps_),
        "train_s": statistics.median(r["step_seconds"] - r["wait_seconds"] for r in steps_),
        "generate_s": prompts * statistics.median(g["group_seconds"] for g in groups),
        "dropped": sum(r["dropped_stale"] for r in steps_),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpoint", type=Path, help="HF checkpoint to start from (default: a fresh tiny MoE)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = args.checkpoint
        if checkpoint is None:
            from composer.recipes.loader import load_recipe
            from composer.trainer.checkpoint_init import init_hf_checkpoint

            checkpoint = init_hf_checkpoint(load_recipe(REPO / "recipes/smoke-rl.yaml").model, root / "init", tokenizer_bytes=2**20)
        results = {mode: run(mode, staleness, checkpoint, root, args.steps) for mode, staleness in (("sync", 0), ("async", 1))}
    print(f"{'mode':6} {'step s':>8} {'train s':>8} {'generate s':>11} {'dropped':>8}")
    for mode, r in results.items():
        print(f"{mode:6} {r['step_s']:8.2f} {r['train_s']:8.2f} {r['generate_s']:11.2f} {r['dropped']:8d}")
    a, s = results["async"], results["sync"]
    bound = max(a["generate_s"], a["train_s"])
    ratio = a["step_s"] / bound
    print(f"async step / max(generate, train) = {ratio:.2f} (target <= 1.2) {'met' if ratio <= 1.2 else 'MISSED'}")
    print(f"sync step / async step = {s['step_s'] / a['step_s']:.2f}x")
    if ratio > 1.2:
        sys.exit(f"MISSED its target: async step / max(generate, train) = {ratio:.2f} > 1.2")


if __name__ == "__main__":
    main()
