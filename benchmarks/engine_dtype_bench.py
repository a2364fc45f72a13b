"""Generation speed of the CPU engine in float32 and bfloat16: what `rollout.dtype: auto` decides from.

Each (dtype, instruction set) runs in a fresh process: an embedded vLLM engine with the checkpoint generates greedily
`--prompts` completions of `--tokens` tokens, `--rounds` times; the generated tokens/s of its best round are printed
with the ratio bf16 / fp32. `--isa avx2` also runs both with oneDNN and ATen limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2,
ATEN_CPU_CAPABILITY=avx2): an approximation of a CPU without AVX-512 BF16 (vLLM's own CPU kernels keep what they
were built with), on this machine. The CPU's model name and bf16 flags are printed first.

    python benchmarks/engine_dtype_bench.py --checkpoint runs/smollm2 [--prompts 8] [--tokens 64] [--rounds 2] [--isa avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measure(checkpoint: str, dtype: str, prompts: int, tokens: int, rounds: int) -> None:
    """In this process: the best round's generated tokens/s, printed as JSON."""
    from composer.recipes.schema import RolloutSection, SamplingSection
    from composer.rollout.engines.vllm_engine import EmbeddedEngine

    rollout = RolloutSection(dtype=dtype, max_context=512, kv_cache_gib=0.25, sampling=SamplingSection(max_tokens=tokens))
    engine = EmbeddedEngine(checkpoint, rollout, seed=0, routed_experts=False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    batch = [tok.encode(f"Write a Python function number {i} that adds two numbers.") for i in range(prompts)]
    best = 0.0
    for _ in range(rounds):
        started = time.monotonic()
        out = engine.generate(batch, temperature=0.0)
        generated = sum(len(c.token_ids) for [c] in out)
        best = max(best, generated / (time.monotonic() - started))
    print("RESULT " + json.dumps({"tokens_per_s": best}), flush=True)


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = set(re.search(r"^flags\s*:\s*(.*)$", info, re.M).group(1).split())
    native = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return (
        f"{model.group(1) if model else 'unknown CPU'}, {os.cpu_count()} cores, AVX-512 {'yes' if 'avx512f' in flags else 'no'}, "
        f"native bf16: {', '.join(native) or 'none'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--isa", choices=["native", "avx2"], action="append", default=None)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args.checkpoint, args.measure, args.prompts, args.tokens, args.rounds)
    print(f"CPU: {cpu_line()}")
    for isa in args.isa or ["native"]:
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
        if isa == "avx2":
            env |= {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
        speed = {}
        for dtype in ("float32", "bfloat16"):
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--checkpoint",
                    args.checkpoint,
                    "--measure",
                    dtype,
                    "--prompts",
                    str(args.prompts),
                    "--tokens",
                    str(args.tokens),
                    "--rounds",
                    str(args.rounds),
                ],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                sys.exit(f"{dtype} ({isa}) failed:\n{done.stderr[-3000:]}")
            speed[dtype] = json.loads(lines[-1][len("RESULT ") :])["tokens_per_s"]
            print(
                f"{isa:>6} {dtype:>8}: {speed[dtype]:7.1f} generated tokens/s ({args.prompts} prompts x {args.tokens} tokens, best of {args.rounds})",
                flush=True,
            )
        print(f"{isa:>6} bf16 / fp32: {speed['bfloat16'] / speed['float32']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
