"""Router replay on the train/inference mismatch: a bf16 vLLM engine samples, an fp32 Megatron learner rescores.

Same run, same samples, two learner passes: free routing (rl.router_replay: off) and replay of the engine's routes
(r3). Prints per-layer routing disagreement, mean/max |learner - engine| logprob of the sampled tokens, their
ratio, and what the routed experts cost in a stored trajectory group (raw and zstd-compressed, per token).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/router_replay_bench.py [--prompts 32] [--tokens 48]

By default the random smoke MoE is made to behave like a trained one (see sharpen_moe): in a random model the
experts barely move the residual stream, so a flipped route hardly changes a logprob and bf16 noise dominates
(`--router-scale 1 --expert-scale 1` shows that case).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from composer.recipes.loader import load_recipe
from composer.recipes.schema import ParallelismSection, RolloutSection, SamplingSection
from composer.rl.trajectories import encode_group
from composer.rollout.agent.trajectory import Segment, Trajectory
from composer.rollout.engines.vllm_engine import EmbeddedEngine
from composer.trainer.checkpoint_init import init_hf_checkpoint
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.logprobs import pad_micro_batch
from composer.trainer.model import build_model
from composer.trainer.router_replay import replay_metrics
from composer.trainer.weights import load_hf_into

REPO = Path(__file__).resolve().parent.parent


def sharpen_moe(checkpoint: Path, router_scale: float, expert_scale: float) -> None:
    """Scale router weights (smaller: closer top-k margins, routing flips under bf16 noise) and expert output
    projections (larger: the experts dominate the residual stream, as in a trained MoE, so a flip matters)."""
    from safetensors.torch import load_file, save_file

    path = checkpoint / "model.safetensors"
    weights = load_file(path)
    for name, tensor in weights.items():
        if name.endswith("mlp.gate.weight"):
            tensor.mul_(router_scale)
        elif ".mlp.experts." in name and name.endswith("down_proj.weight"):
            tensor.mul_(expert_scale)
    save_file(weights, path, metadata={"format": "pt"})


def sample(checkpoint: Path, prompts: int, tokens: int, seed: int) -> list:
    rollout = RolloutSection(max_context=256, kv_cache_gib=0.125, dtype="bfloat16", sampling=SamplingSection(max_tokens=tokens))
    engine = EmbeddedEngine(checkpoint, rollout, seed=seed, routed_experts=True)
    rng = np.random.default_rng(seed)
    vocab = model_section_from_hf(checkpoint).vocab_size
    batch = [rng.integers(1, vocab, int(rng.integers(8, 24))).tolist() for _ in range(prompts)]
    try:
        return [group[0] for group in engine.generate(batch, seeds=list(range(prompts)))]
    finally:
        del engine


def segments(completions) -> list[Segment]:
    out = []
    for c in completions:
        n_prompt = len(c.prompt_ids)
        tokens = np.array(c.prompt_ids + c.token_ids)
        out.append(Segment(tokens, np.arange(len(tokens)) >= n_prompt, np.concatenate([np.zeros(n_prompt), c.logprobs]), c.routed_experts))
    return out


def routed_expert_bytes(segs: list[Segment]) -> dict[str, float]:
    tokens = sum(len(s.token_ids) for s in segs)
    raw = sum(s.routed_experts.nbytes for s in segs)
    group = [Trajectory(f"t{i}", "g", "task", 0, 0.0, [s]) for i, s in enumerate(segs)]
    bare = [Trajectory(t.id, "g", "task", 0, 0.0, [Segment(s.token_ids, s.loss_mask, s.logprobs)]) for t, s in zip(group, segs)]
    compressed = len(encode_group(group)) - len(encode_group(bare))
    return {"raw": raw / tokens, "compressed": compressed / tokens, "dtype": str(segs[0].routed_experts.dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48, help="tokens sampled per prompt")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--num-experts", type=int, default=32, help="more experts: closer top-k margins, more fragile routing")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--router-scale", type=float, default=None, help="1 = the router as initialised (default 0.3 for a random model)")
    parser.add_argument("--expert-scale", type=float, default=None, help="1 = the experts as initialised (default 8 for a random model)")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="an HF MoE checkpoint to use as it is (e.g. the smoke mid-training export) "
        "instead of a random one; the architecture options are then ignored",
    )
    args = parser.parse_args()
    default_scale = 1.0 if args.checkpoint else None
    args.router_scale = args.router_scale or default_scale or 0.3
    args.expert_scale = args.expert_scale or default_scale or 8.0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    base = load_recipe(REPO / "recipes/smoke-midtrain.yaml", []).model
    arch = base.model_copy(update=dict(num_experts=args.num_experts, moe_top_k=args.top_k, num_layers=args.num_layers))
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint:
            checkpoint = Path(shutil.copytree(args.checkpoint, Path(tmp) / "moe"))
        else:
            checkpoint = init_hf_checkpoint(arch, Path(tmp) / "moe", tokenizer_bytes=2**20)
        if (args.router_scale, args.expert_scale) != (1.0, 1.0):
            sharpen_moe(checkpoint, args.router_scale, args.expert_scale)
        m = model_section_from_hf(checkpoint)
        init_distributed(ParallelismSection())
        completions = sample(checkpoint, args.prompts, args.tokens, seed=0)
        segs = segments(completions)
        model = build_model(m, ParallelismSection())
        load_hf_into(model, m, checkpoint)
        model.eval()
        sums: dict[str, float] = {}
        maxima = {"logprob_abs_diff_free_max": 0.0, "logprob_abs_diff_replay_max": 0.0}
        total_tokens = 0
        for start in range(0, len(segs), args.micro_batch):
            chunk = segs[start : start + args.micro_batch]
            batch = pad_micro_batch([s.token_ids for s in chunk])
            metrics = replay_metrics(
                model, batch, [s.routed_experts for s in chunk], [s.logprobs for s in chunk], [s.loss_mask for s in chunk]
            )
            routed = sum(n - 1 for n in batch.lengths)
            generated = int(sum(s.loss_mask.sum() for s in chunk))
            for key, value in metrics.items():
                if key in maxima:
                    maxima[key] = max(maxima[key], value)
                else:
                    # disagreement is per routed token, logprob diffs per generated token
                    sums[key] = sums.get(key, 0.0) + value * (routed if key.startswith("routing") else generated)
            total_tokens += routed
            sums["_generated"] = sums.get("_generated", 0.0) + generated
        shutdown_distributed()
        storage = routed_expert_bytes(segs)

    generated = sums.pop("_generated")
    print(
        f"model: {m.num_layers} layers, {m.num_experts} experts top-{m.moe_top_k}, router x{args.router_scale}, "
        f"expert outputs x{args.expert_scale}; engine bf16 vLLM, learner fp32 Megatron"
    )
    print(f"samples: {len(segs)} sequences, {total_tokens} routed tokens, {int(generated)} generated tokens")
    print("routing disagreement with the engine (fraction of tokens whose expert set differs):")
    print(f"{'layer':>5} {'free run':>9} {'own top-k, r3 inputs':>21} {'r3':>7}")
    for layer in range(m.num_layers):
        free, own, replay = (sums[f"routing_disagreement_{kind}/layer{layer}"] / total_tokens for kind in ("free", "own", "replay"))
        print(f"{layer:>5} {free:>9.4f} {own:>21.4f} {replay:>7.4f}")
    mean_free = sums["logprob_abs_diff_free"] / generated
    mean_replay = sums["logprob_abs_diff_replay"] / generated
    max_free, max_replay = maxima["logprob_abs_diff_free_max"], maxima["logprob_abs_diff_replay_max"]
    print(f"|dlogprob| mean: off {mean_free:.3e}  r3 {mean_replay:.3e}  ratio off/r3 {mean_free / max(mean_replay, 1e-30):.1f}x")
    print(f"|dlogprob| max:  off {max_free:.3e}  r3 {max_replay:.3e}  ratio off/r3 {max_free / max(max_replay, 1e-30):.1f}x")
    print(
        f"routed experts per token ({storage['dtype']}, {m.num_layers} layers x top-{m.moe_top_k}): raw {storage['raw']:.1f} B, "
        f"in a zstd trajectory group {storage['compressed']:.1f} B ({storage['raw'] / storage['compressed']:.2f}x)"
    )


if __name__ == "__main__":
    main()
