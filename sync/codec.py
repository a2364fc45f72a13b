"""The delta codec: one piece of a tensor (its bit patterns as unsigned ints) against the same piece of
the previous version.

Encodings, chosen per piece by encoded size:
  same    no element changed; nothing is stored
  sparse  changed positions as gaps (narrowest of uint8/16/32 that fits) + the NEW bit patterns
          (never arithmetic differences, which drift), each split into byte planes, one zstd frame
  xor     new ^ old over the whole piece, byte planes, zstd (wins when many elements changed)
  raw     the new bit patterns, byte planes, zstd (anchors, new tensors, or when nearly all changed)
Byte planes put the low-entropy bytes (bf16/fp32 sign+exponent, high bytes of gaps) together, which
zstd compresses far better than interleaved bytes.
Frames carry zstd's content checksum, so a flipped bit in a stored payload fails loudly on decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from composer.recipes.errors import UserError

SAME, SPARSE, XOR, RAW = "same", "sparse", "xor", "raw"
UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ENCODINGS = (SAME, SPARSE, XOR, RAW)

# Dense encodings are tried only when enough changed for them to have a chance against sparse: on bf16
# optimizer steps XOR+planes is ~1% smaller than sparse at 1% changed and ~11% smaller at 5%, but it
# scans and compresses the whole piece, so below 3% sparse alone is kept for encode speed.
XOR_MIN_DENSITY = 0.03
RAW_MIN_DENSITY = 0.50


class CorruptDataError(UserError):
    """Stored data that does not decode to what its manifest promises."""


def digest(data: np.ndarray | bytes | memoryview) -> str:
    """Content hash of raw bytes (chunks, pieces, opaque files): 128-bit xxh3, fast enough to check everything."""
    return xxhash.xxh3_128_hexdigest(data)


def hasher() -> xxhash.xxh3_128:
    """Incremental form of `digest`, for data that arrives in blocks."""
    return xxhash.xxh3_128()


def piece_stops(numel: int, itemsize: int, chunk_bytes: int) -> list[int]:
    """End element of each piece when a tensor is cut into pieces of at most `chunk_bytes`."""
    per_piece = max(1, chunk_bytes // itemsize)
    return list(range(per_piece, numel, per_piece)) + [numel]


@dataclass(frozen=True)
class EncodedPiece:
    encoding: str
    payload: bytes
    changed: int
    """Elements whose bit pattern differs from the base (all of them for raw without a base)."""
    gap_width: int = 0


def _to_planes(values: np.ndarray) -> np.ndarray:
    """Byte j of every element, for j = 0..itemsize-1, one plane after the other."""
    k, n = values.itemsize, values.size
    if k == 1:
        return values.view(np.uint8)
    interleaved, planes = values.view(np.uint8), np.empty(n * k, np.uint8)
    for j in range(k):
        planes[j * n : (j + 1) * n] = interleaved[j::k]
    return planes


def _from_planes(buf: np.ndarray, dtype: np.dtype, count: int) -> np.ndarray:
    if dtype.itemsize == 1:
        return buf.view(dtype)
    k, values = dtype.itemsize, np.empty(count, dtype)
    interleaved = values.view(np.uint8)
    for j in range(k):
        interleaved[j::k] = buf[j * count : (j + 1) * count]
    return values


def gap_dtype_for(max_gap: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if max_gap <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def encode_piece(
    new: np.ndarray, old: np.ndarray | None, compressor: zstandard.ZstdCompressor, changed_mask: np.ndarray | None = None
) -> EncodedPiece:
    """Encode `new` (unsigned-int bit patterns) against `old` (same length) or, without a base, as raw.

    `changed_mask` is an optional reusable bool buffer of at least len(new) (saves a page-faulting allocation).
    """
    if old is None:
        return EncodedPiece(RAW, compressor.compress(_to_planes(new)), new.size)
    mask = np.not_equal(new, old, out=None if changed_mask is None else changed_mask[: new.size])
    positions = np.flatnonzero(mask)
    if positions.size == 0:
        return EncodedPiece(SAME, b"", 0)
    gaps = np.diff(positions, prepend=-1) - 1
    gap_dtype = gap_dtype_for(int(gaps.max()))
    sparse = sparse_pays(positions.size, gap_dtype, new.size, new.itemsize)
    return encode_changes(
        new.size,
        positions.size,
        gaps.astype(gap_dtype) if sparse else None,
        lambda: new[positions],
        lambda: new ^ old,
        lambda: new,
        compressor,
    )


def sparse_pays(changed: int, gap_dtype: np.dtype, size: int, itemsize: int) -> bool:
    """Whether gaps + values can be smaller than the piece itself."""
    return changed * (gap_dtype.itemsize + itemsize) < size * itemsize


def encode_changes(
    size: int,
    changed: int,
    gaps: np.ndarray | None,
    values: Callable[[], np.ndarray],
    xor: Callable[[], np.ndarray],
    raw: Callable[[], np.ndarray],
    compressor: zstandard.ZstdCompressor,
) -> EncodedPiece:
    """The smallest of the candidate encodings of a piece with `len(gaps)` changed elements, given the gaps
    (None when sparse cannot pay) and how to get the changed values, new ^ old, and new; the dense ones are
    made only when enough changed for them to have a chance. Shared by the host and the device encoders, so
    both produce the same bytes."""
    candidates = []
    if gaps is not None:
        planes = np.concatenate([_to_planes(gaps), _to_planes(values())])
        candidates.append(EncodedPiece(SPARSE, compressor.compress(planes), changed, gaps.itemsize))
    if changed >= XOR_MIN_DENSITY * size:
        candidates.append(EncodedPiece(XOR, compressor.compress(_to_planes(xor())), changed))
    if changed >= RAW_MIN_DENSITY * size or not candidates:
        candidates.append(EncodedPiece(RAW, compressor.compress(_to_planes(raw())), changed))
    return min(candidates, key=lambda c: len(c.payload))


def _decompress(payload: bytes | memoryview, nbytes: int, decompressor: zstandard.ZstdDecompressor, where: str) -> np.ndarray:
    try:
        raw = decompressor.decompress(payload, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise CorruptDataError(f"{where}: stored delta does not decompress ({e})") from None
    if len(raw) != nbytes:
        raise CorruptDataError(f"{where}: stored delta decompresses to {len(raw)} bytes, expected {nbytes}")
    return np.frombuffer(raw, dtype=np.uint8)


def apply_piece(
    encoding: str,
    payload: bytes | memoryview,
    changed: int,
    gap_width: int,
    out: np.ndarray,
    decompressor: zstandard.ZstdDecompressor,
    where: str,
) -> None:
    """Turn `out` (the base piece, or anything for raw) into the encoded piece, in place."""
    n, dtype = out.size, out.dtype
    if encoding == SAME:
        return
    if encoding == RAW:
        out[:] = _from_planes(_decompress(payload, out.nbytes, decompressor, where), dtype, n)
    elif encoding == XOR:
        out ^= _from_planes(_decompress(payload, out.nbytes, decompressor, where), dtype, n)
    elif encoding == SPARSE:
        gap_dtype = np.dtype(UINT_OF_WIDTH.get(gap_width, np.uint8))
        gap_bytes = changed * gap_width
        buf = _decompress(payload, gap_bytes + changed * dtype.itemsize, decompressor, where)
        positions = np.cumsum(_from_planes(buf[:gap_bytes], gap_dtype, changed).astype(np.int64) + 1) - 1
        if changed and (gap_width not in UINT_OF_WIDTH or positions[-1] >= n):
            raise CorruptDataError(f"{where}: stored delta points past the end of the tensor")
        out[positions] = _from_planes(buf[gap_bytes:], dtype, changed)
    else:
        raise CorruptDataError(f"{where}: unknown encoding {encoding!r}")
