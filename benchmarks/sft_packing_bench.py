"""SFT trained tokens/s with packed conversations (sft.pack: true) vs one padded conversation a sample, in one process.

The same trainer core (the recipe's model, random weights, world size 1) trains on samples of the same conversations,
alternating a packed and a padded step (each a global batch of `--samples` samples from its own sample stream:
packed samples hold several conversations each); prints trained (assistant) tokens/s of each (median over steps),
their ratio, the conversations per step, and the share of sample positions that hold a real token in each mode;
exits non-zero when packed is not the faster.
Conversation lengths follow an agent-transcript-like distribution (log-normal, median `--median` tokens, sigma 0.8,
between 64 and max_length): a few long transcripts among many short ones; the assistant's share of each is its
second half.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/sft_packing_bench.py [--recipe R] [--max-length 1024] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.machine import cpu_model
from composer.recipes.loader import load_recipe
from composer.runtime.sft_examples import TokenizedConversations
from composer.trainer.core import TrainerCore
from composer.trainer.distributed import shutdown_distributed
from composer.trainer.midtrain import BatchPlacement, BatchSource, train_step
from composer.trainer.sft import ConversationSamples, packing_summary

REPO = Path(__file__).resolve().parent.parent


def conversations(count: int, median: int, max_length: int, vocab: int, rng: np.random.Generator) -> TokenizedConversations:
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, count), 64, max_length).astype(int)
    out = []
    for n in lengths.tolist():
        mask = np.zeros(n, dtype=bool)
        mask[n // 2 :] = True
        out.append((rng.integers(1, vocab, n).tolist(), mask.tolist()))
    return TokenizedConversations.of(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes/smoke-sft.yaml"))
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--median", type=int, default=300, help="median conversation length in tokens")
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--samples", type=int, default=8, help="samples per step (the global batch)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="steps per mode")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(Path(args.recipe), ["model.checkpoint=null", "parallelism.ep=1", "model.dtype=float32", "env=null"])
    m = recipe.model
    data = conversations(args.conversations, args.median, args.max_length, m.vocab_size, np.random.default_rng(args.seed))
    lengths = np.diff(data.offsets)
    train = recipe.train.model_copy(
        update={"global_batch_size": args.samples, "micro_batch_size": args.micro_batch, "steps": 2 * args.steps + 1}
    )
    optim = recipe.optim.model_copy(update={"warmup_steps": 0})
    core = TrainerCore(
        m, recipe.parallelism.model_copy(update={"ep": 1}), optim, train, Path(tempfile.mkdtemp(prefix="sft-packing-bench-"))
    )
    summary = {pack: packing_summary(data, args.max_length, args.seed, pack) for pack in (True, False)}
    print(
        f"{cpu_model()}, {torch.get_num_threads()} thread(s); {m.family} {m.num_layers} layers hidden {m.hidden_size}, "
        f"{len(lengths)} conversations, lengths median {int(np.median(lengths))} max {lengths.max()} "
        f"(log-normal), samples of {args.max_length} positions, {args.samples} a step (micro-batch {args.micro_batch})",
        flush=True,
    )
    for pack in (True, False):
        s = summary[pack]
        print(
            f"  {'packed' if pack else 'padded'}: {s['samples']} samples a pass, {s['conversations_per_sample']:.2f} conversations "
            f"each, {s['real_share']:.0%} of positions real tokens",
            flush=True,
        )
    placement = {pack: BatchPlacement("document" if pack else "causal", 0) for pack in (True, False)}
    sources = {
        pack: BatchSource(
            ConversationSamples(data, args.max_length, 0, args.seed, True, pack), args.samples, args.micro_batch, 0, 1, placement[pack]
        )
        for pack in (True, False)
    }
    rates: dict[bool, list[float]] = {True: [], False: []}
    per_step: dict[bool, list[int]] = {True: [], False: []}
    try:
        train_step(core.ddp, core.optimizer, sources[True].micro_batches(0), None)  # warm-up (allocations, first-call paths)
        for step in range(args.steps):
            for pack in (True, False):
                batches = sources[pack].micro_batches(step + 1)
                started = time.perf_counter()
                record = train_step(core.ddp, core.optimizer, batches, None)
                seconds = time.perf_counter() - started
                rates[pack].append(record["tokens"] / seconds)
                per_step[pack].append(sum(len(b["layout"].lengths) for b in batches) if pack else args.samples)
                print(
                    f"  step {step} {'packed' if pack else 'padded'}: {per_step[pack][-1]} conversations, {record['tokens']:.0f} "
                    f"trained tokens in {seconds:.2f} s: {rates[pack][-1]:.0f} tokens/s",
                    flush=True,
                )
    finally:
        shutdown_distributed()
    packed, padded = statistics.median(rates[True]), statistics.median(rates[False])
    print(
        f"packed {packed:.0f} trained tokens/s, padded {padded:.0f}: packed/padded x{packed / padded:.2f}; real tokens "
        f"{summary[True]['real_share']:.0%} of positions packed vs {summary[False]['real_share']:.0%} padded "
        f"(x{summary[True]['real_share'] / summary[False]['real_share']:.2f}); conversations a step "
        f"{statistics.mean(per_step[True]):.1f} vs {args.samples}"
    )
    if packed <= padded:  # the point of sft.pack: more trained tokens per second than padding
        sys.exit(f"MISSED its target: packed {packed:.0f} trained tokens/s is not above padded {padded:.0f}")


if __name__ == "__main__":
    main()
