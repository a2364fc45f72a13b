"""RL learner tokens/s with packed sequences (rl.pack_sequences) vs padded micro-batches, in one process.

The same learner (the recipe's model, random weights, world size 1, router replay on for MoE) trains on the same
batches of sequences, alternating packed and padded steps; prints trained tokens/s of each (median over steps),
their ratio and the share of padded positions. Lengths come from a recorded RL run (`--run RUN_DIR`: every segment
in its trajectories/) or, by default, from an agentic-episode-like distribution (log-normal, median 256 tokens,
sigma 1, between 32 and 2048: a few long episodes among many short ones).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/packing_bench.py [--recipe R] [--run RUN_DIR] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from composer.recipes.loader import load_recipe
from composer.trainer.distributed import shutdown_distributed
from composer.trainer.rl_learner import LearnerSequence, RLLearner

REPO = Path(__file__).resolve().parent.parent


def recorded_lengths(run: Path) -> list[int]:
    from composer.rl.trajectories import decode_group

    lengths = [
        len(segment.token_ids)
        for path in sorted((run / "trajectories").rglob("*.ctrj"))
        for trajectory in decode_group(path.read_bytes(), str(path))
        for segment in trajectory.segments
    ]
    if not lengths:
        raise SystemExit(f"{run}: no trajectory groups under trajectories/")
    return lengths


def agentic_lengths(count: int, rng: np.random.Generator) -> list[int]:
    return np.clip(rng.lognormal(np.log(256), 1.0, count), 32, 2048).astype(int).tolist()


def sequences(lengths: list[int], m, rng: np.random.Generator) -> list[LearnerSequence]:
    out = []
    for i, n in enumerate(lengths):
        mask = np.zeros(n, dtype=bool)
        mask[min(n - 1, 32) :] = True  # a prompt, then generated tokens
        routes = None
        if m.is_moe:
            routes = np.stack([np.argsort(rng.random((m.num_layers, m.num_experts)), axis=1)[:, : m.moe_top_k] for _ in range(n - 1)])
        out.append(
            LearnerSequence(
                rng.integers(1, m.vocab_size, n),
                mask,
                rng.uniform(-9, -5, n).astype(np.float32),
                float(rng.normal()),
                routes,
                episode=f"e{i}",
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes/smoke-rl.yaml"))
    parser.add_argument("--run", type=Path, help="a recorded RL run whose segment lengths to use")
    parser.add_argument("--sequences", type=int, default=32, help="sequences per step")
    parser.add_argument("--steps", type=int, default=3, help="steps per mode")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(Path(args.recipe), ["model.checkpoint=null", "parallelism.ep=1", "model.dtype=float32"])
    rng = np.random.default_rng(args.seed)
    pool = recorded_lengths(args.run) if args.run else agentic_lengths(4096, rng)
    lengths = [int(x) for x in rng.choice(pool, args.sequences)]
    m = recipe.model
    train = recipe.train.model_copy(update={"global_batch_size": args.sequences, "steps": 2 * args.steps})
    learner = RLLearner(
        m, recipe.parallelism.model_copy(update={"ep": 1}), recipe.optim, train, recipe.rl, Path(tempfile.mkdtemp(prefix="packing-bench-"))
    )
    batch = sequences(lengths, m, rng)
    micro = train.micro_batch_size
    padded_positions = sum(max(lengths[i : i + micro]) * len(lengths[i : i + micro]) for i in range(0, len(lengths), micro))
    print(
        f"{m.family}: {len(lengths)} sequences per step, micro-batch {micro}, lengths median {int(np.median(lengths))} "
        f"max {max(lengths)} ({'recorded: ' + str(args.run) if args.run else 'agentic log-normal'}); padding "
        f"{1 - sum(lengths) / padded_positions:.0%} of the padded micro-batches' positions",
        flush=True,
    )
    rates: dict[bool, list[float]] = {True: [], False: []}
    try:
        learner.train_step(batch)  # warm-up (allocations, first-call paths)
        for step in range(args.steps):
            for packed in (True, False):
                learner.rl = recipe.rl.model_copy(update={"pack_sequences": packed})
                record = learner.train_step(batch)
                rates[packed].append(record["trained_tokens_per_s"])
                print(
                    f"  step {step} {'packed' if packed else 'padded'}: {record['trained_tokens_per_s']:.0f} trained tokens/s "
                    f"({record['learner_seconds']:.2f} s)",
                    flush=True,
                )
    finally:
        shutdown_distributed()
    packed, padded = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"packed {packed:.0f} tokens/s, padded {padded:.0f} tokens/s: packed/padded x{packed / padded:.2f}")


if __name__ == "__main__":
    main()
