"""Benchmark `composer sync`: bytes shipped, encode/decode throughput and peak memory, against baselines
run in the same job (full copy, zstd of the whole checkpoint, dense XOR + zstd).

Synthetic mode (default): a bf16 model of --size-gb whose next version comes from an optimizer-like step:
fp32 master weights + a small update, rounded to bf16, with the update size calibrated so that the
requested fraction of bf16 elements changes (the rest keep their bit pattern, as in RL steps).
fp8 mode (--fp8): the same optimizer step on fp32 master weights, served as DeepSeek-V3/Kimi checkpoints store
them: each matrix in float8 e4m3 plus a `weight_scale_inv` fp32 scale per 128x128 block (re-quantized every
step, so a block whose max moved changes its scale and may shift all of its values).
Real mode: --checkpoints DIR0 DIR1 ... pushes consecutive checkpoint directories in order.
Device mode (--device cuda|cpu): encode throughput of weights already in (GPU) memory with the torch encoder
(diff and gather on the device, pinned copies, compression overlapped), against the numpy host encoder on the
same pieces in the same run; the payloads must be identical.

Each push and pull runs in a fresh process so its peak RSS is its own. Files are read from the page
cache (they were just written); other processes sharing the CPUs make throughput a lower bound.
"decode" is a pull: it writes (and fsyncs) a complete new checkpoint directory, so it is bounded by the
disk's write speed; "apply" is a live receiver updating in-memory tensors with `apply_version`.

    PYTHONPATH=. python benchmarks/sync_bench.py --size-gb 1
    PYTHONPATH=. python benchmarks/sync_bench.py --fp8 --densities 2
    PYTHONPATH=. python benchmarks/sync_bench.py --device cuda --size-gb 2
    PYTHONPATH=. python benchmarks/sync_bench.py --checkpoints ckpt/step1 ckpt/step2 ckpt/step3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer.recipes.schema import SyncSection  # noqa: E402
from composer.sync.checkpoint import Checkpoint, write_safetensors  # noqa: E402

SHAPE = (4096, 4096)  # 32 MiB of bf16 per matrix
HIDDEN = SHAPE[1]


# --- the model ---------------------------------------------------------------------------------


def to_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _master(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(SHAPE, dtype=np.float32) * 0.02


def _stepped(master: np.ndarray, i: int, relative_step: float) -> np.ndarray:
    """master + an Adam-like update: every element moves by a small amount relative to its size."""
    noise = np.random.default_rng((i, 1)).standard_normal(master.shape, dtype=np.float32)
    return master + noise * np.abs(master) * np.float32(relative_step)


def calibrate(density: float) -> float:
    """Relative step size that changes `density` of the bf16 elements (linear in the step for small steps)."""
    master = _master(10_000)
    probe = 1e-3
    changed = np.mean(to_bf16(_stepped(master, 10_000, probe)) != to_bf16(master))
    return probe * density / changed


def write_model(directory: Path, num_matrices: int, relative_step: float | None) -> None:
    """Layers of `num_matrices` 4096x4096 bf16 matrices plus a norm vector each, in 1 GiB shards."""
    directory.mkdir(parents=True)
    shard: dict = {}
    shard_bytes, shard_index = 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, shard_index
        if shard:
            write_safetensors(directory / f"model-{shard_index:05d}.safetensors", shard)
            shard, shard_bytes, shard_index = {}, 0, shard_index + 1

    for i in range(num_matrices):
        master = _master(i)
        weights = master if relative_step is None else _stepped(master, i, relative_step)
        shard[f"model.layers.{i}.weight"] = ("BF16", to_bf16(weights))
        norm = np.ones(HIDDEN, np.float32) + (0 if relative_step is None else np.float32(relative_step * (i % 2)))
        shard[f"model.layers.{i}.norm.weight"] = ("BF16", to_bf16(norm))
        shard_bytes += weights.size * 2
        if shard_bytes >= 1 << 30:
            flush()
    flush()
    (directory / "config.json").write_text('{"architectures": ["SyntheticBf16"], "torch_dtype": "bfloat16"}\n')


FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8 e4m3fn


def to_fp8_blocks(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 bit patterns, fp32 weight_scale_inv per 128x128 block) with weights ~= fp8 * scale_inv."""
    import torch

    rows, cols = weights.shape
    blocks = torch.from_numpy(weights).reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    fp8 = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
    return fp8.view(torch.uint8).numpy(), scale_inv.float().numpy()


def calibrate_fp8(density: float) -> float:
    master = _master(10_000)
    probe = 1e-2
    before, _ = to_fp8_blocks(master)
    after, _ = to_fp8_blocks(_stepped(master, 10_000, probe))
    return probe * density / np.mean(before != after)


def write_fp8_model(directory: Path, num_matrices: int, relative_step: float | None) -> None:
    """Layers of 4096x4096 e4m3 matrices with their block scales, one 1 GiB-ish shard per 64 matrices."""
    directory.mkdir(parents=True)
    shard: dict = {}
    for i in range(num_matrices):
        master = _master(i)
        weights = master if relative_step is None else _stepped(master, i, relative_step)
        fp8, scale_inv = to_fp8_blocks(weights)
        shard[f"model.layers.{i}.weight"] = ("F8_E4M3", fp8)
        shard[f"model.layers.{i}.weight_scale_inv"] = ("F32", scale_inv)
        if len(shard) >= 128 or i == num_matrices - 1:
            write_safetensors(directory / f"model-{i // 64:05d}.safetensors", shard)
            shard = {}
    (directory / "config.json").write_text(
        '{"architectures": ["SyntheticFp8"], "quantization_config": '
        '{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}\n'
    )


def fp8_synthetic(args: argparse.Namespace, work: Path) -> None:
    num_matrices = max(1, round(args.size_gb * 1e9 / (SHAPE[0] * SHAPE[1])))
    base = work / "v0"
    write_fp8_model(base, num_matrices, None)
    with Checkpoint(base) as ck:
        model_bytes = ck.nbytes
    print(
        f"synthetic fp8 model (e4m3 + fp32 weight_scale_inv per 128x128 block): {num_matrices} matrices of {SHAPE}, "
        f"{model_bytes / 1e9:.2f} GB; chunk {args.chunk_mb} MiB, {args.threads or os.cpu_count()} threads\n"
    )
    store0, cache0, recv0 = work / "store", work / "cache", work / "recv"
    anchor, _, _ = in_fresh_process(_push, str(base), str(store0), str(cache0), args.chunk_mb, args.threads, 1000)
    in_fresh_process(_pull, str(store0), str(recv0), anchor.id, args.threads)
    zstd_bytes, _ = baseline_zstd(base, 3, args.threads or os.cpu_count())
    print(
        f"{'anchor':<10} stored {mib(anchor.stored_bytes)} ({anchor.ratio:5.2f}x); zstd -3 of all {mib(zstd_bytes)} "
        f"({model_bytes / zstd_bytes:5.2f}x)\n"
    )
    header = (
        f"{'target':>6} {'values':>7} {'scales':>7} | {'sync delta':>12} {'ratio':>7} {'encode':>11} {'enc rss':>12} "
        f"{'decode':>11} {'bit-exact':>9} | {'xor+zstd':>12} {'ratio':>7}"
    )
    print(header)
    print("-" * len(header))
    for density in args.densities:
        new = work / f"v_{density}"
        write_fp8_model(new, num_matrices, calibrate_fp8(density / 100))
        store, cache, recv = work / f"store_{density}", work / f"cache_{density}", work / f"recv_{density}"
        for src, dst in ((store0, store), (cache0, cache), (recv0, recv)):
            linked_copy(src, dst)
        info, enc_s, enc_rss = in_fresh_process(_push, str(new), str(store), str(cache), args.chunk_mb, args.threads, 1000)
        _, dec_s, _ = in_fresh_process(_pull, str(store), str(recv), info.id, args.threads)
        exact = all((recv / "current" / p.name).read_bytes() == p.read_bytes() for p in new.glob("*.safetensors"))
        changed_values = changed_scales = values = scales = 0
        with Checkpoint(base) as old, Checkpoint(new) as cur:
            for name, t in cur.tensors.items():
                a = cur.read(t, 0, t.numel, np.empty(t.numel, t.uint))
                b = old.read(old.tensors[name], 0, t.numel, np.empty(t.numel, t.uint))
                if name.endswith("weight_scale_inv"):
                    changed_scales, scales = changed_scales + int(np.sum(a != b)), scales + t.numel
                else:
                    changed_values, values = changed_values + int(np.sum(a != b)), values + t.numel
        xor_bytes, _ = baseline_xor_zstd(base, new, 3, args.threads or os.cpu_count())
        print(
            f"{density:5.1f}% {100 * changed_values / values:6.2f}% {100 * changed_scales / scales:6.2f}% | "
            f"{mib(info.stored_bytes)} {info.ratio:6.1f}x {gbps(model_bytes, enc_s)} {mib(enc_rss)} "
            f"{gbps(model_bytes, dec_s)} {str(exact):>9} | {mib(xor_bytes)} {model_bytes / xor_bytes:6.1f}x",
            flush=True,
        )
        for path in (new, store, cache, recv):
            shutil.rmtree(path)


def device_encode(args: argparse.Namespace) -> None:
    """GB/s of DeviceDeltaEncoder on --device vs the host encoder, both on the same in-memory bf16 pieces."""
    import torch

    from composer.sync.codec import encode_piece
    from composer.sync.device import DeviceDeltaEncoder
    from composer.sync.pool import num_threads, ordered_map

    threads = num_threads(args.threads)
    num_matrices = max(1, round(args.size_gb * 1e9 / (SHAPE[0] * SHAPE[1] * 2)))
    per_piece = (args.chunk_mb << 20) // 2
    print(
        f"device {args.device}: {num_matrices} bf16 matrices of {SHAPE} ({num_matrices * SHAPE[0] * SHAPE[1] * 2 / 1e9:.2f} GB) "
        f"in {args.chunk_mb} MiB pieces; host encoder on {threads} threads\n"
    )
    print(f"{'target':>6} | {'device encode':>14} | {'host encode':>12} | {'speed-up':>8} {'identical':>9}")
    for density in args.densities:
        relative_step = calibrate(density / 100)
        old, new = [], []
        for i in range(num_matrices):
            master = _master(i)
            old.append(torch.from_numpy(to_bf16(master).view(np.int16)).reshape(-1).to(args.device))
            new.append(torch.from_numpy(to_bf16(_stepped(master, i, relative_step)).view(np.int16)).reshape(-1).to(args.device))
        pieces = [(n[a : a + per_piece], o[a : a + per_piece]) for n, o in zip(new, old) for a in range(0, n.numel(), per_piece)]
        encoder = DeviceDeltaEncoder(args.device, threads=threads)
        list(encoder.encode(pieces[:1]))  # warm-up (CUDA context, allocator)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        on_device = list(encoder.encode(pieces))
        device_s = time.perf_counter() - started
        host_pieces = [(n.cpu().numpy().view(np.uint16), o.cpu().numpy().view(np.uint16)) for n, o in pieces]
        cctx = threading_local_compressors()
        started = time.perf_counter()
        on_host = list(ordered_map(lambda pair: encode_piece(pair[0], pair[1], cctx()), host_pieces, threads))
        host_s = time.perf_counter() - started
        nbytes = sum(n.numel() * 2 for n, _ in pieces)
        print(
            f"{density:5.1f}% | {gbps(nbytes, device_s):>14} | {gbps(nbytes, host_s):>12} | {host_s / device_s:7.2f}x "
            f"{str(on_device == on_host):>9}",
            flush=True,
        )


def threading_local_compressors():
    import threading

    local = threading.local()

    def get() -> zstandard.ZstdCompressor:
        if not hasattr(local, "cctx"):
            local.cctx = zstandard.ZstdCompressor(level=3, write_checksum=True)
        return local.cctx

    return get


# --- measured operations (each in a fresh process) ---------------------------------------------


def _push(checkpoint: str, store: str, cache: str, chunk_mb: int, threads: int, anchor_every: int):
    from composer.sync.pusher import push_version

    section = SyncSection(store=store, anchor_every=anchor_every, codec={"chunk_mb": chunk_mb, "threads": threads})
    started = time.perf_counter()
    info = push_version(checkpoint, section, cache_dir=Path(cache))
    return info, time.perf_counter() - started, peak_rss()


def _pull(store: str, to: str, version: str, threads: int):
    from composer.sync.receiver import pull
    from composer.sync.store import Store

    started = time.perf_counter()
    with Store.open(store) as s:
        info = pull(s, Path(to), version, threads)
    return info, time.perf_counter() - started, peak_rss()


def _apply(store: str, version: str, base_dir: str, threads: int):
    """A live receiver: the parent's tensors in memory, updated with apply_version (no files written)."""
    from composer.sync.receiver import apply_version
    from composer.sync.store import Store

    with Checkpoint(Path(base_dir)) as ck:
        base = {name: ck.read(info, 0, info.numel, np.empty(info.numel, info.uint)) for name, info in ck.tensors.items()}
    started = time.perf_counter()
    with Store.open(store) as s:
        updated = sum(1 for _ in apply_version(s, version, base, threads))
    return updated, time.perf_counter() - started, peak_rss()


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM; ru_maxrss would include the parent's RSS at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM in /proc/self/status")


def in_fresh_process(fn, *args):
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def codec_only(relative_step: float) -> tuple[float, float]:
    """encode_piece / apply_piece alone on one in-memory 32 MiB tensor, one thread: (encode, decode) seconds."""
    from composer.sync.codec import apply_piece, encode_piece

    master = _master(0)
    old, new = to_bf16(master), to_bf16(_stepped(master, 0, relative_step))
    cctx, dctx = zstandard.ZstdCompressor(level=3, write_checksum=True), zstandard.ZstdDecompressor()
    mask, out = np.empty(new.size, np.bool_), np.empty_like(old)
    encode_s = decode_s = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        piece = encode_piece(new.reshape(-1), old.reshape(-1), cctx, mask)
        encode_s = min(encode_s, time.perf_counter() - started)
        out[:] = old
        started = time.perf_counter()
        apply_piece(piece.encoding, piece.payload, piece.changed, piece.gap_width, out.reshape(-1), dctx, "bench")
        decode_s = min(decode_s, time.perf_counter() - started)
    assert np.array_equal(out, new)
    return encode_s, decode_s


# --- baselines ---------------------------------------------------------------------------------


def baseline_copy(checkpoint: Path, scratch: Path) -> tuple[int, float]:
    started = time.perf_counter()
    shutil.copytree(checkpoint, scratch)
    seconds = time.perf_counter() - started
    size = sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file())
    shutil.rmtree(scratch)
    return size, seconds


def baseline_zstd(checkpoint: Path, level: int, threads: int) -> tuple[int, float]:
    cctx = zstandard.ZstdCompressor(level=level, threads=threads)
    started, total = time.perf_counter(), 0
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(64 << 20), b""):
                total += len(cctx.compress(block))
    return total, time.perf_counter() - started


def baseline_xor_zstd(old_dir: Path, new_dir: Path, level: int, threads: int) -> tuple[int, float]:
    cctx = zstandard.ZstdCompressor(level=level, threads=threads)
    started, total = time.perf_counter(), 0
    with Checkpoint(old_dir) as old, Checkpoint(new_dir) as new:
        for name, info in new.tensors.items():
            step = (64 << 20) // info.itemsize
            for start in range(0, info.numel, step):
                stop = min(start + step, info.numel)
                a = new.read(info, start, stop, np.empty(stop - start, info.uint))
                b = old.read(old.tensors[name], start, stop, np.empty(stop - start, info.uint))
                total += len(cctx.compress(a ^ b))
    return total, time.perf_counter() - started


# --- reporting ---------------------------------------------------------------------------------


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.2f} GB/s"


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:8.1f} MiB"


def linked_copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True, copy_function=os.link)


def synthetic(args: argparse.Namespace, work: Path) -> None:
    num_matrices = max(1, round(args.size_gb * 1e9 / (SHAPE[0] * SHAPE[1] * 2)))
    base = work / "v0"
    write_model(base, num_matrices, None)
    with Checkpoint(base) as ck:
        model_bytes = ck.nbytes
    print(
        f"synthetic bf16 model: {num_matrices} matrices of {SHAPE}, {model_bytes / 1e9:.2f} GB; "
        f"chunk {args.chunk_mb} MiB, {args.threads or os.cpu_count()} threads, {os.cpu_count()} cores\n"
    )

    store0, cache0, recv0 = work / "store", work / "cache", work / "recv"
    anchor, enc_s, enc_rss = in_fresh_process(_push, str(base), str(store0), str(cache0), args.chunk_mb, args.threads, 1000)
    pulled, dec_s, dec_rss = in_fresh_process(_pull, str(store0), str(recv0), anchor.id, args.threads)
    copy_bytes, copy_s = baseline_copy(base, work / "copy")
    zstd_bytes, zstd_s = baseline_zstd(base, 3, args.threads or os.cpu_count())
    print(
        f"{'anchor (full snapshot)':<28} stored {mib(anchor.stored_bytes)} ({anchor.ratio:5.2f}x)  "
        f"encode {gbps(model_bytes, enc_s)} rss {mib(enc_rss)}  decode {gbps(model_bytes, dec_s)} rss {mib(dec_rss)}"
    )
    print(f"{'baseline: full copy':<28} bytes  {mib(copy_bytes)} (1.00x)  copy   {gbps(copy_bytes, copy_s)}")
    print(
        f"{'baseline: zstd -3 of all':<28} bytes  {mib(zstd_bytes)} ({copy_bytes / zstd_bytes:5.2f}x)  encode {gbps(model_bytes, zstd_s)}\n"
    )

    header = (
        f"{'target':>6} {'actual':>7} | {'sync delta':>12} {'ratio':>7} {'encode':>11} {'enc rss':>12} "
        f"{'decode':>11} {'dec rss':>12} {'apply':>11} | {'xor+zstd':>12} {'ratio':>7} {'encode':>11} | "
        f"{'codec enc':>11} {'codec dec':>11} (1 thread, in memory)"
    )
    print(header)
    print("-" * len(header))
    for density in args.densities:
        new = work / f"v_{density}"
        relative_step = calibrate(density / 100)
        write_model(new, num_matrices, relative_step)
        store, cache, recv = work / f"store_{density}", work / f"cache_{density}", work / f"recv_{density}"
        for src, dst in ((store0, store), (cache0, cache), (recv0, recv)):
            linked_copy(src, dst)
        info, enc_s, enc_rss = in_fresh_process(_push, str(new), str(store), str(cache), args.chunk_mb, args.threads, 1000)
        assert not info.is_anchor
        pulled, dec_s, dec_rss = in_fresh_process(_pull, str(store), str(recv), info.id, args.threads)
        assert pulled.started_from == anchor.id
        _, apply_s, _ = in_fresh_process(_apply, str(store), info.id, str(base), args.threads)
        with Checkpoint(recv / "current") as rebuilt:  # the pull verified every hash; check the bytes too
            assert all((recv / "current" / f.name).read_bytes() == (new / f.name).read_bytes() for f in rebuilt.files)
        xor_bytes, xor_s = baseline_xor_zstd(base, new, 3, args.threads or os.cpu_count())
        actual = 100 * info.changed_elements / info.total_elements
        codec_enc_s, codec_dec_s = codec_only(relative_step)
        matrix_bytes = SHAPE[0] * SHAPE[1] * 2
        print(
            f"{density:5.1f}% {actual:6.2f}% | {mib(info.stored_bytes)} {info.ratio:6.1f}x {gbps(model_bytes, enc_s)} "
            f"{mib(enc_rss)} {gbps(model_bytes, dec_s)} {mib(dec_rss)} {gbps(model_bytes, apply_s)} | {mib(xor_bytes)} "
            f"{copy_bytes / xor_bytes:6.1f}x {gbps(model_bytes, xor_s)} | {gbps(matrix_bytes, codec_enc_s)} "
            f"{gbps(matrix_bytes, codec_dec_s)}",
            flush=True,
        )
        for path in (new, store, cache, recv):
            shutil.rmtree(path)


def real(args: argparse.Namespace, work: Path) -> None:
    store, cache = work / "store", work / "cache"
    previous = None
    for directory in args.checkpoints:
        with Checkpoint(Path(directory)) as ck:
            model_bytes = ck.nbytes
        info, enc_s, enc_rss = in_fresh_process(_push, directory, str(store), str(cache), args.chunk_mb, args.threads, args.anchor_every)
        line = (
            f"{directory}: {info.id} {'anchor' if info.is_anchor else 'delta '} "
            f"changed {100 * info.changed_elements / info.total_elements:6.2f}% stored {mib(info.stored_bytes)} "
            f"({info.ratio:6.1f}x) encode {gbps(model_bytes, enc_s)} rss {mib(enc_rss)}"
        )
        if previous is not None:
            xor_bytes, _ = baseline_xor_zstd(Path(previous), Path(directory), 3, args.threads or os.cpu_count())
            line += f" | xor+zstd {mib(xor_bytes)} ({model_bytes / xor_bytes:5.1f}x)"
        print(line, flush=True)
        previous = directory
    pulled, dec_s, dec_rss = in_fresh_process(_pull, str(store), str(work / "recv"), None, args.threads)
    print(f"pull {pulled.version} from {pulled.started_from}: decode {gbps(pulled.model_bytes, dec_s)} rss {mib(dec_rss)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0, help="synthetic model size")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.5, 1, 2, 5], help="percent of elements changed")
    parser.add_argument("--checkpoints", nargs="+", help="real consecutive checkpoint directories instead")
    parser.add_argument("--fp8", action="store_true", help="synthetic fp8 e4m3 model with 128x128 block scales")
    parser.add_argument("--device", default=None, help="cuda or cpu: encode throughput of in-memory weights with the torch encoder")
    parser.add_argument("--anchor-every", type=int, default=20)
    parser.add_argument("--chunk-mb", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="0 = one per core")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch space (default: a temp dir)")
    args = parser.parse_args()
    if args.device:
        device_encode(args)
        return
    with tempfile.TemporaryDirectory(prefix="sync-bench-", dir=args.workdir) as tmp:
        (real if args.checkpoints else fp8_synthetic if args.fp8 else synthetic)(args, Path(tmp))


if __name__ == "__main__":
    main()
