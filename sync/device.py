"""Encoding where the weights already are: on an accelerator, the diff and the gather of changed positions run on
the device (torch), only gaps and changed values (or a dense piece, when that is smaller) cross to the host,
into pinned buffers on a side stream, and zstd compresses one piece on the host while the device works on the
next ones. The bytes are those of `codec.encode_piece` (the same candidates, chosen the same way), so a store
cannot tell which encoder wrote a version. Without a GPU the same code runs on CPU tensors.

A manifest records the hash of every piece's new bytes (xxh3 on the host). `encode_hashed` gives it: an unchanged
piece keeps its base's hash (nothing crosses), a changed one is copied to the host once to be hashed (on CPU the
tensor's own memory is hashed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import zstandard

from composer.sync.codec import RAW, SAME, EncodedPiece, _to_planes, digest, encode_changes, gap_dtype_for, sparse_pays

_SIGNED_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
_UNSIGNED_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeviceDeltaEncoder:
    """Encodes (new, old) pairs of same-shaped tensors on `device`; `old` None means raw (an anchor)."""

    def __init__(self, device: str = "cuda", zstd_level: int = 3, threads: int = 2, in_flight: int = 4):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.in_flight = in_flight
        self.threads = threads
        self.zstd_level = zstd_level
        self._compressors: dict[int, zstandard.ZstdCompressor] = {}

    def _host(self, tensor):
        """Start copying `tensor` into pinned host memory on the side stream (returns the host tensor)."""
        torch = self.torch
        if not self.cuda:
            return tensor
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            out.copy_(tensor, non_blocking=True)
        return out

    def _bits(self, tensor):
        """A flat view of the tensor's bit patterns as a signed int tensor (torch compares and XORs those)."""
        return tensor.reshape(-1).view(getattr(self.torch, _SIGNED_OF_WIDTH[tensor.element_size()]))

    def _stage(self, new, old, hashed: bool) -> tuple:
        """Device work for one piece; returns what the host needs, with copies in flight (the whole new piece too
        when it is `hashed` and changed)."""
        torch = self.torch
        new = self._bits(new.to(self.device, non_blocking=True))
        if old is None:
            return ("raw", new.numel(), new.element_size(), self._host(new), None)
        old = self._bits(old.to(self.device, non_blocking=True))
        positions = torch.nonzero(new != old).flatten()
        changed = positions.numel()  # a device sync, as on the host
        if changed == 0:
            return ("same",)
        gaps = torch.diff(positions, prepend=positions.new_full((1,), -1)) - 1
        gap_dtype = gap_dtype_for(int(gaps.max()))
        size, itemsize = new.numel(), new.element_size()
        sparse = sparse_pays(changed, gap_dtype, size, itemsize)
        host_gaps = self._host(gaps.to(getattr(torch, f"uint{8 * gap_dtype.itemsize}"))) if sparse else None
        host_values = self._host(new[positions]) if sparse else None
        dense = {}
        if changed >= 0.03 * size:  # codec.XOR_MIN_DENSITY: only then can a dense encoding win
            dense["xor"] = self._host(torch.bitwise_xor(new, old))
        if changed >= 0.5 * size or not sparse or hashed:
            dense["raw"] = self._host(new)
        event = torch.cuda.Event() if self.cuda else None
        if event is not None:
            event.record(self.stream)
        return ("delta", size, itemsize, changed, host_gaps, host_values, dense, event)

    def _finish(self, staged: tuple, hashed: bool, base_hash: str | None) -> tuple[str | None, EncodedPiece]:
        """Host work for one piece: wait for its copies, split into byte planes, compress; when `hashed`, also the
        hash of the new piece (`base_hash` when it is unchanged)."""
        import threading

        compressor = self._compressors.setdefault(
            threading.get_ident(), zstandard.ZstdCompressor(level=self.zstd_level, write_checksum=True)
        )
        if staged[0] == "same":
            return base_hash, EncodedPiece(SAME, b"", 0)
        if staged[0] == "raw":
            _, size, itemsize, host, _ = staged
            if self.cuda:
                self.stream.synchronize()
            bits = _as_numpy(host, itemsize)
            return digest(bits) if hashed else None, EncodedPiece(RAW, compressor.compress(_to_planes(bits)), size)
        _, size, itemsize, changed, gaps, values, dense, event = staged
        if event is not None:
            event.synchronize()
        new_hash = digest(_as_numpy(dense["raw"], itemsize)) if hashed else None
        return new_hash, encode_changes(
            size,
            changed,
            None if gaps is None else gaps.numpy(),
            lambda: _as_numpy(values, itemsize),
            lambda: _as_numpy(dense["xor"], itemsize),
            lambda: _as_numpy(dense["raw"], itemsize),
            compressor,
        )

    def encode(self, pairs: Iterable[tuple]) -> Iterator[EncodedPiece]:
        """Encoded pieces in input order; the device runs up to `in_flight` pieces ahead of compression."""
        for _, piece in self._run(((new, old, None) for new, old in pairs), hashed=False):
            yield piece

    def encode_hashed(self, triples: Iterable[tuple]) -> Iterator[tuple[str, EncodedPiece]]:
        """(hash of the new piece, encoded piece) for (new, old, hash of old) triples, in input order; `old` None
        means raw (its hash is then ignored)."""
        for new_hash, piece in self._run(triples, hashed=True):
            yield str(new_hash), piece

    def _run(self, triples: Iterable[tuple], hashed: bool) -> Iterator[tuple[str | None, EncodedPiece]]:
        pending: deque[Future] = deque()
        with ThreadPoolExecutor(self.threads) as pool:
            try:
                for new, old, base_hash in triples:
                    pending.append(pool.submit(self._finish, self._stage(new, old, hashed), hashed, base_hash))
                    if len(pending) >= self.in_flight:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()


def _as_numpy(tensor, itemsize: int) -> np.ndarray:
    return tensor.numpy().view(_UNSIGNED_OF_WIDTH[itemsize])


def tensor_of_bits(bits: np.ndarray):
    """A CPU torch tensor sharing `bits` (unsigned-int bit patterns), as the signed ints the encoder compares."""
    import torch

    return torch.from_numpy(bits.view(np.dtype(_SIGNED_OF_WIDTH[bits.itemsize])))


def bits_of_tensor(tensor) -> np.ndarray:
    """The bit patterns of a tensor as unsigned ints (a CPU tensor's share its memory)."""
    import torch

    flat = tensor.reshape(-1).cpu()
    return _as_numpy(flat.view(getattr(torch, _SIGNED_OF_WIDTH[flat.element_size()])), flat.element_size())
