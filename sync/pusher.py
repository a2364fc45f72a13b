"""Pushing a checkpoint: encode it against the store's head, upload the chunks, publish the manifest last.

The previous version's tensors come from the pusher's base cache, a receiver directory that holds the
last version pushed (hard links to the pushed files when possible). When the cache is behind the store's
head (another machine pushed, or a fresh machine) it is brought up to date with `pull`; when its files
were changed behind our back, the base-hash check catches it and the cache is rebuilt from the store.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import zstandard

from composer.recipes.schema import CodecSection, SSHSection, SyncSection
from composer.sync.checkpoint import Checkpoint, TensorInfo
from composer.sync.codec import digest, encode_piece, hasher, piece_stops
from composer.sync.manifest import FileRecord, Manifest, OpaqueRecord, Piece, TensorRecord, version_id, version_seq
from composer.sync.pool import num_threads, ordered_map
from composer.sync.rebuild import WrongBaseError
from composer.sync.receiver import ReceiverDir, pull
from composer.sync.store import Store

Progress = Callable[[int], None]


@dataclass
class VersionInfo:
    id: str
    parent: str | None
    anchor: str
    is_anchor: bool
    full_bytes: int
    stored_bytes: int
    """Bytes of chunks this version added to the store (what a receiver downloads for it)."""
    sent_bytes: int
    chunks_sent: int
    chunks_skipped: int
    changed_elements: int
    total_elements: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.full_bytes / max(self.stored_bytes, 1)


class _Packer:
    """Packs piece payloads into chunks of about `chunk_bytes` and uploads them on a few threads,
    with a bounded number in flight so memory stays a few chunks."""

    def __init__(self, store: Store, chunk_bytes: int):
        self.store = store
        self.chunk_bytes = chunk_bytes
        self._parts: list[bytes] = []
        self._size = 0
        self._waiting: list[Piece] = []
        self._pool = ThreadPoolExecutor(store.transport.parallelism)
        self._inflight: deque[Future] = deque()
        self.stored_bytes = self.sent_bytes = self.chunks_sent = self.chunks_skipped = 0

    def add(self, piece: Piece, payload: bytes) -> None:
        piece.offset, piece.length = self._size, len(payload)
        self._parts.append(payload)
        self._size += len(payload)
        self._waiting.append(piece)
        if self._size >= self.chunk_bytes:
            self.flush()

    def add_blob(self, data: bytes) -> str:
        """A chunk of its own (opaque files), so an unchanged file is the same chunk in every version."""
        cid = digest(data)
        self._submit(data, cid)
        return cid

    def flush(self) -> None:
        if not self._parts:
            return
        data = b"".join(self._parts)
        cid = digest(data)
        for piece in self._waiting:
            piece.chunk = cid
        self._parts, self._size, self._waiting = [], 0, []
        self.stored_bytes += len(data)
        self._submit(data, cid)

    def _submit(self, data: bytes, cid: str) -> None:
        self._inflight.append(self._pool.submit(lambda: (len(data), self.store.put_chunk(data, cid)[1])))
        while len(self._inflight) > self.store.transport.parallelism:
            self._collect(self._inflight.popleft())

    def _collect(self, future: Future) -> None:
        size, sent = future.result()
        if sent:
            self.chunks_sent += 1
            self.sent_bytes += size
        else:
            self.chunks_skipped += 1

    def finish(self) -> None:
        self.flush()
        while self._inflight:
            self._collect(self._inflight.popleft())
        self._pool.shutdown()

    def abort(self) -> None:
        for future in self._inflight:
            future.cancel()
        self._pool.shutdown(wait=True)


@dataclass
class _Job:
    info: TensorInfo
    index: int
    start: int
    stop: int
    base_hash: str | None


class DeltaEncoder:
    """Encodes a checkpoint against the parent version (or as an anchor) into pieces and packed chunks."""

    def __init__(self, codec: CodecSection, on_progress: Progress | None = None):
        self.codec = codec
        self.chunk_bytes = codec.chunk_mb << 20
        self.workers = num_threads(codec.threads)
        self.on_progress = on_progress
        self._local = threading.local()

    def _thread_state(self, nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, zstandard.ZstdCompressor]:
        state = self._local
        if getattr(state, "new", None) is None or state.new.nbytes < nbytes:
            state.new = np.empty(nbytes, np.uint8)
            state.old = np.empty(nbytes, np.uint8)
            state.mask = np.empty(nbytes, np.bool_)
            state.cctx = zstandard.ZstdCompressor(level=self.codec.zstd_level, write_checksum=True)
        return state.new, state.old, state.mask, state.cctx

    def encode(
        self, checkpoint: Checkpoint, parent: Manifest | None, base: Checkpoint | None, packer: _Packer
    ) -> tuple[dict[str, TensorRecord], dict]:
        """Tensor records of the new version (pieces filled, chunks assigned after `packer.finish()`) and stats."""
        jobs: list[_Job] = []
        records: dict[str, TensorRecord] = {}
        for file in checkpoint.files:
            for info in file.tensors:
                before = parent.tensors.get(info.name) if parent else None
                if before and before.dtype == info.dtype and tuple(before.shape) == info.shape:
                    stops = [p.stop for p in before.pieces]  # a tensor keeps its pieces along a chain
                    hashes: list[str | None] = [p.hash for p in before.pieces]
                else:
                    stops = piece_stops(info.numel, info.itemsize, self.chunk_bytes)
                    hashes = [None] * len(stops)
                records[info.name] = TensorRecord(info.dtype, list(info.shape), [])
                starts = [0] + stops[:-1]
                jobs += [_Job(info, i, a, b, h) for i, (a, b, h) in enumerate(zip(starts, stops, hashes))]

        def encode_job(job: _Job) -> tuple[_Job, Piece, bytes]:
            info = job.info
            nbytes = (job.stop - job.start) * info.itemsize
            new_buf, old_buf, mask, cctx = self._thread_state(nbytes)
            new = checkpoint.read(info, job.start, job.stop, new_buf.view(info.uint))
            old = None
            if job.base_hash is not None:
                base_info = base.tensors.get(info.name)
                if base_info is None or base_info.dtype != info.dtype or base_info.shape != info.shape:
                    raise WrongBaseError(f"base cache {base.root} lacks tensor {info.name!r} of the head version")
                old = base.read(base_info, job.start, job.stop, old_buf.view(info.uint))
                if digest(old) != job.base_hash:
                    raise WrongBaseError(f"base cache {base.root}: tensor {info.name!r} does not match the head version")
            encoded = encode_piece(new, old, cctx, mask)
            piece = Piece(job.stop, digest(new), encoded.encoding, encoded.changed, encoded.gap_width)
            return job, piece, encoded.payload

        changed = total = 0
        encodings: dict[str, int] = {}
        for job, piece, payload in ordered_map(encode_job, jobs, self.workers):
            records[job.info.name].pieces.append(piece)
            if payload:
                packer.add(piece, payload)
            size = job.stop - job.start
            total += size
            changed += piece.changed
            encodings[piece.encoding] = encodings.get(piece.encoding, 0) + 1
            if self.on_progress:
                self.on_progress(size * job.info.itemsize)
        return records, {"changed_elements": changed, "total_elements": total, "encodings": encodings}

    def opaque(self, checkpoint: Checkpoint, parent: Manifest | None, packer: _Packer) -> tuple[list[OpaqueRecord], int]:
        """Opaque files as zstd chunks of their own, read block by block; returns the records and the
        compressed bytes of files that differ from the parent's."""
        cctx = zstandard.ZstdCompressor(level=self.codec.zstd_level, write_checksum=True)
        before = {o.name: o for o in parent.opaque} if parent else {}
        records, new_bytes = [], 0
        for name in checkpoint.opaque:
            running, size, chunks, compressed = hasher(), 0, [], 0
            with open(checkpoint.root / name, "rb") as f:
                while block := f.read(self.chunk_bytes):
                    running.update(block)
                    size += len(block)
                    blob = cctx.compress(block)
                    compressed += len(blob)
                    chunks.append(packer.add_blob(blob))
            if name not in before or before[name].chunks != chunks:
                new_bytes += compressed
            records.append(OpaqueRecord(name, size, running.hexdigest(), chunks))
        return records, new_bytes


def default_cache_dir(store: str) -> Path:
    key = hashlib.sha256(store.encode()).hexdigest()[:16]
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "composer" / "sync" / key


def push_version(
    checkpoint_dir: str | Path,
    sync: SyncSection,
    ssh: SSHSection | None = None,
    *,
    cache_dir: Path | None = None,
    on_progress: Progress | None = None,
) -> VersionInfo:
    """Publish `checkpoint_dir` as the store's next version: a delta against the head, or an anchor every
    `sync.anchor_every` versions. Raises `VersionTakenError` if another pusher published the id first."""
    started = time.monotonic()
    cache = ReceiverDir(cache_dir or default_cache_dir(sync.store))
    with Checkpoint(Path(checkpoint_dir)) as checkpoint, Store.open(sync.store, ssh, create=True, endpoint=sync.endpoint) as store:
        head = store.head()
        parent = store.manifest(head) if head else None
        is_anchor = parent is None or version_seq(head) - version_seq(parent.anchor) + 1 >= sync.anchor_every
        vid = version_id(version_seq(head) + 1 if head else 1)
        encoder = DeltaEncoder(sync.codec, on_progress)
        if is_anchor:
            manifest, packer = _encode(encoder, checkpoint, store, vid, head, None, None)
        else:
            try:
                manifest, packer = _encode_against_cache(encoder, checkpoint, store, vid, parent, cache, refresh=False)
            except WrongBaseError:
                manifest, packer = _encode_against_cache(encoder, checkpoint, store, vid, parent, cache, refresh=True)
        store.publish(manifest)
    _adopt(cache, checkpoint.root, manifest)
    return VersionInfo(
        vid,
        manifest.parent,
        manifest.anchor,
        is_anchor,
        manifest.stats["full_bytes"],
        manifest.stats["stored_bytes"],
        packer.sent_bytes,
        packer.chunks_sent,
        packer.chunks_skipped,
        manifest.stats["changed_elements"],
        manifest.stats["total_elements"],
        time.monotonic() - started,
    )


def _encode_against_cache(
    encoder: DeltaEncoder, checkpoint: Checkpoint, store: Store, vid: str, parent: Manifest, cache: ReceiverDir, refresh: bool
) -> tuple[Manifest, _Packer]:
    if refresh:
        shutil.rmtree(cache.root, ignore_errors=True)
    if cache.current_id() != parent.id:
        pull(store, cache.root, parent.id, encoder.codec.threads)
    with Checkpoint(cache.path(parent.id)) as base:
        return _encode(encoder, checkpoint, store, vid, parent.id, parent, base)


def _encode(
    encoder: DeltaEncoder,
    checkpoint: Checkpoint,
    store: Store,
    vid: str,
    parent_id: str | None,
    parent: Manifest | None,
    base: Checkpoint | None,
) -> tuple[Manifest, _Packer]:
    """Encode against `parent` and its tensors in `base`, or as an anchor when both are None
    (an anchor still names the previous version as its parent, for lineage)."""
    packer = _Packer(store, encoder.chunk_bytes)
    try:
        tensors, stats = encoder.encode(checkpoint, parent, base, packer)
        opaque, opaque_new = encoder.opaque(checkpoint, parent, packer)
        packer.finish()
    except BaseException:
        packer.abort()
        raise
    files = [FileRecord(f.name, f.header, f.size) for f in checkpoint.files]
    stats["full_bytes"] = checkpoint.nbytes + sum((checkpoint.root / n).stat().st_size for n in checkpoint.opaque)
    stats["stored_bytes"] = packer.stored_bytes + opaque_new
    manifest = Manifest(
        id=vid,
        parent=parent_id,
        anchor=parent.anchor if parent else vid,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        files=files,
        tensors=tensors,
        opaque=opaque,
        stats=stats,
    )
    return manifest, packer


def _adopt(cache: ReceiverDir, source: Path, manifest: Manifest) -> None:
    """Make the pushed checkpoint the cache's current version: hard links when on the same filesystem."""
    with cache.locked():
        staged = cache.staging(manifest.id)
        try:
            for path in sorted(p for p in source.rglob("*") if p.is_file()):
                target = staged / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(path, target)
                except OSError:
                    shutil.copy2(path, target)
            cache.install(staged, manifest)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
