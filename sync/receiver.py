"""Receivers: rebuild versions from a store's chains, bit-exactly and verified, and publish them atomically.

A receiver directory holds
    versions/<id>/         complete safetensors checkpoints (written under a temp name, then renamed)
    manifests/<id>.json    the manifest of each version held, so the next pull can check its base
    current -> versions/<id>   a symlink replaced atomically: a reader never sees a half-written model

Every piece is rebuilt by following its chain back to a raw payload or to the receiver's current version,
and its hash is checked after EVERY step, so a damaged chunk, a delta applied to the wrong base or a
modified local copy is refused before anything is published.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np
import zstandard

from recipes.errors import UserError
from recipes.runs import atomic_write_bytes, fsync_dir
from sync.checkpoint import UINT_OF_WIDTH, Checkpoint, create_safetensors, numpy_dtype, parse_header
from sync.codec import RAW, CorruptDataError, apply_piece, digest
from sync.manifest import Manifest, OpaqueRecord, Piece, TensorRecord
from sync.pool import num_threads, ordered_map
from sync.store import CHUNKS, Store
from sync.transports import LocalTransport

Progress = Callable[[int], None]


class WrongBaseError(CorruptDataError):
    """The data a delta is applied to is not the version the delta was made against."""


class ReceiverDir:
    def __init__(self, root: Path):
        self.root = root
        self.versions = root / "versions"
        self.manifests = root / "manifests"

    def current_id(self) -> str | None:
        link = self.root / "current"
        if not link.is_symlink():
            return None
        vid = Path(os.readlink(link)).name
        return vid if (self.versions / vid).is_dir() and (self.manifests / f"{vid}.json").is_file() else None

    def path(self, vid: str) -> Path:
        return self.versions / vid

    def manifest(self, vid: str) -> Manifest:
        path = self.manifests / f"{vid}.json"
        return Manifest.from_bytes(path.read_bytes(), str(path))

    def staging(self, vid: str) -> Path:
        self.versions.mkdir(parents=True, exist_ok=True)
        staged = self.versions / f".tmp-{vid}-{secrets.token_hex(4)}"
        staged.mkdir()
        return staged

    def install(self, staged: Path, manifest: Manifest) -> None:
        """Make a fully written version directory current, then drop versions older than the previous one."""
        previous = self.current_id()
        atomic_write_bytes(self.manifests / f"{manifest.id}.json", manifest.to_bytes())
        final = self.path(manifest.id)
        if final.exists():
            shutil.rmtree(final)
        os.rename(staged, final)
        fsync_dir(self.versions)
        link = self.root / f".current-{secrets.token_hex(4)}"
        os.symlink(f"versions/{manifest.id}", link)
        os.replace(link, self.root / "current")
        fsync_dir(self.root)
        keep = {manifest.id, previous}  # a reader may still hold the previous version open
        for entry in self.versions.iterdir():
            if entry.name not in keep and not entry.name.startswith("."):
                shutil.rmtree(entry, ignore_errors=True)
                (self.manifests / f"{entry.name}.json").unlink(missing_ok=True)


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


def fetch_chunks(store: Store, needed: dict[str, str], staging: Path, workers: int) -> tuple[ChunkReader, int]:
    """Make every needed chunk (id -> the version needing it) available locally, verified against its hash.

    A local store is read in place; a remote one is downloaded into `staging`, skipping chunks already
    there from an interrupted pull. Returns the reader and the bytes downloaded.
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

    with ThreadPoolExecutor(max(workers, store.transport.parallelism)) as pool:
        list(pool.map(one, sorted(needed.items())))
    return ChunkReader(directory), fetched


# --- rebuilding --------------------------------------------------------------------------------


class _Rebuilder:
    """Runs piece plans on worker threads with reusable per-thread buffers."""

    def __init__(self, chunks: ChunkReader, manifests: Mapping[str, Manifest]):
        self.chunks = chunks
        self.manifests = manifests
        self._local = threading.local()

    def _buffer(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.buf = np.empty(nbytes, dtype=np.uint8)
            self._local.dctx = zstandard.ZstdDecompressor()
        return buf

    def run(self, plan: PiecePlan, load_base: Callable[[PiecePlan, np.ndarray], None] | None,
            out: np.ndarray | None = None) -> np.ndarray:
        """The rebuilt piece (in `out`, or in a thread buffer valid until this thread's next call)."""
        if out is None:
            out = self._buffer(plan.nbytes)[: plan.nbytes].view(plan.uint)
        dctx = getattr(self._local, "dctx", None) or zstandard.ZstdDecompressor()
        first_vid = plan.steps[0][0]
        if plan.base_hash is not None:
            load_base(plan, out)
            if digest(out) != plan.base_hash:
                base = self.manifests[first_vid].parent
                raise WrongBaseError(f"tensor {plan.name!r} piece {plan.index}: the base does not match version {base} "
                                     f"that {first_vid} was encoded against (modified or wrong base); nothing applied")
        for vid, piece in plan.steps:
            where = f"version {vid} tensor {plan.name!r} piece {plan.index}"
            apply_piece(piece.encoding, self.chunks.payload(piece) if piece.chunk else b"", piece.changed,
                        piece.gap_width, out, dctx, where)
            if digest(out) != piece.hash:
                raise CorruptDataError(f"{where}: rebuilt bytes do not match the manifest hash")
        return out


def _opaque_bytes(chunks: ChunkReader, record: OpaqueRecord, vid: str) -> bytes:
    dctx = zstandard.ZstdDecompressor()
    try:
        data = b"".join(dctx.decompress((chunks.directory / cid).read_bytes()) for cid in record.chunks)
    except zstandard.ZstdError:
        raise CorruptDataError(f"version {vid}: file {record.name} does not decompress") from None
    if len(data) != record.size or digest(data) != record.hash:
        raise CorruptDataError(f"version {vid}: file {record.name} does not match its manifest hash")
    return data


def _needed_chunks(plans: list[PiecePlan], manifest: Manifest) -> dict[str, str]:
    needed = {piece.chunk: vid for plan in plans for vid, piece in plan.steps if piece.chunk}
    needed.update({cid: manifest.id for record in manifest.opaque for cid in record.chunks})
    return needed


@dataclass
class PullInfo:
    version: str
    started_from: str
    """The receiver's previous version when the chain was applied to it, else the anchor."""
    fetched_bytes: int = 0
    model_bytes: int = 0
    seconds: float = 0.0
    already_current: bool = False


def pull(store: Store, to: Path, version: str | None = None, threads: int = 0,
         on_progress: Progress | None = None) -> PullInfo:
    """Bring the receiver directory `to` to `version` (default: the store's head) and make it current."""
    started = time.monotonic()
    receiver = ReceiverDir(to)
    target_id = version or store.head()
    if target_id is None:
        raise UserError(f"store {store.location} holds no versions yet")
    current = receiver.current_id()
    if current == target_id:
        return PullInfo(target_id, current, already_current=True)
    chain = store.chain(target_id, stop_at=current)
    manifests = {m.id: m for m in chain}
    base = current if current and chain[-1].parent == current else None
    if base:
        manifests[base] = receiver.manifest(base)
    target = manifests[target_id]
    plans = [plan for name in target.tensors for plan in plan_tensor(manifests, target_id, name, base)]
    workers = num_threads(threads)
    reader, fetched = fetch_chunks(store, _needed_chunks(plans, target), to / ".incoming", workers)
    staged = receiver.staging(target_id)
    base_checkpoint = Checkpoint(receiver.path(base)) if base else None
    fds: dict[str, int] = {}
    try:
        offsets = {}
        for record in target.files:
            path = staged / record.name
            path.parent.mkdir(parents=True, exist_ok=True)
            fds[record.name] = create_safetensors(path, record.header, record.size)
            for info in parse_header(record.header, record.name, record.size, f"version {target_id}").tensors:
                offsets[info.name] = (record.name, info.offset)

        def load_base(plan: PiecePlan, out: np.ndarray) -> None:
            base_checkpoint.read(base_checkpoint.tensors[plan.name], plan.start, plan.stop, out)

        rebuilder = _Rebuilder(reader, manifests)

        def rebuild_piece(plan: PiecePlan) -> int:
            data = rebuilder.run(plan, load_base)
            file, offset = offsets[plan.name]
            os.pwrite(fds[file], memoryview(data).cast("B"), offset + plan.start * plan.itemsize)
            return plan.nbytes

        for nbytes in ordered_map(rebuild_piece, plans, workers):
            if on_progress:
                on_progress(nbytes)
        for record in target.opaque:
            path = staged / record.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_opaque_bytes(reader, record, target_id))
        for fd in fds.values():
            os.fsync(fd)
        receiver.install(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
        if base_checkpoint:
            base_checkpoint.close()
    if not isinstance(store.transport, LocalTransport):
        shutil.rmtree(to / ".incoming", ignore_errors=True)
    return PullInfo(target_id, base or target.anchor, fetched, sum(p.nbytes for p in plans),
                    time.monotonic() - started)


def apply_version(store: Store, version_id: str, base_tensors: Mapping[str, np.ndarray],
                  threads: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of `version_id` that differ from its parent, rebuilt from `base_tensors` (the parent version,
    e.g. the weights a rollout engine holds). Unchanged tensors are not yielded; an anchor yields every tensor.

    Base arrays may have any dtype of the right item size (bf16 as uint16, or `torch_tensor.view(torch.uint16)
    .numpy()`); yielded arrays are numpy dtypes where numpy has one, bit patterns (uint) for bf16 and fp8.
    Every base piece is checked against the parent's manifest before anything is yielded for it.
    """
    target = store.manifest(version_id)
    manifests = {version_id: target}
    if not target.is_anchor:
        manifests[target.parent] = store.manifest(target.parent)
    base = None if target.is_anchor else target.parent
    records = {name: rec for name, rec in target.tensors.items() if target.is_anchor or not rec.unchanged}
    plans = {name: plan_tensor(manifests, version_id, name, base) for name in records}
    with tempfile.TemporaryDirectory(prefix="composer-sync-") as staging:
        needed = {piece.chunk: vid for ps in plans.values() for plan in ps for vid, piece in plan.steps if piece.chunk}
        reader, _ = fetch_chunks(store, needed, Path(staging), num_threads(threads))
        rebuilder = _Rebuilder(reader, manifests)
        for name, record in records.items():
            flat = _base_view(base_tensors, name, record) if any(p.base_hash for p in plans[name]) else None

            def load_base(plan: PiecePlan, out: np.ndarray, flat: np.ndarray | None = flat) -> None:
                out[:] = flat[plan.start: plan.stop]

            result = np.empty(record.numel, dtype=UINT_OF_WIDTH[record.itemsize])
            for plan in plans[name]:
                rebuilder.run(plan, load_base, out=result[plan.start: plan.stop])
            yield name, result.view(numpy_dtype(record.dtype)).reshape(record.shape)


def _base_view(base_tensors: Mapping[str, np.ndarray], name: str, record: TensorRecord) -> np.ndarray:
    array = base_tensors.get(name)
    if array is None:
        raise WrongBaseError(f"tensor {name!r} changed in this version but is missing from the base tensors")
    array = np.ascontiguousarray(array)
    if array.itemsize != record.itemsize or array.size != record.numel:
        raise WrongBaseError(f"tensor {name!r}: base has {array.size} elements of {array.itemsize} bytes, "
                             f"the version has {record.numel} of {record.itemsize}")
    return array.reshape(-1).view(UINT_OF_WIDTH[record.itemsize])


# --- verify and relay --------------------------------------------------------------------------


@dataclass
class VerifyReport:
    versions: list[str]
    pieces: int = 0
    bytes_checked: int = 0
    chunks: int = 0


def verify(store: Store, version: str | None = None, threads: int = 0,
           on_progress: Progress | None = None) -> VerifyReport:
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
            if record is None or record.pieces[0].encoding == RAW:
                jobs.append((vid, name))
    manifests: dict[str, Manifest] = {}
    for vid in selected:
        manifests.update({m.id: m for m in store.chain(vid)})
    plans = [plan for vid, name in jobs for plan in plan_tensor(manifests, vid, name, None)]
    needed: dict[str, str] = {}
    for vid in selected:
        needed.update(_needed_chunks([], manifests[vid]))
    needed.update({piece.chunk: vid for plan in plans for vid, piece in plan.steps if piece.chunk})
    workers = num_threads(threads)
    report = VerifyReport(selected, chunks=len(needed))
    with tempfile.TemporaryDirectory(prefix="composer-sync-") as staging:
        reader, _ = fetch_chunks(store, needed, Path(staging), workers)
        rebuilder = _Rebuilder(reader, manifests)

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
                _opaque_bytes(reader, record, vid)
    return report


@dataclass
class RelayInfo:
    versions: list[str] = field(default_factory=list)
    chunks_copied: int = 0
    bytes_copied: int = 0


def relay(source: Store, dest: Store, version: str | None = None) -> RelayInfo:
    """Copy the chain of `version` (default: head) from `source` into `dest`, chunks first, manifests last,
    so `dest` can serve its own cluster. Chunks already in `dest` are not copied again."""
    target = version or source.head()
    if target is None:
        raise UserError(f"store {source.location} holds no versions yet")
    chain = list(reversed(source.chain(target)))
    have = set(dest.versions())
    todo = [m for m in chain if m.id not in have]
    info = RelayInfo()
    lock = threading.Lock()

    def copy(cid: str) -> None:
        if dest.has_chunk(cid):
            return
        data = source.get_chunk(cid)
        dest.put_chunk(data, cid)
        with lock:
            info.chunks_copied += 1
            info.bytes_copied += len(data)

    chunk_ids = sorted(set().union(*(m.chunk_ids() for m in todo))) if todo else []
    with ThreadPoolExecutor(max(source.transport.parallelism, dest.transport.parallelism)) as pool:
        list(pool.map(copy, chunk_ids))
    for manifest in todo:
        if dest.put_manifest_copy(manifest):
            info.versions.append(manifest.id)
    return info
