"""What a policy update costs at production shape: a 1 TB fp8 model (e4m3 + 128x128 block scales) shipped to
4 inference clusters every step, as bytes and seconds, from this machine's measured codec.

Calibration (in this run): the codec encodes and decodes one 4096x4096 fp8 matrix with its block scales at each
density (fraction of e4m3 values that change per step), on one thread; the measured delta size per model byte
and the per-core speeds are then scaled to the model. Everything else is an input, printed with the results:
core counts, bandwidths, inference nodes per cluster. Two ways to reach the clusters:

  fan-out  every inference node pulls each delta from the one object store (WAN bytes = nodes x delta)
  relay    one relay per cluster copies the chain into a cluster-local store (`composer sync relay`), the
           cluster's nodes pull from that (WAN bytes = clusters x delta, then LAN)

A step's seconds add encode, upload, transfer and apply without overlap (an upper bound: the store streams
chunks as they are encoded).

Two encoders on the trainer side:

  host    the policy exported, read back and encoded on --encoder-cores (this machine's per-core codec speed)
  device  the learner's GPUs encode the policy where it is (`TensorPusher` -> `sync.device`): per GPU the compare,
          nonzero and gather run on the GPU, the changed positions and values cross to pinned host memory and are
          zstd-compressed there, and every changed piece crosses once more to be hashed (xxh3) for the manifest.
          The three stages overlap, so a GPU takes as long as its slowest. ASSUMED, not measured here (no GPU):
          --device-scan-gbps, model bytes a GPU scans per second: 500 GB/s from the H200 measurement in
          notes/anchors.md (`!=` over a 2e9-element bf16 pair in 3 ms + `nonzero` in 5 ms = 4 GB of model in 8 ms;
          an H100's HBM3 is ~0.7x an H200's); --d2h-gbps, a GPU's pinned device->host copy: 25 GB/s (~40% of
          PCIe 5.0 x16's 64 GB/s). MEASURED in this run, per core: zstd on the changed positions+values and xxh3,
          run on --encoder-cores host cores shared by the GPUs. Then the anchor interval N: an anchor (full snapshot) every N versions costs anchor/N per step on average, and
a node that joins or falls behind fetches the newest anchor plus up to N-1 deltas.

    PYTHONPATH=. python benchmarks/sync_cost_model.py
    PYTHONPATH=. python benchmarks/sync_cost_model.py --model-tb 1 --clusters 4 --densities 1 2 5 --wan-gbps 25
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sync_bench import _master, _stepped, calibrate_fp8, to_fp8_blocks  # noqa: E402
from composer.sync.codec import _to_planes, apply_piece, digest, encode_piece, gap_dtype_for  # noqa: E402


def measure_codec(density: float, repeats: int = 3) -> dict:
    """Delta bytes per model byte and one-thread encode/decode GB/s for an fp8 matrix plus its scales."""
    master = _master(0)
    old_w, old_s = to_fp8_blocks(master)
    new_w, new_s = to_fp8_blocks(_stepped(master, 0, calibrate_fp8(density)))
    pairs = [(new_w.reshape(-1), old_w.reshape(-1)), (new_s.reshape(-1).view(np.uint32), old_s.reshape(-1).view(np.uint32))]
    cctx, dctx = zstandard.ZstdCompressor(level=3, write_checksum=True), zstandard.ZstdDecompressor()
    model_bytes = sum(n.nbytes for n, _ in pairs)
    encode_s = decode_s = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        pieces = [encode_piece(n, o, cctx) for n, o in pairs]
        encode_s = min(encode_s, time.perf_counter() - started)
        outs = [o.copy() for _, o in pairs]
        started = time.perf_counter()
        for piece, out in zip(pieces, outs):
            apply_piece(piece.encoding, piece.payload, piece.changed, piece.gap_width, out, dctx, "cost model")
        decode_s = min(decode_s, time.perf_counter() - started)
        assert all(np.array_equal(out, n) for out, (n, _) in zip(outs, pairs))
    anchor = sum(len(cctx.compress(n.tobytes())) for n, _ in pairs)
    # the device encoder's host side: zstd of the changed positions + values only, and a hash of every byte
    sparse_in = []
    for new, old in pairs:
        positions = np.flatnonzero(new != old)
        gaps = np.diff(positions, prepend=-1) - 1
        sparse_in.append(np.concatenate([_to_planes(gaps.astype(gap_dtype_for(int(gaps.max())))), _to_planes(new[positions])]))
    zstd_s = hash_s = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for planes in sparse_in:
            cctx.compress(planes)
        zstd_s = min(zstd_s, time.perf_counter() - started)
        started = time.perf_counter()
        for new, _ in pairs:
            digest(new)
        hash_s = min(hash_s, time.perf_counter() - started)
    return dict(
        density=np.mean(new_w != old_w),
        delta_per_byte=sum(len(p.payload) for p in pieces) / model_bytes,
        anchor_per_byte=anchor / model_bytes,
        encode_gbps=model_bytes / encode_s / 1e9,
        decode_gbps=model_bytes / decode_s / 1e9,
        sparse_per_byte=sum(p.nbytes for p in sparse_in) / model_bytes,
        zstd_sparse_gbps=sum(p.nbytes for p in sparse_in) / zstd_s / 1e9,
        hash_gbps=model_bytes / hash_s / 1e9,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-tb", type=float, default=1.0, help="fp8 model size, TB")
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--nodes-per-cluster", type=int, default=16, help="inference nodes per cluster, each holding a copy")
    parser.add_argument("--densities", type=float, nargs="+", default=[1, 2, 5], help="percent of e4m3 values changed per step")
    parser.add_argument("--encoder-cores", type=int, default=64, help="cores encoding on the trainer side (all shards together)")
    parser.add_argument("--decoder-cores", type=int, default=32, help="cores decoding on each inference node")
    parser.add_argument("--upload-gbps", type=float, default=10.0, help="trainer -> object store, GB/s")
    parser.add_argument("--wan-gbps", type=float, default=10.0, help="egress of the object store to all remote clusters together, GB/s")
    parser.add_argument("--lan-gbps", type=float, default=25.0, help="cluster-local store -> its nodes together, GB/s")
    parser.add_argument("--anchor-every", type=int, nargs="+", default=[5, 10, 20, 50, 100])
    parser.add_argument("--encoder-gpus", type=int, default=64, help="learner GPUs encoding the policy with the device encoder")
    parser.add_argument("--device-scan-gbps", type=float, default=500.0, help="model GB/s one GPU compares+gathers (assumed)")
    parser.add_argument("--d2h-gbps", type=float, default=25.0, help="pinned device->host GB/s per GPU (assumed)")
    args = parser.parse_args()
    model = args.model_tb * 1e12
    print("inputs: " + ", ".join(f"{k}={v}" for k, v in vars(args).items()))
    print("calibrating the codec on one 4096x4096 e4m3 matrix + fp32 scales per density, one thread ...\n")
    rows = [measure_codec(d / 100) for d in args.densities]

    print(
        f"{'density':>8} {'ratio':>7} {'delta/step':>11} {'enc GB/s/core':>14} {'dec GB/s/core':>14} | "
        f"{'encode':>7} {'upload':>7} | {'fan-out WAN':>12} {'s':>7} | {'relay WAN':>10} {'s':>7} {'LAN s':>7} | {'apply':>7} | "
        f"{'step, fan-out':>13} {'step, relay':>11}"
    )
    for r in rows:
        delta = model * r["delta_per_byte"]
        encode_s = model / (r["encode_gbps"] * 1e9 * args.encoder_cores)
        upload_s = delta / (args.upload_gbps * 1e9)
        fan_bytes = delta * args.clusters * args.nodes_per_cluster
        fan_s = fan_bytes / (args.wan_gbps * 1e9)
        relay_bytes = delta * args.clusters
        relay_s = relay_bytes / (args.wan_gbps * 1e9)
        lan_s = delta * args.nodes_per_cluster / (args.lan_gbps * 1e9)
        apply_s = model / (r["decode_gbps"] * 1e9 * args.decoder_cores)  # every piece holds some change at these densities
        print(
            f"{100 * r['density']:7.2f}% {1 / r['delta_per_byte']:6.1f}x {delta / 1e9:8.2f} GB {r['encode_gbps']:14.3f} "
            f"{r['decode_gbps']:14.3f} | {encode_s:6.1f}s {upload_s:6.1f}s | {fan_bytes / 1e9:9.1f} GB {fan_s:6.1f}s | "
            f"{relay_bytes / 1e9:7.1f} GB {relay_s:6.1f}s {lan_s:6.1f}s | {apply_s:6.1f}s | "
            f"{encode_s + upload_s + fan_s + apply_s:12.1f}s {encode_s + upload_s + relay_s + lan_s + apply_s:10.1f}s"
        )

    print(
        f"\ndevice encoder: {args.encoder_gpus} GPUs at {args.device_scan_gbps:g} GB/s scan and {args.d2h_gbps:g} GB/s "
        f"device->host each (assumed), {args.encoder_cores} host cores for zstd + hash (measured per core); relay"
    )
    print(
        f"{'density':>8} {'zstd in/byte':>12} {'zstd GB/s/core':>14} {'hash GB/s/core':>14} | {'scan':>6} {'to host':>7} "
        f"{'host':>6} | {'encode':>7} {'was':>7} | {'step, relay':>11} {'was':>7}"
    )
    for r in rows:
        delta = model * r["delta_per_byte"]
        host_encode_s = model / (r["encode_gbps"] * 1e9 * args.encoder_cores)
        per_gpu = model / args.encoder_gpus
        scan_s = per_gpu / (args.device_scan_gbps * 1e9)
        # every piece changes at these densities, so each crosses once for its hash, the changes once more
        to_host_s = per_gpu * (1 + r["sparse_per_byte"]) / (args.d2h_gbps * 1e9)
        host_s = model * (r["sparse_per_byte"] / r["zstd_sparse_gbps"] + 1 / r["hash_gbps"]) / 1e9 / args.encoder_cores
        device_encode_s = max(scan_s, to_host_s, host_s)
        rest = delta / (args.upload_gbps * 1e9) + delta * args.clusters / (args.wan_gbps * 1e9)
        rest += delta * args.nodes_per_cluster / (args.lan_gbps * 1e9) + model / (r["decode_gbps"] * 1e9 * args.decoder_cores)
        print(
            f"{100 * r['density']:7.2f}% {r['sparse_per_byte']:12.4f} {r['zstd_sparse_gbps']:14.3f} {r['hash_gbps']:14.3f} | "
            f"{scan_s:5.2f}s {to_host_s:6.2f}s {host_s:5.2f}s | {device_encode_s:6.1f}s {host_encode_s:6.1f}s | "
            f"{device_encode_s + rest:10.1f}s {host_encode_s + rest:6.1f}s"
        )

    middle = rows[len(rows) // 2]
    delta = model * middle["delta_per_byte"]
    anchor = model * middle["anchor_per_byte"]
    print(
        f"\nanchor interval at {100 * middle['density']:.2f}% (anchor {anchor / 1e9:.0f} GB = {1 / middle['anchor_per_byte']:.2f}x, "
        f"delta {delta / 1e9:.1f} GB), relay to {args.clusters} clusters:"
    )
    print(
        f"{'every':>6} | {'avg/step':>10} {'WAN s/step':>11} | {'catch-up bytes':>15} {'catch-up s':>11} | {'store holds (2 chains)':>22}"
    )
    for n in args.anchor_every:
        per_step = anchor / n + delta * (n - 1) / n
        catch_up = anchor + delta * (n - 1)
        wan_s = per_step * args.clusters / (args.wan_gbps * 1e9)
        print(
            f"{n:6d} | {per_step / 1e9:7.1f} GB {wan_s:10.1f}s | {catch_up / 1e9:12.0f} GB "
            f"{catch_up / (args.wan_gbps * 1e9):10.1f}s | {2 * catch_up / 1e12:19.2f} TB"
        )


if __name__ == "__main__":
    main()
