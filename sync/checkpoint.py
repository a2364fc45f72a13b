"""A safetensors checkpoint directory, read lazily and written piece by piece.

numpy has no bf16 or fp8, and `safe_open(framework="numpy")` refuses them, so the header is parsed here
and tensor bytes are read with `os.preadv` into caller-owned buffers: memory stays bounded by the piece
size however large the checkpoint is. Files that are not `*.safetensors` (config.json, tokenizer files)
are carried as opaque files.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from composer.recipes.errors import UserError
from composer.sync.codec import UINT_OF_WIDTH

# safetensors dtype -> bytes per element. Bit patterns are compared as unsigned ints of this width.
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# dtypes numpy represents natively; bf16 and fp8 are handed out as unsigned-int bit patterns.
NUMPY_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "F16": np.float16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "I64": np.int64,
    "U64": np.uint64,
    "F64": np.float64,
}

# torch dtype name -> safetensors dtype (checkpoints held in memory as torch tensors)
DTYPE_OF_TORCH = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
}
# The order in which safetensors' `save_file` lays out a file's tensors: by this rank of their dtype, highest
# first, then by name (its Rust `Dtype` enum order), so a header written here matches one it writes.
_SAVE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64")

MAX_HEADER_BYTES = 100 << 20


def numpy_dtype(st_dtype: str) -> np.dtype:
    """The numpy dtype a tensor of `st_dtype` is handed out as (bit patterns for bf16 and fp8)."""
    return np.dtype(NUMPY_DTYPES.get(st_dtype, UINT_OF_WIDTH[DTYPE_SIZES[st_dtype]]))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset of the tensor's data in its file."""
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return self.nbytes // self.itemsize

    @property
    def uint(self) -> np.dtype:
        return np.dtype(UINT_OF_WIDTH[self.itemsize])


@dataclass(frozen=True)
class SafetensorsFile:
    name: str
    """Path relative to the checkpoint directory."""
    header: str
    """The JSON header verbatim, so a rebuilt file is byte-identical to the original."""
    size: int
    tensors: tuple[TensorInfo, ...]

    @property
    def data_start(self) -> int:
        return 8 + len(self.header.encode())


def parse_safetensors(path: Path, name: str) -> SafetensorsFile:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise UserError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise UserError(f"{path}: not a safetensors file (header length {header_len} out of range)")
            raw = f.read(header_len)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = raw.decode()
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a safetensors file (header is not JSON)") from None
    return parse_header(header, name, size, str(path))


def parse_header(header: str, name: str, size: int, where: str) -> SafetensorsFile:
    """The tensors a safetensors header describes, checked against the file size."""
    try:
        entries = json.loads(header)
    except json.JSONDecodeError:
        raise UserError(f"{where}: not a safetensors file (header is not JSON)") from None
    if not isinstance(entries, dict):
        raise UserError(f"{where}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + len(header.encode())
    tensors = []
    for tensor_name, entry in entries.items():
        if tensor_name == "__metadata__":
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if dtype not in DTYPE_SIZES:
            raise UserError(
                f"{where}: tensor {tensor_name!r} has dtype {dtype!r}, which sync does not handle (supported: {', '.join(DTYPE_SIZES)})"
            )
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{where}: tensor {tensor_name!r} has a malformed header entry") from None
        if int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype] != end - begin or data_start + end > size:
            raise UserError(f"{where}: tensor {tensor_name!r} has inconsistent offsets (truncated file?)")
        tensors.append(TensorInfo(tensor_name, name, dtype, shape, data_start + begin, end - begin))
    tensors.sort(key=lambda t: t.offset)
    return SafetensorsFile(name, header, size, tuple(tensors))


def safetensors_header(tensors: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[str, int]:
    """The header safetensors' `save_file` writes for tensors {name: (dtype, shape)}, and the file's size."""
    order = sorted(tensors, key=lambda name: (-_SAVE_ORDER.index(tensors[name][0]), name))
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        dtype, shape = tensors[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype]
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":"), ensure_ascii=False)
    header += " " * (-len(header.encode()) % 8)
    return header, 8 + len(header.encode()) + offset


class Checkpoint:
    """A directory of `*.safetensors` files plus opaque files (config, tokenizer), read lazily."""

    def __init__(self, root: Path):
        if not root.is_dir():
            raise UserError(f"{root}: no such checkpoint directory")
        self.root = root
        self.files: list[SafetensorsFile] = []
        self.opaque: list[str] = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            if path.suffix == ".safetensors":
                self.files.append(parse_safetensors(path, rel))
            else:
                self.opaque.append(rel)
        if not self.files:
            raise UserError(f"{root}: no *.safetensors files in this checkpoint directory")
        self.tensors: dict[str, TensorInfo] = {}
        for file in self.files:
            for info in file.tensors:
                if info.name in self.tensors:
                    raise UserError(f"{root}: tensor {info.name!r} appears in both {self.tensors[info.name].file} and {file.name}")
                self.tensors[info.name] = info
        self._fds = {file.name: os.open(root / file.name, os.O_RDONLY) for file in self.files}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, info: TensorInfo, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """Elements [start, stop) of a tensor as unsigned-int bit patterns, read into `out` (reused buffer)."""
        view = out[: stop - start]
        want = view.nbytes
        got = os.preadv(self._fds[info.file], [memoryview(view).cast("B")], info.offset + start * info.itemsize)
        if got != want:
            raise UserError(f"{self.root / info.file}: file shrank while reading tensor {info.name!r}")
        return view

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create_safetensors(path: Path, header: str, size: int) -> int:
    """Create a file of `size` bytes holding the header; tensor data is then written with `os.pwrite`."""
    raw = header.encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
    os.ftruncate(fd, size)
    return fd


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Write named arrays (with their safetensors dtype; bf16/fp8 given as uint bit patterns) as one file,
    streaming each array's bytes, via a temp file renamed into place."""
    header, offset = {}, 0
    for name, (dtype, array) in tensors.items():
        if dtype not in DTYPE_SIZES or array.itemsize != DTYPE_SIZES[dtype]:
            raise UserError(f"tensor {name!r}: cannot store a {array.dtype} array as {dtype}")
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data region to 8 bytes
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, array in tensors.values():
            f.write(memoryview(np.ascontiguousarray(array)).cast("B"))
    os.replace(tmp, path)
