"""Receivers: bring a directory to a version of a store, atomically, and apply versions to live tensors.

A receiver directory holds
    versions/<id>/         complete safetensors checkpoints (written under a temp name, then renamed)
    manifests/<id>.json    the manifest of each version held, so the next pull can check its base
    current -> versions/<id>   a symlink replaced atomically: a reader never sees a half-written model
A pull applies only the deltas after the receiver's current version when it is on the target's chain.

`update_in_place` instead patches the current version's files where the target differs (no second copy),
for a live engine that then reloads just those tensors. While it writes, a marker makes the directory hold
no current version, so a kill -9 mid-update leads the next pull to rebuild from the anchor.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from composer.recipes.errors import UserError
from composer.runtime.run_dir import atomic_write_bytes, fsync_dir
from composer.sync.checkpoint import UINT_OF_WIDTH, Checkpoint, create_safetensors, numpy_dtype, parse_header
from composer.sync.manifest import Manifest, TensorRecord
from composer.sync.pool import num_threads, ordered_map
from composer.sync.rebuild import (
    PiecePlan,
    Progress,
    Rebuilder,
    WrongBaseError,
    fetch_chunks,
    needed_chunks,
    plan_tensor,
    restore_opaque,
)
from composer.sync.store import Store
from composer.sync.transports import LocalTransport


class ReceiverDir:
    def __init__(self, root: Path):
        self.root = root
        self.versions = root / "versions"
        self.manifests = root / "manifests"

    @property
    def patching(self) -> Path:
        """Present while `update_in_place` rewrites the current version's files."""
        return self.root / ".patching"

    def current_id(self) -> str | None:
        link = self.root / "current"
        if not link.is_symlink() or self.patching.exists():
            return None
        vid = Path(os.readlink(link)).name
        return vid if (self.versions / vid).is_dir() and (self.manifests / f"{vid}.json").is_file() else None

    def path(self, vid: str) -> Path:
        return self.versions / vid

    def manifest(self, vid: str) -> Manifest:
        path = self.manifests / f"{vid}.json"
        return Manifest.from_bytes(path.read_bytes(), str(path))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's writer lock (one pull at a time) and clear what a killed pull left behind."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserError(f"{self.root}: another pull is writing to this directory") from None
            if self.versions.is_dir():
                for leftover in self.versions.glob(".tmp-*"):
                    shutil.rmtree(leftover, ignore_errors=True)
            yield

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
        self.patching.unlink(missing_ok=True)
        fsync_dir(self.root)
        keep = {manifest.id, previous}  # a reader may still hold the previous version open
        for entry in self.versions.iterdir():
            if entry.name not in keep and not entry.name.startswith("."):
                shutil.rmtree(entry, ignore_errors=True)
                (self.manifests / f"{entry.name}.json").unlink(missing_ok=True)


@dataclass
class PullInfo:
    version: str
    started_from: str
    """The receiver's previous version when the chain was applied to it, else the anchor."""
    fetched_bytes: int = 0
    model_bytes: int = 0
    seconds: float = 0.0
    already_current: bool = False


def _target_version(store: Store, version: str | None) -> str:
    """`version`, or the store's head when None."""
    target_id = version or store.head()
    if target_id is None:
        raise UserError(f"store {store.location} holds no versions yet")
    return target_id


def pull(
    store: Store,
    to: Path,
    version: str | None = None,
    threads: int = 0,
    on_progress: Progress | None = None,
    on_fetch: Progress | None = None,
) -> PullInfo:
    """Bring the receiver directory `to` to `version` (default: the store's head) and make it current.
    `on_fetch` gets the bytes of each chunk downloaded, `on_progress` the bytes of each piece rebuilt."""
    started = time.monotonic()
    receiver, target_id = ReceiverDir(to), _target_version(store, version)
    with receiver.locked():
        return _pull_locked(store, to, target_id, threads, on_progress, on_fetch, started)


def _pull_locked(
    store: Store, to: Path, target_id: str, threads: int, on_progress: Progress | None, on_fetch: Progress | None, started: float
) -> PullInfo:
    receiver = ReceiverDir(to)
    current = receiver.current_id()
    if current == target_id:
        return PullInfo(target_id, current, already_current=True)
    chain = store.chain(target_id, stop_at=current)
    manifests = {m.id: m for m in chain}
    base = current if current and chain[-1].parent == current else None  # else: rebuild from the anchor
    if base:
        manifests[base] = receiver.manifest(base)
    target = manifests[target_id]
    plans = [plan for name in target.tensors for plan in plan_tensor(manifests, target_id, name, base)]
    workers = num_threads(threads)
    reader, fetched = fetch_chunks(store, needed_chunks(plans, target), to / ".incoming", workers, on_fetch)
    staged = receiver.staging(target_id)
    try:
        _write_version(staged, target, plans, Rebuilder(reader, manifests), receiver.path(base) if base else None, workers, on_progress)
        receiver.install(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if not isinstance(store.transport, LocalTransport):
        shutil.rmtree(to / ".incoming", ignore_errors=True)
    return PullInfo(target_id, base or target.anchor, fetched, sum(p.nbytes for p in plans), time.monotonic() - started)


def _write_version(
    staged: Path,
    target: Manifest,
    plans: list[PiecePlan],
    rebuilder: Rebuilder,
    base_dir: Path | None,
    workers: int,
    on_progress: Progress | None,
) -> None:
    """Write every file of `target` into `staged`: safetensors files piece by piece on worker threads
    (each piece verified), then the opaque files; everything fsynced."""
    fds: dict[str, int] = {}
    base = Checkpoint(base_dir) if base_dir else None
    try:
        offsets = {}
        for record in target.files:
            path = staged / record.name
            path.parent.mkdir(parents=True, exist_ok=True)
            fds[record.name] = create_safetensors(path, record.header, record.size)
            for info in parse_header(record.header, record.name, record.size, f"version {target.id}").tensors:
                offsets[info.name] = (record.name, info.offset)

        def load_base(plan: PiecePlan, out: np.ndarray) -> None:
            base.read(base.tensors[plan.name], plan.start, plan.stop, out)

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
            with open(path, "wb") as f:
                restore_opaque(rebuilder.chunks, record, target.id, f)
                f.flush()
                os.fsync(f.fileno())
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
        if base:
            base.close()


@dataclass
class InPlaceInfo:
    version: str
    started_from: str | None
    """The version the receiver held (None when it held none and a full pull was made)."""
    full: bool
    """A complete copy was written (no usable current version, or the files' layout changed)."""
    changed: list[str] = field(default_factory=list)
    """Tensors whose bytes the update rewrote (every tensor after a full pull)."""
    fetched_bytes: int = 0
    patched_bytes: int = 0
    seconds: float = 0.0


def update_in_place(store: Store, to: Path, version: str | None = None, threads: int = 0) -> InPlaceInfo:
    """Bring the receiver `to` to `version` (default: head) by rewriting, in its current version's files, the
    pieces whose hashes differ, each rebuilt from the delta chain (or from the anchor when the receiver is off
    the target's chain) and checked; opaque files that changed are replaced. Falls back to a full `pull` when
    there is no current version, the safetensors headers differ, or a file is shared through a hard link."""
    started = time.monotonic()
    receiver, target_id = ReceiverDir(to), _target_version(store, version)
    with receiver.locked():
        current = receiver.current_id()
        target = store.manifest(target_id)
        if current == target_id:
            return InPlaceInfo(target_id, current, full=False)
        held = receiver.manifest(current) if current else None
        directory = receiver.path(current) if current else None
        if held is None or not _patchable(held, target, directory):
            full = _full_pull(store, to, target_id, threads, receiver)
            return InPlaceInfo(
                target_id, None, True, sorted(target.tensors), full.fetched_bytes, full.model_bytes, time.monotonic() - started
            )
        chain = store.chain(target_id, stop_at=current)
        manifests = {m.id: m for m in chain}
        base = current if chain[-1].parent == current else None  # else: rebuild the differing pieces from the anchor
        if base:
            manifests[base] = held
        plans = []
        for name, record in target.tensors.items():
            differing = {i for i, (a, b) in enumerate(zip(record.pieces, held.tensors[name].pieces)) if a.hash != b.hash}
            if differing:
                plans += [plan for plan in plan_tensor(manifests, target_id, name, base) if plan.index in differing]
        workers = num_threads(threads)
        reader, fetched = fetch_chunks(store, needed_chunks(plans, target), to / ".incoming", workers)
        atomic_write_bytes(receiver.patching, target_id.encode())
        try:
            patched = _patch(directory, plans, Rebuilder(reader, manifests), workers)
        except WrongBaseError:  # the held copy was modified behind our back: rebuild it whole
            full = _full_pull(store, to, target_id, threads, receiver)
            return InPlaceInfo(
                target_id, None, True, sorted(target.tensors), full.fetched_bytes, full.model_bytes, time.monotonic() - started
            )
        before = {o.name: o.hash for o in held.opaque}
        for record in target.opaque:
            if before.get(record.name) != record.hash:
                path = directory / record.name
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".tmp-{path.name}")
                with open(tmp, "wb") as f:
                    restore_opaque(reader, record, target_id, f)
                os.replace(tmp, path)
        staged = receiver.staging(target_id)
        os.rmdir(staged)
        os.rename(directory, staged)  # the directory now holds the target: named after it, then installed
        receiver.install(staged, target)
        (receiver.manifests / f"{current}.json").unlink(missing_ok=True)
        if not isinstance(store.transport, LocalTransport):
            shutil.rmtree(to / ".incoming", ignore_errors=True)
        return InPlaceInfo(target_id, current, False, sorted({plan.name for plan in plans}), fetched, patched, time.monotonic() - started)


def _patch(directory: Path, plans: list[PiecePlan], rebuilder: Rebuilder, workers: int) -> int:
    """Rebuild each planned piece from the directory's own bytes and write it back in place; returns bytes written."""
    with Checkpoint(directory) as checkpoint:
        fds = {f.name: os.open(directory / f.name, os.O_WRONLY) for f in checkpoint.files}
        try:

            def patch(plan: PiecePlan) -> int:
                info = checkpoint.tensors[plan.name]
                data = rebuilder.run(plan, lambda p, out: checkpoint.read(info, p.start, p.stop, out))
                os.pwrite(fds[info.file], memoryview(data).cast("B"), info.offset + plan.start * plan.itemsize)
                return plan.nbytes

            return sum(ordered_map(patch, plans, workers))
        finally:
            for fd in fds.values():
                os.close(fd)


def _patchable(held: Manifest, target: Manifest, directory: Path) -> bool:
    """Same files with the same headers (so every tensor sits where it was), none shared by a hard link."""
    if [(f.name, f.header, f.size) for f in held.files] != [(f.name, f.header, f.size) for f in target.files]:
        return False
    if any(len(a.pieces) != len(target.tensors[n].pieces) for n, a in held.tensors.items()):
        return False
    return all((directory / f.name).stat().st_nlink == 1 for f in held.files)


def _full_pull(store: Store, to: Path, version: str, threads: int, receiver: ReceiverDir) -> PullInfo:
    """`pull` from inside `update_in_place`'s lock: a damaged current version (marker left) is dropped first."""
    if receiver.patching.exists():
        link = to / "current"
        if link.is_symlink():
            shutil.rmtree(to / os.readlink(link), ignore_errors=True)
            link.unlink()
        receiver.patching.unlink()
    return _pull_locked(store, to, version, threads, None, None, time.monotonic())


def apply_version(
    store: Store, version_id: str, base_tensors: Mapping[str, np.ndarray], threads: int = 0
) -> Iterator[tuple[str, np.ndarray]]:
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
        rebuilder = Rebuilder(reader, manifests)
        for name, record in records.items():
            flat = _base_view(base_tensors, name, record) if any(p.base_hash for p in plans[name]) else None

            def load_base(plan: PiecePlan, out: np.ndarray, flat: np.ndarray | None = flat) -> None:
                out[:] = flat[plan.start : plan.stop]

            result = np.empty(record.numel, dtype=UINT_OF_WIDTH[record.itemsize])
            for plan in plans[name]:
                rebuilder.run(plan, load_base, out=result[plan.start : plan.stop])
            yield name, result.view(numpy_dtype(record.dtype)).reshape(record.shape)


def _base_view(base_tensors: Mapping[str, np.ndarray], name: str, record: TensorRecord) -> np.ndarray:
    array = base_tensors.get(name)
    if array is None:
        raise WrongBaseError(f"tensor {name!r} changed in this version but is missing from the base tensors")
    array = np.ascontiguousarray(array)
    if array.itemsize != record.itemsize or array.size != record.numel:
        raise WrongBaseError(
            f"tensor {name!r}: base has {array.size} elements of {array.itemsize} bytes, "
            f"the version has {record.numel} of {record.itemsize}"
        )
    return array.reshape(-1).view(UINT_OF_WIDTH[record.itemsize])


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
