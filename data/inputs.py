"""Inputs users have, as datatrove Documents: text files, JSONL (plain, .gz, .zst), Parquet, and directories or git
repositories of code (every file with its repository-relative path, one repository read by one task).

A source's inputs are split into units (a file, or a repository), planned once by the driver; task `r` of `n`
reads the r-th of n consecutive shares of them, so the documents keep the inputs' order and a task's documents
never depend on how many workers run. Files
left out by `data.files` (excluded patterns, oversized, binary) are counted by rule.

The readers are written here rather than taken from datatrove: its readers shard the files of one folder and skip
records they cannot parse with a warning, while a corrupt input must be one clear error here (or skipped and
counted where `data.files.on_unreadable: skip` asks for that), and it has no repository reader.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import os
import subprocess
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import zstandard
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from composer.recipes.errors import UserError
from composer.recipes.schema import DataSource, InputFilesSection

BINARY_PROBE = 8192
"""Bytes read to tell binary from text: a NUL byte among them means binary."""

LANGUAGES = {
    ".py": "python",
    ".pyi": "python",
    ".js": "javascript",
    ".mjs": "javascript",
    ".cjs": "javascript",
    ".jsx": "javascript",
    ".ts": "typescript",
    ".tsx": "typescript",
    ".go": "go",
    ".rs": "rust",
    ".c": "c",
    ".h": "c",
    ".cc": "cpp",
    ".cpp": "cpp",
    ".cxx": "cpp",
    ".hpp": "cpp",
    ".hh": "cpp",
    ".java": "java",
    ".kt": "kotlin",
    ".scala": "scala",
    ".rb": "ruby",
    ".php": "php",
    ".cs": "csharp",
    ".swift": "swift",
    ".sh": "shell",
    ".bash": "shell",
    ".zsh": "shell",
    ".pl": "perl",
    ".lua": "lua",
    ".r": "r",
    ".jl": "julia",
    ".hs": "haskell",
    ".ml": "ocaml",
    ".sql": "sql",
    ".html": "html",
    ".css": "css",
    ".md": "markdown",
    ".rst": "restructuredtext",
    ".txt": "text",
    ".json": "json",
    ".yaml": "yaml",
    ".yml": "yaml",
    ".toml": "toml",
    ".xml": "xml",
    ".ini": "ini",
    ".cfg": "ini",
}
INTERPRETERS = {
    "python": "python",
    "python3": "python",
    "bash": "shell",
    "sh": "shell",
    "zsh": "shell",
    "node": "javascript",
    "ruby": "ruby",
    "perl": "perl",
    "php": "php",
    "lua": "lua",
}


def language_of(path: str, text: str) -> str:
    """Language of a file by its extension, else its shebang line; `unknown` when neither says."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in LANGUAGES:
        return LANGUAGES[suffix]
    if os.path.basename(path) in ("Makefile", "Dockerfile", "CMakeLists.txt"):
        return os.path.basename(path).split(".")[0].lower()
    if text.startswith("#!"):
        for word in reversed(text[2:].split("\n", 1)[0].replace("/", " ").split()):
            if word.rstrip("0123456789.") in INTERPRETERS:  # python3.11, env python
                return INTERPRETERS[word.rstrip("0123456789.")]
    return "unknown"


# --- planning (the driver) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """What one task reads in one go: a file, or a whole repository."""

    path: str
    fingerprint: list
    """What the unit's content depends on, for the cache key: (size, mtime) of files, HEAD of a git repository
    (its tracked files at HEAD are what is read), every file's stat of a plain directory."""


def plan_units(source: DataSource, index: int) -> list[Unit]:
    """The source's units in a fixed order (sorted paths); every pattern must match something."""
    stdlib = sysconfig.get_paths()["stdlib"]
    # The interpreter's own site-packages sits inside the stdlib directory but is not the standard library.
    installed = tuple(os.path.join(stdlib, d) + os.sep for d in ("site-packages", "dist-packages"))
    want_dirs = source.format == "repository"
    found: set[str] = set()
    for pattern in source.paths:
        expanded = os.path.expanduser(pattern.replace("{stdlib}", stdlib))
        matched = [
            os.path.abspath(p)
            for p in glob.glob(expanded, recursive=True)
            if os.path.isdir(p) == want_dirs and not ("{stdlib}" in pattern and p.startswith(installed))
        ]
        if not matched:
            shown = pattern if expanded == pattern else f"{pattern!r} ({expanded})"
            if want_dirs and not glob.has_magic(expanded):
                raise UserError(
                    f"data.sources[{index}] ({source.name}): repository {shown} "
                    f"{'is not a directory' if os.path.exists(expanded) else 'does not exist'}"
                )
            what = "no repository directories" if want_dirs else "no files"
            raise UserError(f"data.sources[{index}] ({source.name}): {shown} matches {what}; the corpus would be empty")
        found.update(matched)
    return [Unit(path, _repository_fingerprint(path) if want_dirs else _stat(path)) for path in sorted(found)]


def _stat(path: str) -> list:
    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    return [st.st_size, st.st_mtime_ns]


def _repository_fingerprint(root: str) -> list:
    if _is_git(root):
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            raise UserError(f"{root}: a git repository without a commit to read ({head.stderr.strip()})")
        return ["git", head.stdout.strip()]
    return [[rel, *_stat(os.path.join(root, rel))] for rel in _walk(root)]


def _is_git(root: str) -> bool:
    return os.path.exists(os.path.join(root, ".git"))


def _walk(root: str) -> list[str]:
    """Every regular file under `root` (no symlinks, no .git), as sorted repository-relative paths."""
    out = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != ".git" and not os.path.islink(os.path.join(directory, d)))
        for name in files:
            full = os.path.join(directory, name)
            if not os.path.islink(full):
                out.append(os.path.relpath(full, root))
    return sorted(out)


# --- reading (the tasks) -----------------------------------------------------------------------


class SourceReader(PipelineStep):
    """Reads this task's units of one source into Documents; counts what the file rules leave out.

    Document metadata: `path` (repository-relative for repositories, else the file, or the record's path field),
    `language`, and for repositories `repository` (its root) and `license` (what it declares, see cleaning)."""

    type = "📖 - READER"
    name = "composer inputs"

    def __init__(self, source: DataSource, units: list[str], files: InputFilesSection):
        super().__init__()
        self.source, self.units, self.files = source, units, files

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from composer.data.cleaning import repository_license  # the licence rules live with the licence filter

        share = len(self.units) * rank // world_size, len(self.units) * (rank + 1) // world_size
        for unit in self.units[share[0] : share[1]]:
            with self.track_time():
                try:
                    if self.source.format == "repository":
                        documents = list(self._repository(unit, repository_license))
                    elif self.source.format == "text":
                        documents = list(self._text_file(unit))
                    elif self.source.format == "jsonl":
                        documents = list(self._jsonl(unit))
                    else:
                        documents = list(self._parquet(unit))
                except UnreadableInput as e:
                    if self.files.on_unreadable == "error":
                        raise UserError(str(e)) from None
                    self.stat_update("skipped_unreadable")
                    continue
            for document in documents:
                self.stat_update("documents_read")
                yield document

    # text and repositories: rules per file

    def _left_out(self, shown_path: str, size: int, head: bytes) -> str | None:
        for pattern in self.files.exclude:
            if fnmatch.fnmatchcase(shown_path, pattern):
                return f"excluded {pattern}"
        if size > self.files.max_file_bytes:
            return "oversized"
        if b"\0" in head[:BINARY_PROBE]:
            return "binary"
        return None

    def _file_document(self, doc_id: str, path: str, raw: bytes, shown_path: str, metadata: dict) -> Document | None:
        reason = self._left_out(shown_path, len(raw), raw)
        if reason:
            self.stat_update(f"skipped_{reason}")
            return None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
            self.stat_update("not_utf8")
        if not text.strip():
            return None
        return Document(text=text, id=doc_id, metadata={"path": path, "language": language_of(path, text), **metadata})

    def _text_file(self, path: str) -> Iterator[Document]:
        document = self._file_document(path, path, _read_bytes(path), path, {})
        if document:
            yield document

    def _repository(self, root: str, license_of) -> Iterator[Document]:
        files = _git_files(root) if _is_git(root) else ((rel, lambda rel=rel: _read_bytes(os.path.join(root, rel))) for rel in _walk(root))
        documents = []
        for rel, read in files:
            document = self._file_document(f"{root}:{rel}", rel, read(), "/" + rel, {"repository": root})
            if document:
                documents.append(document)
        declared = license_of({d.metadata["path"]: d.text for d in documents})
        for document in documents:
            document.metadata["license"] = declared
            yield document

    # records

    def _record_document(self, record: object, where: str, doc_id: str) -> Document | None:
        field, path_field = self.source.text_field, self.source.path_field
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(f"{where}: no string field {field!r} (set data.sources[].text_field)")
        if not text.strip():
            return None
        path = record.get(path_field) if isinstance(record.get(path_field), str) else ""
        return Document(text=text, id=doc_id, metadata={"path": path, "language": language_of(path, text)})

    def _jsonl(self, path: str) -> Iterator[Document]:
        for number, line in enumerate(_jsonl_lines(path), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except UnicodeDecodeError:
                raise UserError(f"{path}:{number}: not valid UTF-8") from None
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{number}: invalid JSON ({e.msg} at column {e.colno})") from None
            document = self._record_document(record, f"{path}:{number}", f"{path}:{number}")
            if document:
                yield document

    def _parquet(self, path: str) -> Iterator[Document]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = None
        try:
            with pq.ParquetFile(_read_bytes_buffer(path)) as parquet:
                names = parquet.schema_arrow.names
                if self.source.text_field not in names:
                    raise UserError(
                        f"{path}: no column {self.source.text_field!r} (set data.sources[].text_field); it has {', '.join(names)}"
                    )
                columns = [c for c in (self.source.text_field, self.source.path_field) if c in names]
                row = 0
                for batch in parquet.iter_batches(columns=columns, batch_size=1024):
                    for record in batch.to_pylist():
                        row += 1
                        document = self._record_document(record, f"{path}: row {row}", f"{path}:{row}")
                        if document:
                            yield document
        except (pa.ArrowException, OSError) as e:
            raise UnreadableInput(f"{path}: not a readable Parquet file ({e})") from None


class UnreadableInput(Exception):
    """An input file that cannot be read or decoded (an error, or skipped and counted, as `data.files` says)."""


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UnreadableInput(f"{path}: cannot read ({e.strerror})") from None


def _read_bytes_buffer(path: str):
    import pyarrow as pa

    return pa.BufferReader(_read_bytes(path))


def _jsonl_lines(path: str) -> list[bytes]:
    raw = _read_bytes(path)
    try:
        if path.endswith(".gz"):
            raw = gzip.decompress(raw)
        elif path.endswith(".zst"):
            raw = _zstd_frames(raw)
    except (OSError, EOFError, zlib.error, zstandard.ZstdError) as e:
        kind = "gzip" if path.endswith(".gz") else "zstd"
        raise UnreadableInput(f"{path}: not a valid {kind} file ({e})") from None
    return raw.splitlines()


def _zstd_frames(raw: bytes) -> bytes:
    """Every frame of a zstd file, decompressed; a truncated frame is an error (a stream reader would stop quietly)."""
    out = []
    while raw:
        frame = zstandard.ZstdDecompressor().decompressobj()
        out.append(frame.decompress(raw))
        if not frame.eof:
            raise zstandard.ZstdError("truncated: the last frame ends early")
        raw = frame.unused_data
    return b"".join(out)


def _git_files(root: str) -> Iterator[tuple[str, object]]:
    """(path, reader of its bytes) of every regular file tracked at HEAD, in path order."""
    listing = subprocess.run(["git", "-C", root, "ls-tree", "-r", "-z", "--full-tree", "HEAD"], capture_output=True)
    if listing.returncode != 0:
        raise UnreadableInput(f"{root}: cannot list the git repository ({listing.stderr.decode(errors='replace').strip()})")
    blobs = []
    for entry in listing.stdout.split(b"\0"):
        if not entry:
            continue
        meta, rel = entry.split(b"\t", 1)
        mode, kind, sha = meta.split()
        if kind == b"blob" and mode in (b"100644", b"100755"):  # no symlinks (120000) or submodules (160000)
            blobs.append((rel.decode("utf-8", errors="replace"), sha.decode()))
    blobs.sort()
    process = subprocess.Popen(["git", "-C", root, "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        for rel, sha in blobs:
            process.stdin.write(sha.encode() + b"\n")
            process.stdin.flush()
            header = process.stdout.readline().split()
            content = process.stdout.read(int(header[2]))
            process.stdout.read(1)  # the newline after each object
            yield rel, lambda content=content: content
    finally:
        process.stdin.close()
        process.wait()
