"""Adam vs Muon in `composer train midtrain`, each at its best learning rate of a small sweep, in the same run.

Two models, each from one `composer model init` checkpoint, on the same data in the same order (same seed, same
tokens per step), 2 gloo ranks with expert parallelism 2 as the smoke recipes:
- the tiny MoE (recipes/smoke-midtrain.yaml, Qwen3-MoE: GQA with QK-norm);
- the tiny DeepSeek-V3 twin (recipes/smoke-deepseek-v3-midtrain.yaml, MLA) with QK-clip on for both optimizers.
For each optimizer and learning rate one run; each optimizer's best run is the one with the lowest final held-out
loss. Printed: held-out loss at equal steps and the median step time (steps after the first `--skip`), as Muon /
Adam ratios of the best runs, and the twin's largest attention logit every `--every` steps with the steps clipped.
Step times of separate runs move with the machine's load; the two optimizers also take turns step by step in one
process (one rank, random tokens), which gives a ratio that load changes little.

    python benchmarks/optimizer_bench.py [--steps 60] [--adam-lrs 1e-3,3e-3,1e-2] [--muon-lrs 3e-3,1e-2,3e-2] [--qk-clip 1.0]
                                         [--models tiny-moe,tiny-deepseek-v3-qk-clip]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"tiny-moe": "smoke-midtrain.yaml", "tiny-deepseek-v3-qk-clip": "smoke-deepseek-v3-midtrain.yaml"}


def composer(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "composer.cli", *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"composer {' '.join(args[:2])} failed:\n{result.stderr[-3000:]}")


def midtrain(root: Path, recipe: str, name: str, steps: int, optimizer: str, lr: float, qk_clip: float | None) -> list[dict]:
    sets = [
        f"run.dir={root / 'runs'}",
        f"run.name={name}",
        f"model.checkpoint={root / recipe / 'init'}",
        f"data.cache_dir={root / 'cache'}",
        f"train.steps={steps}",
        f"train.eval_every={steps // 3}",
        "train.eval_batches=4",
        f"train.checkpoint_every={steps}",
        "train.global_batch_size=16",
        "optim.warmup_steps=5",
        f"optim.lr={lr}",
        f"optim.min_lr={lr / 10}",
        f"optim.name={optimizer}",
        f"optim.qk_clip={'null' if qk_clip is None else qk_clip}",
    ]
    composer("train", "midtrain", str(REPO / "recipes" / recipe), *(a for s in sets for a in ("--set", s)))
    return [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict], skip: int) -> dict:
    final = records[-1]
    return {
        "eval_loss": final["eval_loss"],
        "evals": {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r},
        "step_seconds": statistics.median(r["step_seconds"] for r in records if r["step"] > skip),
        "max_logits": {r["step"]: r["max_attention_logit"] for r in records if "max_attention_logit" in r},
    }


def interleaved_step_seconds(recipe: str, steps: int, lrs: dict[str, float], qk_clip: float | None) -> None:
    """Prints the median midtrain step time of Adam and of Muon taking turns step by step in one process (one rank,
    no expert parallelism), so that what else runs on the machine slows both alike."""
    import torch

    sys.path.insert(0, str(REPO))
    from composer.recipes.loader import load_recipe
    from composer.recipes.schema import OptimSection
    from composer.trainer.distributed import init_distributed
    from composer.trainer.midtrain import train_step
    from composer.trainer.model import build_model
    from composer.trainer.optimizer import TrainOptimizer, wrap_data_parallel

    r = load_recipe(REPO / "recipes" / recipe, ["cluster.procs_per_host=1", "parallelism.ep=1"])
    init_distributed(r.parallelism, seed=0)
    runs = {}
    for name, lr in lrs.items():
        torch.manual_seed(0)
        model = build_model(r.model, r.parallelism, qk_clip=qk_clip)
        ddp = wrap_data_parallel(model, r.parallelism)
        optim = OptimSection(name=name, lr=lr, qk_clip=qk_clip)
        runs[name] = (ddp, TrainOptimizer(ddp, optim, r.parallelism, steps, torch.float32), [])
    generator = torch.Generator().manual_seed(0)
    seq, micro, count = r.data.seq_length, r.train.micro_batch_size, 16 // r.train.micro_batch_size
    for _ in range(steps):
        tokens = torch.randint(0, r.model.vocab_size, (count, micro, seq + 1), generator=generator)
        batches = [
            {
                "tokens": t[:, :-1],
                "labels": t[:, 1:],
                "loss_mask": torch.ones(micro, seq),
                "position_ids": torch.arange(seq).expand(micro, seq),
            }
            for t in tokens
        ]
        for ddp, optimizer, times in runs.values():
            times.append(train_step(ddp, optimizer, batches, None)["step_seconds"])
    print(json.dumps({name: statistics.median(times[steps // 4 :]) for name, (_, _, times) in runs.items()}))


def interleaved(recipe: str, steps: int, adam_lr: float, muon_lr: float, qk_clip: float | None) -> dict[str, float]:
    args = ["--interleaved", recipe, str(steps), str(adam_lr), str(muon_lr), "null" if qk_clip is None else str(qk_clip)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, __file__, *args], cwd=REPO, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"interleaved timing failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--interleaved"]:
        recipe, steps, adam_lr, muon_lr, qk_clip = sys.argv[2:]
        clip = None if qk_clip == "null" else float(qk_clip)
        return interleaved_step_seconds(recipe, int(steps), {"adam": float(adam_lr), "muon": float(muon_lr)}, clip)
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the step time")
    parser.add_argument("--adam-lrs", default="1e-3,3e-3,1e-2")
    parser.add_argument("--muon-lrs", default="3e-3,1e-2,3e-2")
    parser.add_argument("--qk-clip", type=float, default=1.0, help="threshold of the DeepSeek-V3 runs (its logits are small)")
    parser.add_argument("--every", type=int, default=10, help="steps between printed max-logit values")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    args = parser.parse_args()
    sweeps = {"adam": [float(x) for x in args.adam_lrs.split(",")], "muon": [float(x) for x in args.muon_lrs.split(",")]}
    with tempfile.TemporaryDirectory(prefix="optimizer-bench-") as tmp:
        root = Path(tmp)
        for label in args.models.split(","):
            recipe = MODELS[label]
            composer("model", "init", str(root / recipe / "init"), "--recipe", str(REPO / "recipes" / recipe))
            qk_clip = args.qk_clip if "qk-clip" in label else None
            best = {}
            print(f"\n{label} ({recipe}), {args.steps} steps of 16 x 256 tokens, 2 ranks (ep 2)")
            for optimizer, lrs in sweeps.items():
                for lr in lrs:
                    run = summary(midtrain(root, recipe, f"{recipe}-{optimizer}-{lr:g}", args.steps, optimizer, lr, qk_clip), args.skip)
                    evals = "  ".join(f"{step}: {loss:.4f}" for step, loss in run["evals"].items())
                    print(f"  {optimizer:5} lr {lr:<7g} eval loss {evals}   step {run['step_seconds'] * 1000:.0f} ms", flush=True)
                    if optimizer not in best or run["eval_loss"] < best[optimizer][1]["eval_loss"]:
                        best[optimizer] = (lr, run)
            (adam_lr, adam), (muon_lr, muon) = best["adam"], best["muon"]
            print(f"  best: adam lr {adam_lr:g}, muon lr {muon_lr:g}")
            for step in adam["evals"]:
                print(
                    f"  eval loss at step {step:3}: adam {adam['evals'][step]:.4f}  muon {muon['evals'][step]:.4f}  "
                    f"muon/adam {muon['evals'][step] / adam['evals'][step]:.3f}"
                )
            print(
                f"  step time (each run's median): adam {adam['step_seconds'] * 1000:.0f} ms  muon {muon['step_seconds'] * 1000:.0f} ms  "
                f"muon/adam {muon['step_seconds'] / adam['step_seconds']:.2f}"
            )
            turns = interleaved(recipe, args.steps, adam_lr, muon_lr, qk_clip)
            print(
                f"  step time taking turns (1 rank): adam {turns['adam'] * 1000:.0f} ms  muon {turns['muon'] * 1000:.0f} ms  "
                f"muon/adam {turns['muon'] / turns['adam']:.2f}",
                flush=True,
            )
            if qk_clip is not None:
                print(f"  largest attention logit (QK-clip at {qk_clip:g}), every {args.every} steps:")
                for name, run in (("adam", adam), ("muon", muon)):
                    curve = [f"{run['max_logits'][s]:.2f}" for s in sorted(run["max_logits"]) if s % args.every == 0 or s == 1]
                    clipped = sum(value > qk_clip for value in run["max_logits"].values())
                    print(f"    {name:5} {' '.join(curve)}   ({clipped} of {len(run['max_logits'])} steps clipped)")


if __name__ == "__main__":
    main()
