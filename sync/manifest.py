"""A version's manifest: everything needed to rebuild one checkpoint from its parent and the store's chunks.

Each tensor is cut into pieces (at most `codec.chunk_mb` each); a piece records its encoding, where its
payload lives (chunk id + offset + length) and the hash of the piece's raw bytes in THIS version, so every
step of a chain is checked. A tensor keeps its piece boundaries along a delta chain. The manifest carries
a checksum of its own body, so a damaged manifest is refused rather than misread.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from composer.sync.checkpoint import DTYPE_SIZES
from composer.sync.codec import ENCODINGS, RAW, SAME, CorruptDataError, digest

FORMAT = 1


def version_id(seq: int) -> str:
    return f"v{seq:08d}"


def version_seq(vid: str) -> int:
    return int(vid[1:])


@dataclass
class Piece:
    stop: int
    """End element (exclusive); the piece starts where the previous one stops."""
    hash: str
    """Hash of the piece's raw bytes in this version."""
    encoding: str
    changed: int = 0
    gap_width: int = 0
    chunk: str | None = None
    offset: int = 0
    length: int = 0


@dataclass
class TensorRecord:
    dtype: str
    shape: list[int]
    pieces: list[Piece]

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return self.pieces[-1].stop

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def bounds(self) -> list[tuple[int, int]]:
        starts = [0] + [p.stop for p in self.pieces[:-1]]
        return [(start, p.stop) for start, p in zip(starts, self.pieces)]

    def same_layout(self, other: TensorRecord) -> bool:
        return self.dtype == other.dtype and self.shape == other.shape and [p.stop for p in self.pieces] == [p.stop for p in other.pieces]

    @property
    def unchanged(self) -> bool:
        return all(p.encoding == SAME for p in self.pieces)


@dataclass
class FileRecord:
    name: str
    """Path relative to the checkpoint directory."""
    header: str
    """The safetensors JSON header verbatim: tensor names, dtypes, shapes and offsets in the file."""
    size: int


@dataclass
class OpaqueRecord:
    name: str
    size: int
    hash: str
    chunks: list[str]


@dataclass
class Manifest:
    id: str
    parent: str | None
    anchor: str
    created: str
    files: list[FileRecord]
    tensors: dict[str, TensorRecord]
    opaque: list[OpaqueRecord]
    stats: dict = field(default_factory=dict)
    """full_bytes, stored_bytes, changed_elements, total_elements, encodings (piece counts)."""

    @property
    def is_anchor(self) -> bool:
        return self.anchor == self.id

    @property
    def seq(self) -> int:
        return version_seq(self.id)

    def chunk_ids(self) -> set[str]:
        ids = {p.chunk for t in self.tensors.values() for p in t.pieces if p.chunk}
        return ids | {c for o in self.opaque for c in o.chunks}

    def same_tensors(self, other: Manifest) -> bool:
        """The same tensor names, dtypes and shapes (an engine holding one can take the other tensor by tensor)."""
        return {n: (t.dtype, t.shape) for n, t in self.tensors.items()} == {n: (t.dtype, t.shape) for n, t in other.tensors.items()}

    def differing_tensors(self, other: Manifest) -> list[str]:
        """Tensors whose bytes differ from `other`'s (compared by piece hashes)."""
        return sorted(
            n
            for n, t in self.tensors.items()
            if n not in other.tensors or [p.hash for p in t.pieces] != [p.hash for p in other.tensors[n].pieces]
        )

    def piece_hashes(self) -> dict[str, list[list]]:
        """Tensor name -> [[stop, hash], ...]: what a receiver checks the bytes it loads against."""
        return {n: [[p.stop, p.hash] for p in t.pieces] for n, t in self.tensors.items()}

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body["format"] = FORMAT
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return json.dumps({"checksum": digest(text.encode()), "manifest": json.loads(text)}, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        try:
            outer = json.loads(data)
            body = outer["manifest"]
            text = json.dumps(body, sort_keys=True, separators=(",", ":"))
            ok = outer["checksum"] == digest(text.encode())
        except (ValueError, KeyError, TypeError):
            raise CorruptDataError(f"{where}: manifest is damaged (not the JSON sync writes)") from None
        if not ok:
            raise CorruptDataError(f"{where}: manifest is damaged (checksum mismatch)")
        if body.get("format") != FORMAT:
            raise CorruptDataError(f"{where}: manifest format {body.get('format')!r}; this composer reads {FORMAT}")
        try:
            tensors = {name: TensorRecord(t["dtype"], t["shape"], [Piece(**p) for p in t["pieces"]]) for name, t in body["tensors"].items()}
            manifest = cls(
                id=body["id"],
                parent=body["parent"],
                anchor=body["anchor"],
                created=body["created"],
                files=[FileRecord(**f) for f in body["files"]],
                tensors=tensors,
                opaque=[OpaqueRecord(**o) for o in body["opaque"]],
                stats=body["stats"],
            )
        except (KeyError, TypeError):
            raise CorruptDataError(f"{where}: manifest is missing fields") from None
        bad = [p.encoding for t in tensors.values() for p in t.pieces if p.encoding not in ENCODINGS]
        if bad or (manifest.is_anchor and any(p.encoding != RAW for t in tensors.values() for p in t.pieces)):
            raise CorruptDataError(f"{where}: manifest has invalid piece encodings")
        return manifest
