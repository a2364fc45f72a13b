"""A versioned store of checkpoints: manifests plus content-addressed chunks, on any transport.

Layout under the store root:
    chunks/<hash>          packed, zstd-compressed piece payloads; the name is the hash of the bytes
    manifests/<id>.json    one per version, written LAST and exclusively, so a version is visible only
                           when all its chunks are there, and two pushers cannot both publish an id
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from composer.recipes.errors import UserError
from composer.recipes.schema import SSHSection
from composer.sync.codec import CorruptDataError, digest
from composer.sync.manifest import Manifest
from composer.sync.transports import Transport, build_transport, is_temp

CHUNKS, MANIFESTS = "chunks", "manifests"
_MANIFEST_NAME = re.compile(r"^(v\d{8})\.json$")


class VersionTakenError(UserError):
    """Another pusher published this version id first."""


class Store:
    def __init__(self, transport: Transport):
        self.transport = transport
        self.location = transport.location
        self._manifests: dict[str, Manifest] = {}

    @classmethod
    def open(cls, location: str, ssh: SSHSection | None = None, create: bool = False, endpoint: str | None = None) -> Store:
        """Open a store; `create` makes its directories, otherwise a missing store is a UserError.
        `endpoint` is the URL of an S3-compatible service for s3:// stores (default: AWS)."""
        store = cls(build_transport(location, ssh or SSHSection(), endpoint))
        try:
            if create:
                store.transport.makedirs(CHUNKS)
                store.transport.makedirs(MANIFESTS)
            elif not store.transport.exists(MANIFESTS):
                raise UserError(f"no sync store at {location} (nothing has been pushed there)")
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- versions ---------------------------------------------------------------------------

    def versions(self) -> list[str]:
        """Published version ids, oldest first."""
        names = (_MANIFEST_NAME.match(n) for n in self.transport.list(MANIFESTS))  # skips temp files
        return sorted(m.group(1) for m in names if m)

    def head(self) -> str | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def manifest(self, vid: str) -> Manifest:
        if vid not in self._manifests:
            try:
                data = self.transport.get(f"{MANIFESTS}/{vid}.json")
            except FileNotFoundError:
                raise UserError(f"store {self.location}: no version {vid}") from None
            manifest = Manifest.from_bytes(data, f"{self.location} version {vid}")
            if manifest.id != vid:
                raise CorruptDataError(f"{self.location} version {vid}: manifest names itself {manifest.id}")
            self._manifests[vid] = manifest
        return self._manifests[vid]

    def chain(self, vid: str, stop_at: str | None = None) -> list[Manifest]:
        """Manifests from `vid` back to its anchor (or to `stop_at`, excluded), newest first."""
        chain = [self.manifest(vid)]
        while not chain[-1].is_anchor and chain[-1].parent != stop_at:
            chain.append(self.manifest(chain[-1].parent))
        return chain

    def publish(self, manifest: Manifest) -> None:
        try:
            self.transport.publish(f"{MANIFESTS}/{manifest.id}.json", manifest.to_bytes())
        except FileExistsError:
            raise VersionTakenError(
                f"store {self.location}: version {manifest.id} was published by another pusher "
                "while this one was encoding; push again to build on the new head"
            ) from None
        self._manifests[manifest.id] = manifest

    def put_manifest_copy(self, manifest: Manifest) -> bool:
        """Publish a manifest taken from another store (relay); False when this store already has it."""
        try:
            self.transport.publish(f"{MANIFESTS}/{manifest.id}.json", manifest.to_bytes())
        except FileExistsError:
            if self.manifest(manifest.id).to_bytes() != manifest.to_bytes():
                raise UserError(
                    f"store {self.location} already has a DIFFERENT version {manifest.id}; relay only into stores fed from the same source"
                ) from None
            return False
        return True

    # --- chunks -----------------------------------------------------------------------------

    def has_chunk(self, cid: str) -> bool:
        return self.transport.exists(f"{CHUNKS}/{cid}")

    def put_chunk(self, data: bytes, cid: str | None = None) -> tuple[str, bool]:
        """Store `data` under its hash; returns (id, whether bytes were sent). Existing chunks are skipped."""
        cid = cid or digest(data)
        if self.has_chunk(cid):
            return cid, False
        self.transport.put(f"{CHUNKS}/{cid}", data)
        return cid, True

    def get_chunk(self, cid: str, needed_by: str = "") -> bytes:
        """A chunk's bytes, checked against its name."""
        try:
            data = self.transport.get(f"{CHUNKS}/{cid}")
        except FileNotFoundError:
            raise CorruptDataError(f"store {self.location}: chunk {cid}{needed_by} is missing") from None
        if digest(data) != cid:
            raise CorruptDataError(f"store {self.location}: chunk {cid}{needed_by} is damaged (hash mismatch)")
        return data

    # --- retention --------------------------------------------------------------------------

    def gc(self, keep_anchors: int, min_age_s: float) -> GcReport:
        """Keep the chains from the newest `keep_anchors` anchors; delete older versions and unreferenced chunks.

        Chunks younger than `min_age_s` are kept even when unreferenced: they may belong to a push in flight
        whose manifest is not published yet.
        """
        versions = self.versions()
        anchors = [v for v in versions if self.manifest(v).is_anchor]
        first_kept = anchors[-keep_anchors] if len(anchors) >= keep_anchors else (anchors[0] if anchors else None)
        doomed = [v for v in versions if first_kept is None or v < first_kept]
        kept = [v for v in versions if v not in doomed]
        for vid in doomed:  # manifests first: a version disappears before any of its chunks do
            self.transport.delete(f"{MANIFESTS}/{vid}.json")
            self._manifests.pop(vid, None)
        referenced = set().union(*(self.manifest(v).chunk_ids() for v in kept))
        now = time.time()
        deleted_chunks = 0
        for directory in (CHUNKS, MANIFESTS):
            for name, mtime in self.transport.list(directory).items():
                # leftovers of crashed writes, and chunks no kept version needs
                stale = is_temp(name) or (directory == CHUNKS and name not in referenced)
                if stale and now - mtime >= min_age_s:
                    self.transport.delete(f"{directory}/{name}")
                    deleted_chunks += directory == CHUNKS and not is_temp(name)
        self.transport.abort_partial_uploads(min_age_s)
        return GcReport(deleted_versions=doomed, kept_versions=kept, deleted_chunks=deleted_chunks)


@dataclass
class GcReport:
    deleted_versions: list[str]
    kept_versions: list[str]
    deleted_chunks: int
