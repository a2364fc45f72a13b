"""Peak host memory of importing and exporting a published-format checkpoint, against the checkpoint's size.

Writes a synthetic DeepSeek-V3-shaped checkpoint in block fp8 (e4m3 + weight_scale_inv, 128 x 128 blocks) of at
least --gib GiB in --shard-mb shards (itself shard by shard), then, under torchrun with --ep ranks, builds the
Megatron model in bf16, imports the checkpoint (dequantizing) and exports it again in fp8; each rank records its
RSS after building the model and its peak RSS during import and during export (VmHWM, reset between phases). The
figures that matter are the peaks above the model's own memory: what reading and writing cost, against the
checkpoint and one shard. Finally every exported tensor is compared with the source, one at a time.

    python benchmarks/checkpoint_stream_bench.py [--gib 4] [--ep 2] [--shard-mb 512] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

HIDDEN, EXPERTS, MOE_FFN, FFN, VOCAB = 1024, 64, 512, 2048, 8192
ATTENTION = dict(num_attention_heads=8, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)


def config(layers: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "moe_intermediate_size": MOE_FFN,
        "num_hidden_layers": layers,
        "first_k_dense_replace": 1,
        "num_key_value_heads": 8,
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        **ATTENTION,
    }


def shapes(m) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the architecture with its shape."""
    from composer.trainer.weights import expected_hf_names

    h, heads = m.hidden_size, m.num_attention_heads
    by_suffix = {
        "embed_tokens.weight": (m.vocab_size, h),
        "lm_head.weight": (m.vocab_size, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "q_a_proj.weight": (m.q_lora_rank, h),
        "q_a_layernorm.weight": (m.q_lora_rank,),
        "q_b_proj.weight": (heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
        "kv_a_layernorm.weight": (m.kv_lora_rank,),
        "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        "o_proj.weight": (h, heads * m.v_head_dim),
        "mlp.gate.weight": (m.num_experts, h),
        "e_score_correction_bias": (m.num_experts,),
    }
    out = {}
    for name in sorted(expected_hf_names(m)):
        width = (
            m.moe_ffn_hidden_size * (m.num_shared_experts if "shared_experts" in name else 1) if "experts." in name else m.ffn_hidden_size
        )
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = (width, h)
        elif name.endswith("down_proj.weight"):
            out[name] = (h, width)
        else:
            out[name] = next(shape for suffix, shape in by_suffix.items() if name.endswith(suffix))
    return out


def synthesize(out: Path, gib: float, shard_mb: int) -> tuple[int, int]:
    """The checkpoint, written shard by shard; returns (bytes, shards)."""
    from safetensors.torch import save_file

    from composer.trainer.hf_config import model_section_from_hf

    per_layer = EXPERTS * 3 * HIDDEN * MOE_FFN
    layers = math.ceil(gib * 2**30 / per_layer) + 1
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config(layers)))
    m = model_section_from_hf(out)
    shard, size, files, weight_map, total = {}, 0, [], {}, 0
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)

    def flush():
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in shard})
        files.append(name)
        shard, size = {}, 0

    for name, shape in shapes(m).items():
        if ".layers." in name and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            codes = rng.integers(0, 0xFF, size=shape, dtype=np.uint8)  # random e4m3 bit patterns but NaN (0x7f, 0xff)
            codes[codes == 0x7F] = 0x7E
            tensors = {
                name: torch.from_numpy(codes).view(torch.float8_e4m3fn),
                name.removesuffix(".weight") + ".weight_scale_inv": torch.full(
                    (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)), 0.01
                ),
            }
        elif name.endswith("e_score_correction_bias"):
            tensors = {name: torch.zeros(shape)}
        else:
            tensors = {name: (torch.randn(shape, generator=gen) * 0.02 + (1 if name.endswith("norm.weight") else 0)).to(torch.bfloat16)}
        for n, t in tensors.items():
            shard[n] = t
            size += t.numel() * t.element_size()
            total += t.numel() * t.element_size()
        if size >= shard_mb * 2**20:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total, len(files)


def _rss() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def worker(checkpoint: Path, out: Path, ep: int, shard_mb: int, results: Path) -> None:
    from composer.recipes.schema import ParallelismSection
    from composer.trainer.distributed import init_distributed, shutdown_distributed
    from composer.trainer.hf_config import model_section_from_hf
    from composer.trainer.model import build_model
    from composer.trainer.weights import export_hf, load_hf_into

    torch.set_num_threads(1)
    p = ParallelismSection(ep=ep)
    init_distributed(p)
    m = model_section_from_hf(checkpoint, dtype="bfloat16")
    model = build_model(m, p)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t))
    built = _rss()["VmRSS"]
    _reset_peak()
    start = time.perf_counter()
    load_hf_into(model, m, checkpoint)
    load_seconds, after_load = time.perf_counter() - start, _rss()
    _reset_peak()
    start = time.perf_counter()
    export_hf(model, m, out, quantize="fp8", max_shard_bytes=shard_mb * 2**20)
    export_seconds, after_export = time.perf_counter() - start, _rss()
    rank = torch.distributed.get_rank()
    record = {
        "rank": rank,
        "model_bytes": model_bytes,
        "built_rss": built,
        "import_peak": after_load["VmHWM"],
        "import_seconds": load_seconds,
        "export_base": after_load["VmRSS"],
        "export_peak": after_export["VmHWM"],
        "export_seconds": export_seconds,
    }
    (results / f"rank{rank}.json").write_text(json.dumps(record))
    shutdown_distributed()


def compare(a: Path, b: Path) -> int:
    """Tensors of b that differ from a's (bit patterns), read one at a time."""
    from safetensors import safe_open

    from composer.trainer.weights import hf_weight_files

    fa, fb = hf_weight_files(a), hf_weight_files(b)
    if set(fa) != set(fb):
        return len(set(fa) ^ set(fb))
    differing = 0
    for name in sorted(fa):
        with safe_open(fa[name], "pt") as x, safe_open(fb[name], "pt") as y:
            s, t = x.get_tensor(name), y.get_tensor(name)
        differing += not (s.dtype == t.dtype and torch.equal(s.view(torch.uint8), t.view(torch.uint8)))
    return differing


def run_ranks(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """This script's worker as `nproc` gloo ranks under torchrun, output captured."""
    from composer.cluster.launch import torchrun_argv

    return subprocess.run(
        torchrun_argv(sys.executable, nproc, "benchmarks.checkpoint_stream_bench", args),
        cwd=REPO,
        env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--shard-mb", type=int, default=512)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    parser.add_argument("--worker", nargs=3, type=Path, metavar=("CHECKPOINT", "OUT", "RESULTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.ep, args.shard_mb, args.worker[2])
        return
    work = args.dir or Path(tempfile.mkdtemp(prefix="stream-bench-"))
    try:
        start = time.perf_counter()
        size, shards = synthesize(work / "source", args.gib, args.shard_mb)
        print(
            f"checkpoint: {size / 2**30:.2f} GiB block fp8 in {shards} shards of ~{args.shard_mb} MiB (written in {time.perf_counter() - start:.0f} s)"
        )
        (work / "results").mkdir()
        result = run_ranks(
            args.ep,
            [
                "--ep",
                str(args.ep),
                "--shard-mb",
                str(args.shard_mb),
                "--worker",
                str(work / "source"),
                str(work / "export"),
                str(work / "results"),
            ],
        )
        if result.returncode != 0:
            sys.exit(f"worker failed:\n{result.stderr[-3000:]}")
        shard = args.shard_mb * 2**20
        print(
            "rank  model on rank  RSS built  import: peak  above model  / ckpt  / shard   s   export: peak  above base  / ckpt  / shard   s"
        )
        for path in sorted((work / "results").glob("rank*.json")):
            r = json.loads(path.read_text())
            up, out = r["import_peak"] - r["built_rss"], r["export_peak"] - r["export_base"]
            print(
                f"{r['rank']:>4}  {r['model_bytes'] / 2**30:>9.2f} GiB  {r['built_rss'] / 2**30:>6.2f} GiB  {r['import_peak'] / 2**30:>8.2f} GiB"
                f"  {up / 2**30:>7.2f} GiB  {up / size:>5.2f}  {up / shard:>6.2f}  {r['import_seconds']:>4.0f}"
                f"  {r['export_peak'] / 2**30:>8.2f} GiB  {out / 2**30:>6.2f} GiB  {out / size:>5.2f}  {out / shard:>6.2f}  {r['export_seconds']:>4.0f}"
            )
        print(f"export vs source: {compare(work / 'source', work / 'export')} tensor(s) differ")
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
