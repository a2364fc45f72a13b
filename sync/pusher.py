"""Pushing a checkpoint: encode it against the store's head, upload the chunks, publish the manifest last.

The previous version's tensors come from the pusher's base cache, a receiver directory that holds the
last version pushed (hard links to the pushed files when possible). When the cache is behind the store's
head (another machine pushed, or a fresh machine) it is brought up to date with `pull`; when its files
were changed behind our back, the base-hash check catches it and the cache is rebuilt from the store.

`TensorPusher` publishes a checkpoint held in memory as named torch tensors (the RL learner's policy each step)
with the same bytes, encoding where the tensors are (on a GPU with `sync.device`, CPU tensors with the host codec
on their own memory) against the tensors it pushed last; only a pusher that holds none (a fresh process) reads
the previous version, from the cache as above.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import zstandard

from composer.recipes.errors import UserError
from composer.recipes.schema import CodecSection, SSHSection, SyncSection
from composer.sync.checkpoint import DTYPE_OF_TORCH, Checkpoint, SafetensorsFile, TensorInfo, parse_header, safetensors_header
from composer.sync.codec import digest, encode_piece, hasher, piece_stops
from composer.sync.device import DeviceDeltaEncoder, bits_of_tensor, tensor_of_bits
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
        jobs, records = _plan(checkpoint.files, parent, self.chunk_bytes)

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

        return records, _collect(ordered_map(encode_job, jobs, self.workers), records, packer, self.on_progress)

    def opaque(self, root: Path, names: list[str], parent: Manifest | None, packer: _Packer) -> tuple[list[OpaqueRecord], int]:
        """Opaque files (`names` under `root`) as zstd chunks of their own, read block by block; returns the
        records and the compressed bytes of files that differ from the parent's."""
        cctx = zstandard.ZstdCompressor(level=self.codec.zstd_level, write_checksum=True)
        before = {o.name: o for o in parent.opaque} if parent else {}
        records, new_bytes = [], 0
        for name in names:
            running, size, chunks, compressed = hasher(), 0, [], 0
            with open(root / name, "rb") as f:
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


def _plan(files: list[SafetensorsFile], parent: Manifest | None, chunk_bytes: int) -> tuple[list[_Job], dict[str, TensorRecord]]:
    """The pieces to encode, file by file in offset order, and the new version's (empty) tensor records."""
    jobs: list[_Job] = []
    records: dict[str, TensorRecord] = {}
    for file in files:
        for info in file.tensors:
            before = parent.tensors.get(info.name) if parent else None
            if before and before.dtype == info.dtype and tuple(before.shape) == info.shape:
                stops = [p.stop for p in before.pieces]  # a tensor keeps its pieces along a chain
                hashes: list[str | None] = [p.hash for p in before.pieces]
            else:
                stops = piece_stops(info.numel, info.itemsize, chunk_bytes)
                hashes = [None] * len(stops)
            records[info.name] = TensorRecord(info.dtype, list(info.shape), [])
            starts = [0] + stops[:-1]
            jobs += [_Job(info, i, a, b, h) for i, (a, b, h) in enumerate(zip(starts, stops, hashes))]
    return jobs, records


def _collect(
    encoded: Iterable[tuple[_Job, Piece, bytes]], records: dict[str, TensorRecord], packer: _Packer, on_progress: Progress | None
) -> dict:
    """Pieces into their records and payloads into chunks, in input order (the same order, the same chunks)."""
    changed = total = 0
    encodings: dict[str, int] = {}
    for job, piece, payload in encoded:
        records[job.info.name].pieces.append(piece)
        if payload:
            packer.add(piece, payload)
        size = job.stop - job.start
        total += size
        changed += piece.changed
        encodings[piece.encoding] = encodings.get(piece.encoding, 0) + 1
        if on_progress:
            on_progress(size * job.info.itemsize)
    return {"changed_elements": changed, "total_elements": total, "encodings": encodings}


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
    return _version_info(manifest, is_anchor, packer, started)


def _version_info(manifest: Manifest, is_anchor: bool, packer: _Packer, started: float) -> VersionInfo:
    return VersionInfo(
        manifest.id,
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
        opaque, opaque_new = encoder.opaque(checkpoint.root, checkpoint.opaque, parent, packer)
        packer.finish()
    except BaseException:
        packer.abort()
        raise
    return _manifest(vid, parent_id, parent, checkpoint.files, tensors, opaque, opaque_new, checkpoint.root, stats, packer), packer


def _manifest(
    vid: str,
    parent_id: str | None,
    parent: Manifest | None,
    files: list[SafetensorsFile],
    tensors: dict[str, TensorRecord],
    opaque: list[OpaqueRecord],
    opaque_new: int,
    root: Path,
    stats: dict,
    packer: _Packer,
) -> Manifest:
    """The new version's manifest, once every chunk is stored (`packer.finish()`)."""
    stats["full_bytes"] = sum(t.nbytes for f in files for t in f.tensors) + sum((root / o.name).stat().st_size for o in opaque)
    stats["stored_bytes"] = packer.stored_bytes + opaque_new
    return Manifest(
        id=vid,
        parent=parent_id,
        anchor=parent.anchor if parent else vid,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        files=[FileRecord(f.name, f.header, f.size) for f in files],
        tensors=tensors,
        opaque=opaque,
        stats=stats,
    )


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


class TensorPusher:
    """Publishes checkpoints held in memory: named torch tensors on any device, the safetensors files they stand
    for (`files`: file name -> tensor names, laid out as safetensors' `save_file` lays them out) and a directory
    of the checkpoint's other files (config, tokenizer, index). A version is the one `push_version` makes of the
    same tensors written to those files: the same chunks, manifest and hashes.

    The tensors of the version pushed last stay referenced as the next push's base (a copy the caller must not
    change), so a delta reads nothing from disk; a pusher without them reads the previous version from the cache.
    """

    def __init__(
        self, sync: SyncSection, ssh: SSHSection | None = None, *, cache_dir: Path | None = None, device_encoder: bool | None = None
    ):
        self.sync, self.ssh = sync, ssh
        self.device_encoder = device_encoder
        """Encode with `sync.device` (True) or the host codec (False); None: `sync.device` for tensors off the CPU."""
        self.cache = ReceiverDir(cache_dir or default_cache_dir(sync.store))
        self._pushed: tuple[str, dict[str, Any]] | None = None
        """(version id, its flat tensors) of the last push."""

    def push(self, tensors: dict[str, Any], files: dict[str, list[str]], other_files: Path) -> VersionInfo:
        """Publish the store's next version (a delta against the head, or an anchor every `sync.anchor_every`)."""
        started = time.monotonic()
        layout = tensor_files(tensors, files)
        opaque = _other_files(Path(other_files))
        flat = {name: t.detach().contiguous().reshape(-1) for name, t in tensors.items()}
        device = str(next(iter(flat.values())).device)
        with Store.open(self.sync.store, self.ssh, create=True, endpoint=self.sync.endpoint) as store:
            head = store.head()
            parent = store.manifest(head) if head else None
            is_anchor = parent is None or version_seq(head) - version_seq(parent.anchor) + 1 >= self.sync.anchor_every
            vid = version_id(version_seq(head) + 1 if head else 1)

            def encode(parent: Manifest | None, base: _MemoryBase | _CacheBase | None) -> tuple[Manifest, _Packer]:
                return self._encode(device, layout, flat, opaque, Path(other_files), store, vid, head, parent, base)

            if is_anchor:
                manifest, packer = encode(None, None)
            elif self._pushed is not None and self._pushed[0] == parent.id:
                manifest, packer = encode(parent, _MemoryBase(self._pushed[1]))
            else:
                try:
                    with self._cache_base(store, parent, refresh=False) as base:
                        manifest, packer = encode(parent, base)
                except WrongBaseError:
                    with self._cache_base(store, parent, refresh=True) as base:
                        manifest, packer = encode(parent, base)
            store.publish(manifest)
        self._pushed = (vid, flat)
        return _version_info(manifest, is_anchor, packer, started)

    def _cache_base(self, store: Store, parent: Manifest, refresh: bool) -> _CacheBase:
        if refresh:
            shutil.rmtree(self.cache.root, ignore_errors=True)
        if self.cache.current_id() != parent.id:
            pull(store, self.cache.root, parent.id, self.sync.codec.threads)
        return _CacheBase(Checkpoint(self.cache.path(parent.id)))

    def _encode(
        self,
        device: str,
        layout: list[SafetensorsFile],
        flat: dict[str, Any],
        opaque: list[str],
        root: Path,
        store: Store,
        vid: str,
        parent_id: str | None,
        parent: Manifest | None,
        base: _MemoryBase | _CacheBase | None,
    ) -> tuple[Manifest, _Packer]:
        """As `_encode`, for tensors in memory; an anchor without `parent` and `base`."""
        codec = self.sync.codec
        packer = _Packer(store, codec.chunk_mb << 20)
        try:
            jobs, records = _plan(layout, parent, packer.chunk_bytes)

            def pieces():
                for job in jobs:
                    new = flat[job.info.name][job.start : job.stop]
                    old = None if job.base_hash is None else base.piece(job.info, job.start, job.stop, job.base_hash)
                    yield new, old, job.base_hash

            on_device = self.device_encoder if self.device_encoder is not None else not device.startswith("cpu")
            encoded = self._on_device(device, jobs, pieces()) if on_device else self._on_host(jobs, pieces())
            stats = _collect(encoded, records, packer, None)
            opaque_records, opaque_new = DeltaEncoder(codec).opaque(root, opaque, parent, packer)
            packer.finish()
        except BaseException:
            packer.abort()
            raise
        return _manifest(vid, parent_id, parent, layout, records, opaque_records, opaque_new, root, stats, packer), packer

    def _on_device(self, device: str, jobs: list[_Job], pieces: Iterable[tuple]) -> Iterator[tuple[_Job, Piece, bytes]]:
        """Diff and gather on the device, only what changed crosses to the host (`sync.device`)."""
        codec = self.sync.codec
        encoder = DeviceDeltaEncoder(device, codec.zstd_level, num_threads(codec.threads))
        for job, (piece_hash, e) in zip(jobs, encoder.encode_hashed(pieces)):
            yield job, Piece(job.stop, piece_hash, e.encoding, e.changed, e.gap_width), e.payload

    def _on_host(self, jobs: list[_Job], pieces: Iterable[tuple]) -> Iterator[tuple[_Job, Piece, bytes]]:
        """CPU tensors: the host codec on their own memory (numpy's diff and gather beat torch's on a CPU)."""
        host = DeltaEncoder(self.sync.codec)

        def encode_job(item: tuple[_Job, tuple]) -> tuple[_Job, Piece, bytes]:
            job, (new, old, _) = item
            new_bits = bits_of_tensor(new)
            _, _, mask, cctx = host._thread_state(new_bits.nbytes)
            e = encode_piece(new_bits, None if old is None else bits_of_tensor(old), cctx, mask)
            return job, Piece(job.stop, digest(new_bits), e.encoding, e.changed, e.gap_width), e.payload

        return ordered_map(encode_job, zip(jobs, pieces), host.workers)


class _MemoryBase:
    """The tensors this pusher published last: the parent version itself."""

    def __init__(self, flat: dict[str, Any]):
        self.flat = flat

    def piece(self, info: TensorInfo, start: int, stop: int, expected_hash: str):
        old = self.flat.get(info.name)
        if old is None or DTYPE_OF_TORCH.get(str(old.dtype).removeprefix("torch.")) != info.dtype or old.numel() != info.numel:
            raise WrongBaseError(f"the pushed tensors lack tensor {info.name!r} of the head version")
        return old[start:stop]


class _CacheBase:
    """The parent version's files in the pusher's cache, read piece by piece and checked against its hashes."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint

    def __enter__(self) -> _CacheBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.checkpoint.close()

    def piece(self, info: TensorInfo, start: int, stop: int, expected_hash: str):
        base = self.checkpoint.tensors.get(info.name)
        if base is None or base.dtype != info.dtype or base.shape != info.shape:
            raise WrongBaseError(f"base cache {self.checkpoint.root} lacks tensor {info.name!r} of the head version")
        old = self.checkpoint.read(base, start, stop, np.empty(stop - start, info.uint))  # fresh: pieces are in flight
        if digest(old) != expected_hash:
            raise WrongBaseError(f"base cache {self.checkpoint.root}: tensor {info.name!r} does not match the head version")
        return tensor_of_bits(old)


def tensor_files(tensors: dict[str, Any], files: dict[str, list[str]]) -> list[SafetensorsFile]:
    """The safetensors files (in the order a `Checkpoint` lists them) that `files` lays `tensors` out as; a tensor
    set that does not match the layout, or a dtype sync cannot store, is a UserError."""
    placed: dict[str, str] = {}
    for file, names in files.items():
        if not file.endswith(".safetensors"):
            raise UserError(f"in-memory checkpoint: file {file!r} is not a *.safetensors file")
        for name in names:
            if name in placed:
                raise UserError(f"in-memory checkpoint: tensor {name!r} is in both {placed[name]} and {file}")
            if name not in tensors:
                raise UserError(f"in-memory checkpoint: file {file} names tensor {name!r}, which is not among the tensors")
            placed[name] = file
    if unplaced := sorted(set(tensors) - set(placed)):
        raise UserError(f"in-memory checkpoint: tensor {unplaced[0]!r} is in no file ({len(unplaced)} such)")
    layout = []
    for file in sorted(files, key=PurePosixPath):
        described = {}
        for name in files[file]:
            tensor = tensors[name]
            dtype = DTYPE_OF_TORCH.get(str(tensor.dtype).removeprefix("torch."))
            if dtype is None:
                raise UserError(f"in-memory checkpoint: tensor {name!r} has dtype {tensor.dtype}, which sync does not handle")
            described[name] = (dtype, tuple(tensor.shape))
        header, size = safetensors_header(described, {"format": "pt"})
        layout.append(parse_header(header, file, size, f"in-memory checkpoint file {file}"))
    return layout


def _other_files(root: Path) -> list[str]:
    """The checkpoint's files other than its tensors, as a `Checkpoint` lists them."""
    if not root.is_dir():
        raise UserError(f"{root}: no such directory (the checkpoint's other files)")
    names = [p.relative_to(root).as_posix() for p in sorted(q for q in root.rglob("*") if q.is_file())]
    if stray := [n for n in names if n.endswith(".safetensors")]:
        raise UserError(f"{root / stray[0]}: tensors of an in-memory checkpoint come from memory, not from files beside them")
    return names
