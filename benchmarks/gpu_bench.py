"""GPU benchmark of the model kernels (model.kernels), bf16 training and the device sync encoder; one run, one GPU.

1. Speed: training steps (forward, backward, Megatron's bf16 optimizer with fp32 master weights) of a
   Qwen3-30B-A3B-shaped slice (4 layers: hidden 2048, 32 query / 4 KV heads of 128, 128 experts top-8 of 768) and a
   DeepSeek-V3 / Kimi-K2-shaped slice (2 MoE layers: hidden 7168, MLA with 64 heads, q_lora 1536, kv_lora 512,
   32 experts top-8 of 2048 + 1 shared; vocab cut to 32768), under four kernel choices: the local spec
   (experts: sequential, attention: local) as the baseline, grouped experts only, SDPA only, both. Tokens/s,
   achieved TFLOP/s, MFU (model FLOPs: 6 x active matmul parameters x tokens + attention scores, full s^2 as
   Megatron counts them, against the GPU's dense bf16 peak) and peak memory; ratios against the baseline.
2. Parity: the loss of 20 steps on the same data, bf16, new kernels vs the local spec; the bf16-vs-fp32 gap of
   the local spec on the same steps is printed beside it as the scale of bf16 noise.
3. Sync: DeviceDeltaEncoder (sync/device.py) on a bf16 model of --sync-gb held in device memory, a fraction of
   its elements changed, against the host encoder (sync.codec) on the first GB of the same pieces; payloads must match.

    PYTHONPATH=. python benchmarks/gpu_bench.py            # on one H200: under 5 minutes
    PYTHONPATH=. python benchmarks/gpu_bench.py --small    # CPU-sized shapes (kernel ratios on CPU, fp32 speed)
    PYTHONPATH=. python benchmarks/gpu_bench.py --tiny     # smallest shapes, any machine (CI: seconds)
Without CUDA everything runs on CPU: speed in fp32 (MFU n/a), parity and sync as on the GPU.
On a GPU machine whose Python (3.12, CUDA torch) lacks the project's packages, carry them as wheels:
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 zstandard==0.25.0
    # there: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site python3 benchmarks/gpu_bench.py
Exits non-zero when a configuration fails (the others still run), a payload differs, or the bf16 parity gap
exceeds 3x the bf16-vs-fp32 gap.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer.recipes.errors import UserError  # noqa: E402
from composer.recipes.schema import KernelsSection, ModelSection, OptimSection, ParallelismSection  # noqa: E402
from composer.recipes.sizes import parameter_counts  # noqa: E402
from composer.trainer.distributed import init_distributed, shutdown_distributed  # noqa: E402
from composer.trainer.logprobs import token_logprobs  # noqa: E402
from composer.trainer.model import build_model  # noqa: E402
from composer.trainer.optimizer import TrainOptimizer, wrap_data_parallel  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
"""Dense bf16 tensor-core peak (no sparsity) by device name."""

KERNELS = {
    "local spec": KernelsSection(experts="sequential", attention="local"),
    "grouped experts": KernelsSection(experts="grouped", attention="local"),
    "sdpa attention": KernelsSection(experts="sequential", attention="sdpa"),
    "grouped + sdpa": KernelsSection(experts="grouped", attention="sdpa"),
}
QWEN3 = dict(
    family="qwen3_moe",
    num_layers=4,
    hidden_size=2048,
    num_attention_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    moe_top_k=8,
    moe_ffn_hidden_size=768,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1e6,
)
DEEPSEEK_V3 = dict(
    family="deepseek_v3",
    num_layers=2,
    hidden_size=7168,
    num_attention_heads=64,
    num_kv_heads=64,
    head_dim=192,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts=32,
    moe_top_k=8,
    moe_ffn_hidden_size=2048,
    num_shared_experts=1,
    routed_scaling_factor=2.827,
    vocab_size=32768,
    max_position_embeddings=16384,
    rope_theta=50000.0,
)
SIZES = {
    # name: (qwen3 overrides, deepseek overrides, seq, timed steps, parity seq, sync GB)
    "full": ({}, {}, 4096, 4, 512, 4.0),
    "small": (
        dict(
            hidden_size=512,
            num_attention_heads=8,
            num_kv_heads=2,
            head_dim=64,
            num_experts=32,
            moe_top_k=4,
            moe_ffn_hidden_size=256,
            vocab_size=8192,
        ),
        dict(
            hidden_size=512,
            num_attention_heads=8,
            num_kv_heads=8,
            q_lora_rank=128,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            head_dim=96,
            v_head_dim=64,
            num_experts=16,
            moe_top_k=4,
            moe_ffn_hidden_size=256,
            vocab_size=8192,
        ),
        512,
        6,
        128,
        0.25,
    ),
    "tiny": (
        dict(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=16,
            num_experts=8,
            moe_top_k=2,
            moe_ffn_hidden_size=32,
            vocab_size=512,
        ),
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_kv_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            head_dim=32,
            v_head_dim=16,
            num_experts=8,
            moe_top_k=2,
            moe_ffn_hidden_size=32,
            vocab_size=512,
        ),
        64,
        5,
        32,
        0.02,
    ),
}


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def model_flops_per_token(m: ModelSection, seq: int) -> float:
    """Training FLOPs per token: 6 x active matmul parameters (the input embedding is a lookup) + attention scores."""
    _, active = parameter_counts(m)
    matmul = active - m.vocab_size * m.hidden_size * (0 if m.tie_word_embeddings else 1)
    if m.family == "deepseek_v3":
        per_head = (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.v_head_dim
    else:
        per_head = 2 * m.head_dim
    attention = 2 * seq * m.num_attention_heads * per_head * m.num_layers  # QK^T and AV, forward, per query token
    return 6 * matmul + 3 * attention


def train(m: ModelSection, batches: list[torch.Tensor], warmup: int = 0) -> tuple[list[float], float, int | None]:
    """Losses of one step per batch (a fresh model, seed 0), median seconds per step after `warmup`, peak GPU memory."""
    p = ParallelismSection()
    init_distributed(p, seed=0)  # joins the process group once, rebuilds Megatron's groups and seeds every time
    torch.manual_seed(0)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    try:
        model = build_model(m, p)
        ddp = wrap_data_parallel(model, p)
        optimizer = TrainOptimizer(ddp, OptimSection(lr=3e-4, schedule="constant"), p, len(batches), getattr(torch, m.dtype))
        losses, step_seconds = [], []
        for tokens in batches:
            sync()
            started = time.perf_counter()
            optimizer.zero_grad()
            loss = -token_logprobs(ddp, tokens.to(DEVICE)).mean()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))  # a device sync
            step_seconds.append(time.perf_counter() - started)
        # the median step: robust to other jobs sharing the machine
        seconds = float(np.median(step_seconds[warmup:] or step_seconds))
        # on CPU the process's peak RSS only grows from one configuration to the next: printed once at the end
        peak = torch.cuda.max_memory_allocated() if CUDA else None
        return losses, seconds, peak
    finally:
        # the next configuration starts from free memory (one GPU holds one slice with its optimizer at a time)
        model = ddp = optimizer = None
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()


def random_batches(m: ModelSection, n: int, seq: int, seed: int = 0, batch: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, m.vocab_size, (batch, seq), generator=generator) for _ in range(n)]


def speed(name: str, m: ModelSection, seq: int, steps: int, batch: int, failed: list[str]) -> None:
    peak_tflops = next((v for k, v in PEAK_BF16_TFLOPS.items() if CUDA and k in torch.cuda.get_device_name()), None)
    flops = model_flops_per_token(m, seq) * seq * batch
    total, active = parameter_counts(m)
    print(
        f"\n{name} slice, {m.dtype}: {m.num_layers} layers, {total / 1e9:.2f} B parameters ({active / 1e9:.2f} B active), "
        f"{batch} x {seq} tokens, {flops / 1e12:.2f} TFLOP per step",
        flush=True,
    )
    print(f"{'kernels':<16} | {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak memory':>12} | {'speedup x':>9}")
    baseline = None
    for label, kernels in KERNELS.items():
        try:
            _, seconds, peak = train(m.model_copy(update={"kernels": kernels}), random_batches(m, 2 + steps, seq, batch=batch), warmup=2)
        except (UserError, RuntimeError) as e:  # e.g. out of memory: the other rows are still worth having
            print(f"{label:<16} | failed: {str(e).splitlines()[0][:200]}", flush=True)
            failed.append(f"{name}: {label}")
            continue
        if label == "local spec":
            baseline = seconds
        mfu = f"{100 * flops / seconds / 1e12 / peak_tflops:5.1f}%" if peak_tflops else "   n/a"
        ratio = f"{baseline / seconds:9.2f}" if baseline else "      n/a"
        memory = f"{peak / 2**30:.2f} GiB" if peak else "n/a"
        print(f"{label:<16} | {batch * seq / seconds:10.0f} {flops / seconds / 1e12:8.3f} {mfu:>6} {memory:>12} | {ratio}", flush=True)


def parity(m: ModelSection, seq: int, steps: int = 20) -> bool:
    """bf16 loss curves of the new kernels and of the local spec on the same 20 batches, beside the fp32 local spec."""
    batches = random_batches(m, steps, seq, seed=1)
    local, fast = KERNELS["local spec"], KERNELS["grouped + sdpa"]
    bf16_local, _, _ = train(m.model_copy(update={"kernels": local, "dtype": "bfloat16"}), batches)
    bf16_fast, _, _ = train(m.model_copy(update={"kernels": fast, "dtype": "bfloat16"}), batches)
    fp32_local, _, _ = train(m.model_copy(update={"kernels": local, "dtype": "float32"}), batches)
    gap = max(abs(a - b) for a, b in zip(bf16_fast, bf16_local))
    noise = max(abs(a - b) for a, b in zip(bf16_local, fp32_local))
    ok = gap <= 3 * max(noise, 1e-3)
    print(
        f"parity ({m.family}, bf16, {steps} steps, seq {seq}): loss {bf16_local[0]:.4f} -> {bf16_local[-1]:.4f} (local spec), "
        f"{bf16_fast[0]:.4f} -> {bf16_fast[-1]:.4f} (grouped + sdpa); max |new - local| {gap:.4f}, "
        f"bf16 noise max |bf16 - fp32| {noise:.4f} -> {'ok' if ok else 'FAIL'}",
        flush=True,
    )
    return ok


def sync_encode(size_gb: float, changed: float = 0.05) -> bool:
    """GB/s of the device encoder on a bf16 model in device memory vs the host encoder on the same pieces."""
    from benchmarks.sync_bench import threading_local_compressors
    from composer.sync.codec import encode_piece
    from composer.sync.device import DeviceDeltaEncoder
    from composer.sync.pool import num_threads, ordered_map

    piece = 16 << 20  # bf16 elements per piece (32 MiB)
    numel = int(size_gb * 1e9 / 2)
    generator = torch.Generator(DEVICE).manual_seed(0)
    old = (torch.randn(numel, device=DEVICE, generator=generator) * 0.02).to(torch.bfloat16)
    moved = torch.rand(numel, device=DEVICE, generator=generator) < changed
    # an optimizer-like step: the moved elements change by more than one bf16 rounding step, the rest keep their bits
    new = torch.where(moved, (old.float() * (1 + 2**-6) + 1e-6).to(torch.bfloat16), old)
    del moved
    old, new = old.view(torch.int16), new.view(torch.int16)
    pieces = [(new[a : a + piece], old[a : a + piece]) for a in range(0, numel, piece)]
    threads = num_threads(0)
    encoder = DeviceDeltaEncoder(DEVICE, threads=threads)
    list(encoder.encode(pieces[:1]))  # warm-up
    sync()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    on_device = list(encoder.encode(pieces))
    device_s = time.perf_counter() - started
    subset = pieces[: max(1, int(1e9 / 2) // piece)]
    host_pieces = [(n.cpu().numpy().view(np.uint16), o.cpu().numpy().view(np.uint16)) for n, o in subset]
    compressors = threading_local_compressors()
    started = time.perf_counter()
    on_host = list(ordered_map(lambda pair: encode_piece(pair[0], pair[1], compressors()), host_pieces, threads))
    host_s = time.perf_counter() - started
    nbytes, host_bytes = numel * 2, sum(n.size * 2 for n, _ in host_pieces)
    identical = on_device[: len(on_host)] == on_host
    stored = sum(len(e.payload) for e in on_device)
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if CUDA else "n/a"
    print(
        f"\nsync encode: {nbytes / 1e9:.2f} GB bf16 on {DEVICE}, {100 * changed:.0f}% of elements changed -> {stored / 2**20:.1f} MiB; "
        f"device encoder {nbytes / 1e9 / device_s:.2f} GB/s, host encoder ({threads} threads, first {host_bytes / 1e9:.2f} GB) "
        f"{host_bytes / 1e9 / host_s:.2f} GB/s, speedup x {(nbytes / device_s) / (host_bytes / host_s):.2f}; "
        f"payloads identical: {identical}; peak memory during encode {peak}",
        flush=True,
    )
    return identical


def guarded(label: str, failed: list[str], fn, *args) -> bool:
    """fn(*args), or False with the error printed and recorded: one failing part does not cost the others."""
    try:
        return fn(*args)
    except (UserError, RuntimeError) as e:
        print(f"{label} failed: {str(e).splitlines()[0][:200]}", flush=True)
        failed.append(label)
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="smallest shapes (CI; seconds on a CPU)")
    size.add_argument("--small", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--seq", type=int, help="sequence length of the speed runs (default: by size, 4096 for full)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step of the speed runs")
    parser.add_argument("--families", nargs="+", default=["qwen3_moe", "deepseek_v3"], choices=["qwen3_moe", "deepseek_v3"])
    args = parser.parse_args()
    size = "tiny" if args.tiny else "small" if args.small else "full"
    qwen_overrides, deepseek_overrides, seq, steps, parity_seq, sync_gb = SIZES[size]
    seq = args.seq or seq
    torch.set_num_threads(torch.get_num_threads() if CUDA else 1)
    started = time.perf_counter()
    device = torch.cuda.get_device_name() if CUDA else "CPU"
    print(f"gpu_bench --{size}: {device}, torch {torch.__version__}; speed in {'bfloat16' if CUDA else 'float32'}", flush=True)
    slices = {
        "qwen3_moe": ModelSection(**{**QWEN3, **qwen_overrides}),
        "deepseek_v3": ModelSection(**{**DEEPSEEK_V3, **deepseek_overrides}),
    }
    ok, failed = True, []
    for family in args.families:
        m = slices[family].model_copy(update={"dtype": "bfloat16" if CUDA else "float32"})
        speed(family, m, seq, steps, args.batch, failed)
        ok &= guarded(f"{family} parity", failed, parity, m, parity_seq)
    ok &= guarded("sync encode", failed, sync_encode, sync_gb)
    shutdown_distributed()
    print(
        f"\npeak memory of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB host"
        + (f", {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved on the GPU" if CUDA else "")
        + f"; total {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
    sys.exit(0 if ok and not failed else 1)


if __name__ == "__main__":
    main()
