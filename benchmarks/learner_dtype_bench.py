"""Which learner dtype recomputes a bf16 engine's logprobs more closely (the IS ratio's train/inference mismatch)?

A tiny random model (recipes/smoke-midtrain.yaml's Qwen3-MoE) is exported in bf16 and served by vLLM in bf16;
Megatron loads the same bf16 weights as `model.dtype` float32 and bfloat16, each with the local spec and the fast
kernels (model.kernels), replays the engine's expert routes (rl.router_replay: r3) and rescores the same prompts.
Prints mean and max |learner - engine| logprob per learner setting, and each mean against the fp32 local spec's.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/learner_dtype_bench.py [--sequences 8 --seq 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from composer.recipes.loader import load_recipe
from composer.recipes.schema import KernelsSection, ParallelismSection
from composer.trainer.checkpoint_init import init_hf_checkpoint
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.logprobs import pad_micro_batch, token_logprobs
from composer.trainer.model import build_model
from composer.trainer.router_replay import replay_for_micro_batch, routing
from composer.trainer.weights import export_hf, load_hf_into

REPO = Path(__file__).resolve().parent.parent


def engine_logprobs_and_routes(served: Path, tokens: torch.Tensor, seq: int):
    """vLLM bf16 prompt logprobs [B, S-1] of `tokens` and the routes it used per sequence [S-1, layers, top_k]."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(served),
        tokenizer=None,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=seq + 8,
        seed=0,
        enable_return_routed_experts=True,
    )
    try:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=row.tolist()) for row in tokens],
            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False),
        )
    finally:
        del llm
    logprobs = torch.stack(
        [torch.tensor([out.prompt_logprobs[t][int(tokens[b, t])].logprob for t in range(1, seq)]) for b, out in enumerate(outputs)]
    )
    routes = [out.outputs[0].routed_experts[: seq - 1].astype("int64") for out in outputs]
    return logprobs, routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="learner-dtype-"))
    checkpoint = init_hf_checkpoint(load_recipe(REPO / "recipes/smoke-midtrain.yaml", []).model, work / "init", tokenizer_bytes=2**20)
    m = model_section_from_hf(checkpoint)
    p = ParallelismSection()
    init_distributed(p)
    model = build_model(m, p)
    load_hf_into(model, m, checkpoint)
    export_hf(model, m, work / "bf16", tokenizer_dir=None, dtype=torch.bfloat16)  # the policy as the engine gets it
    tokens = torch.randint(1, m.vocab_size, (args.sequences, args.seq), generator=torch.Generator().manual_seed(0))
    engine, routes = engine_logprobs_and_routes(work / "bf16", tokens, args.seq)
    print(f"{m.family}, {args.sequences} x {args.seq} tokens, vLLM bf16 engine; learner replays the engine's routes\n")
    print(f"{'learner':<28} | {'mean |diff|':>11} {'max |diff|':>10} | {'mean vs fp32 local':>18}")
    baseline = None
    for dtype in ("float32", "bfloat16"):
        for label, kernels in (
            ("local spec", KernelsSection(experts="sequential", attention="local")),
            ("grouped + sdpa", KernelsSection()),
        ):
            learner_m = m.model_copy(update={"dtype": dtype, "kernels": kernels})
            learner = build_model(learner_m, p).eval()
            load_hf_into(learner, learner_m, work / "bf16")
            batch = pad_micro_batch(list(tokens.numpy()))
            with routing(learner, replay_for_micro_batch(learner, "r3", routes, batch.layout)):
                ours = token_logprobs(learner, batch.tokens, with_grad=False).float()
            diff = (ours - engine).abs()
            baseline = baseline or float(diff.mean())
            print(
                f"{dtype + ', ' + label:<28} | {float(diff.mean()):11.5f} {float(diff.max()):10.4f} | {float(diff.mean()) / baseline:17.2f}x",
                flush=True,
            )
    shutdown_distributed()


if __name__ == "__main__":
    main()
