"""GPU smoke of the model provider (one GPU, torch CUDA, no Transformer Engine).

1. Parity: a tiny random Qwen3-MoE HF checkpoint, loaded into Megatron and into transformers in bf16:
   max |logit diff| and the share of identical top-k expert choices per token and layer.
2. Speed: tokens/s of a training step (forward, backward, AdamW) of a Qwen3-30B-A3B-shaped slice
   (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts top-8, expert FFN 768), Megatron vs the
   transformers implementation of the same slice in the same run, and their ratio.

Run: `python benchmarks/gpu_model_smoke.py [--layers 2 --seq 4096]`. Without CUDA it runs in fp32 on CPU,
which only checks the code path (use small sizes: --layers 1 --hidden 256 --experts 8 --seq 128 --vocab 4096).
Exits non-zero if parity fails (bf16: top-k agreement < 0.97 or max logit diff > 0.25).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from composer.recipes.schema import ModelSection, ParallelismSection
from composer.trainer.checkpoint_init import init_hf_checkpoint
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.model import build_model, causal_mask, forward_logits, hf_config_from_model_section
from composer.trainer.weights import load_hf_into

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = "bfloat16" if CUDA else "float32"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def parity(tmp: Path) -> bool:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from transformers import AutoModelForCausalLM

    tiny = ModelSection(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=64,
        num_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=256,
        vocab_size=4096,
        max_position_embeddings=1024,
        dtype="float32",
    )
    checkpoint = init_hf_checkpoint(tiny, tmp / "tiny", tokenizer_bytes=2**20)
    m = tiny.model_copy(update={"dtype": DTYPE})
    model = build_model(m, ParallelismSection()).eval()
    load_hf_into(model, m, checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, DTYPE)).to(DEVICE)
    batch, seq = 2, 128
    tokens = torch.randint(1, m.vocab_size, (batch, seq), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        ours = forward_logits(model, tokens).float()
        out = hf(tokens, output_router_logits=True)
    routes = [r.view(seq, batch, -1).transpose(0, 1).sort(-1).values for r in RouterReplay.get_recorded_data()]
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    hf_routes = [r.view(batch, seq, -1).topk(m.moe_top_k, -1).indices.sort(-1).values for r in out.router_logits]
    agree = sum((a == b).all(-1).float().mean().item() for a, b in zip(routes, hf_routes)) / len(routes)
    diff = (ours - out.logits.float()).abs().max().item()
    print(f"parity ({DTYPE}, {DEVICE}): max |logit diff| {diff:.3e}, top-k expert agreement {agree:.4f}")
    return agree >= 0.97 and diff <= (0.25 if CUDA else 1e-4)


def slice_section(args) -> ModelSection:
    return ModelSection(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=args.experts,
        moe_top_k=min(8, args.experts),
        moe_ffn_hidden_size=768,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 4096),
        rope_theta=1_000_000.0,
        dtype=DTYPE,
    )


def time_steps(step, tokens_per_step: int, steps: int) -> float:
    step()  # warm-up: allocator, kernels
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return tokens_per_step * steps / (time.perf_counter() - start)


def megatron_tokens_per_s(m: ModelSection, tokens: torch.Tensor, steps: int) -> float:
    model = build_model(m, ParallelismSection())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    batch, seq = inputs.shape
    position_ids = torch.arange(seq, device=DEVICE).expand(batch, seq)
    mask = causal_mask(seq, DEVICE)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(inputs, position_ids, mask, labels=labels).mean().backward()
        optimizer.step()

    rate = time_steps(step, batch * seq, steps)
    return rate


def transformers_tokens_per_s(m: ModelSection, tokens: torch.Tensor, steps: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**hf_config_from_model_section(m, getattr(torch, DTYPE)))
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPE)).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()

    rate = time_steps(step, tokens.shape[0] * (tokens.shape[1] - 1), steps)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    init_distributed(ParallelismSection())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ok = parity(Path(tmp))
        m = slice_section(args)
        tokens = torch.randint(0, m.vocab_size, (args.batch, args.seq + 1), device=DEVICE)
        ours = megatron_tokens_per_s(m, tokens, args.steps)
        if CUDA:
            torch.cuda.empty_cache()
        theirs = transformers_tokens_per_s(m, tokens, args.steps)
        print(
            f"train step, {args.layers} layers x hidden {args.hidden}, {args.experts} experts top-{m.moe_top_k}, "
            f"batch {args.batch} x seq {args.seq} ({DTYPE}, {DEVICE}): Megatron {ours:,.0f} tokens/s, "
            f"transformers {theirs:,.0f} tokens/s, ratio {ours / theirs:.2f}"
        )
    finally:
        shutdown_distributed()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
