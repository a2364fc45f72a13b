"""Rebuilding pieces from a store's delta chains, with every step checked against its manifest hash.

A piece of a target version is rebuilt by walking its parents back to a raw payload (an anchor, or a
tensor new in some version) or to a base the caller already holds, then applying the steps forward.
The piece's hash is checked after EVERY step, so a damaged chunk, a delta applied to the wrong base or a
modified local copy is refused. Chunks are fetched (remote stores) and verified against their names first.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import zstandard

from composer.recipes.errors import UserError
from composer.runtime.run_dir import atomic_write_bytes
from composer.sync.checkpoint import UINT_OF_WIDTH
from composer.sync.codec import RAW, CorruptDataError, apply_piece, digest, hasher
from composer.sync.manifest import Manifest, OpaqueRecord, Piece
from composer.sync.pool import num_threads, ordered_map
from composer.sync.store import CHUNKS, Store
from composer.sync.transports import LocalTransport

Progress = Callable[[int], None]


class WrongBaseError(CorruptDataError):
    """The data a delta is applied to is not the version the delta was made against."""


# --- plans: how to produce one piece of one tensor -----------------------------------------------


@dataclass
class PiecePlan:
    name: str
    index: int
    start: int
    stop: int
    itemsize: int
    steps: list[tuple[str, Piece]]
    """(version id, piece) oldest first; the first is raw unless the plan starts from a base."""
    base_hash: str | None = None
    """Hash the base piece must have when the plan starts from the receiver's copy."""

    @property
    def uint(self) -> np.dtype:
        return np.dtype(UINT_OF_WIDTH[self.itemsize])

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.itemsize


def plan_tensor(manifests: Mapping[str, Manifest], target: str, name: str, base: str | None) -> list[PiecePlan]:
    """Plans for every piece of `name` in version `target`, walking parents back to a raw piece, or to `base`."""
    record = manifests[target].tensors[name]
    plans = []
    for index, (start, stop) in enumerate(record.bounds()):
        steps: list[tuple[str, Piece]] = []
        vid, base_hash = target, None
        while True:
            current = manifests[vid].tensors.get(name)
            if current is None or not current.same_layout(record):
                raise CorruptDataError(f"version {vid}: tensor {name!r} breaks the delta chain of {target}")
            piece = current.pieces[index]
            steps.append((vid, piece))
            if piece.encoding == RAW:
                break
            parent = manifests[vid].parent
            if parent is None or parent not in manifests:
                raise CorruptDataError(f"version {vid}: parent {parent} of a delta is not available")
            if parent == base:
                base_record = manifests[base].tensors.get(name)
                if base_record is None or not base_record.same_layout(record):
                    raise WrongBaseError(f"version {vid}: tensor {name!r} has no matching base in {base}")
                base_hash = base_record.pieces[index].hash
                break
            vid = parent
        steps.reverse()
        plans.append(PiecePlan(name, index, start, stop, record.itemsize, steps, base_hash))
    return plans


# --- chunks ------------------------------------------------------------------------------------


class ChunkReader:
    """Piece payloads read from a local directory of chunks that were all verified by `fetch_chunks`."""

    def __init__(self, directory: Path):
        self.directory = directory

    def payload(self, piece: Piece) -> bytes:
        with open(self.directory / piece.chunk, "rb") as f:
            return os.pread(f.fileno(), piece.length, piece.offset)


def fetch_chunks(
    store: Store, needed: dict[str, str], staging: Path, workers: int, on_progress: Progress | None = None
) -> tuple[ChunkReader, int]:
    """Make every needed chunk (id -> the version needing it) available locally, verified against its hash.

        A local store is read in place; a remote one is downloaded into `staging`, skipping chunks already
        there from an interrupted pull; `on_progress` gets the bytes of each download. Returns the reader and
    the bytes downloaded.
    """
    local = isinstance(store.transport, LocalTransport)
    directory = store.transport.root / CHUNKS if local else staging
    directory.mkdir(parents=True, exist_ok=True)
    fetched = 0
    lock = threading.Lock()

    def one(item: tuple[str, str]) -> None:
        nonlocal fetched
        cid, vid = item
        path = directory / cid
        if path.is_file() and digest(path.read_bytes()) == cid:
            return
        # A local store's chunk only gets here when missing or damaged, and get_chunk raises for both.
        data = store.get_chunk(cid, f" (needed by {vid})")
        atomic_write_bytes(path, data)
        with lock:
            fetched += len(data)
            if on_progress:
                on_progress(len(data))

    with ThreadPoolExecutor(max(workers, store.transport.parallelism)) as pool:
        list(pool.map(one, sorted(needed.items())))
    return ChunkReader(directory), fetched


# --- rebuilding --------------------------------------------------------------------------------


LoadBase = Callable[[PiecePlan, np.ndarray], None]
"""Fills the given buffer with the base's elements [plan.start, plan.stop)."""


class Rebuilder:
    """Runs piece plans, on any number of threads, with reusable per-thread buffers."""

    def __init__(self, chunks: ChunkReader, manifests: Mapping[str, Manifest]):
        self.chunks = chunks
        self.manifests = manifests
        self._local = threading.local()

    def _thread_state(self, nbytes: int) -> tuple[np.ndarray, zstandard.ZstdDecompressor]:
        state = self._local
        if getattr(state, "dctx", None) is None:
            state.dctx, state.buf = zstandard.ZstdDecompressor(), np.empty(0, np.uint8)
        if state.buf.nbytes < nbytes:
            state.buf = np.empty(nbytes, np.uint8)
        return state.buf, state.dctx

    def run(self, plan: PiecePlan, load_base: LoadBase | None, out: np.ndarray | None = None) -> np.ndarray:
        """The rebuilt piece: in `out`, or in a thread buffer valid until this thread's next call."""
        buf, dctx = self._thread_state(0 if out is not None else plan.nbytes)
        if out is None:
            out = buf[: plan.nbytes].view(plan.uint)
        first_vid = plan.steps[0][0]
        if plan.base_hash is not None:
            load_base(plan, out)
            if digest(out) != plan.base_hash:
                base = self.manifests[first_vid].parent
                raise WrongBaseError(
                    f"tensor {plan.name!r} piece {plan.index}: the base does not match version {base} "
                    f"that {first_vid} was encoded against (modified or wrong base); nothing applied"
                )
        for vid, piece in plan.steps:
            where = f"version {vid} tensor {plan.name!r} piece {plan.index}"
            apply_piece(
                piece.encoding, self.chunks.payload(piece) if piece.chunk else b"", piece.changed, piece.gap_width, out, dctx, where
            )
            if digest(out) != piece.hash:
                raise CorruptDataError(f"{where}: rebuilt bytes do not match the manifest hash")
        return out


def restore_opaque(chunks: ChunkReader, record: OpaqueRecord, vid: str, out: BinaryIO | None) -> None:
    """Decompress an opaque file chunk by chunk into `out` (or nowhere, to check it), verifying size and hash."""
    dctx, running, size = zstandard.ZstdDecompressor(), hasher(), 0
    for cid in record.chunks:
        try:
            data = dctx.decompress((chunks.directory / cid).read_bytes())
        except zstandard.ZstdError:
            raise CorruptDataError(f"version {vid}: file {record.name} does not decompress") from None
        running.update(data)
        size += len(data)
        if out is not None:
            out.write(data)
    if size != record.size or running.hexdigest() != record.hash:
        raise CorruptDataError(f"version {vid}: file {record.name} does not match its manifest hash")


def needed_chunks(plans: list[PiecePlan], manifest: Manifest) -> dict[str, str]:
    """Chunk id -> a version that needs it: the plans' payloads and the manifest's opaque files."""
    needed = {piece.chunk: vid for plan in plans for vid, piece in plan.steps if piece.chunk}
    needed.update({cid: manifest.id for record in manifest.opaque for cid in record.chunks})
    return needed


@dataclass
class VerifyReport:
    versions: list[str]
    pieces: int = 0
    bytes_checked: int = 0
    chunks: int = 0


def verify(store: Store, version: str | None = None, threads: int = 0, on_progress: Progress | None = None) -> VerifyReport:
    """Re-hash every chunk and rebuild every piece of `version` (default: every version) in memory,
    checking each piece's hash at every step of its chain."""
    versions = store.versions()
    if version is not None and version not in versions:
        raise UserError(f"store {store.location}: no version {version}")
    selected = [version] if version else versions
    # One plan per piece that no later version's chain passes through: a chain checks every step it takes.
    jobs: list[tuple[str, str]] = []
    for i, vid in enumerate(selected):
        manifest = store.manifest(vid)
        after = store.manifest(selected[i + 1]) if i + 1 < len(selected) else None
        continued = after is not None and after.parent == vid
        for name in manifest.tensors:
            record = after.tensors.get(name) if continued else None
            if record is None or any(piece.encoding == RAW for piece in record.pieces):  # RAW is chosen per piece
                jobs.append((vid, name))
    manifests: dict[str, Manifest] = {}
    for vid in selected:
        manifests.update({m.id: m for m in store.chain(vid)})
    plans = [plan for vid, name in jobs for plan in plan_tensor(manifests, vid, name, None)]
    needed: dict[str, str] = {}
    for vid in selected:
        needed.update(needed_chunks([], manifests[vid]))
    needed.update({piece.chunk: vid for plan in plans for vid, piece in plan.steps if piece.chunk})
    workers = num_threads(threads)
    report = VerifyReport(selected, chunks=len(needed))
    with tempfile.TemporaryDirectory(prefix="composer-sync-") as staging:
        reader, _ = fetch_chunks(store, needed, Path(staging), workers)
        rebuilder = Rebuilder(reader, manifests)

        def check(plan: PiecePlan) -> int:
            rebuilder.run(plan, None)
            return plan.nbytes

        for nbytes in ordered_map(check, plans, workers):
            report.pieces += 1
            report.bytes_checked += nbytes
            if on_progress:
                on_progress(nbytes)
        for vid in selected:
            for record in manifests[vid].opaque:
                restore_opaque(reader, record, vid, None)
    return report
