"""Corpus files -> tokens -> Megatron indexed datasets, cached.

`prepare_data` tokenizes every source of a recipe's `data` section in a process pool, appends the
end-of-document token to each document and writes one Megatron `.bin/.idx` pair per source into a
cache entry named by a hash of everything those tokens depend on. `trainer.datasets` turns the
prepared sources into the blended GPT datasets training reads.

Cache key of a source: format settings, the SHA-256 of tokenizer.json, and for every input file its
absolute path, size and modification time (ns). Stat data rather than content hashes, because a cache
hit must not read the corpus: at scale that is terabytes on a shared filesystem, read again by every
node on every launch, while any write to a file changes its mtime. (A file rewritten with the same size
inside one mtime tick would be missed; copying a corpus elsewhere re-tokenizes it.)
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import sysconfig
import warnings
from dataclasses import dataclass
from multiprocessing.pool import Pool
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text
from tokenizers import Tokenizer

from recipes.errors import UserError
from recipes.schema import DataSection, DataSource
from runtime.run_dir import atomic_write_text, fsync_dir

CACHE_FORMAT = 2
"""Bump when the layout of cache entries or the tokenization rules change, so old entries are not reused."""


# --- tokenizer ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusTokenizer:
    """The HF tokenizer a corpus is tokenized with: what the cache key and the datasets need from it."""

    directory: Path
    sha256: str
    """Hash of tokenizer.json: part of every cache key."""
    vocab_size: int
    eod: int
    """End-of-document id appended after every document (the tokenizer's eos_token)."""

    @property
    def file(self) -> Path:
        return self.directory / "tokenizer.json"

    @property
    def token_dtype(self) -> type[np.number]:
        return np.uint16 if self.vocab_size < 65500 else np.int32  # Megatron's DType.optimal_dtype rule


def load_tokenizer(data: DataSection, model_checkpoint: str | None, model_vocab_size: int) -> CorpusTokenizer:
    """The tokenizer of `data.tokenizer`, else of `model.checkpoint`; checked against the model's vocabulary."""
    if data.tokenizer is not None:
        directory, origin = Path(data.tokenizer).expanduser(), "data.tokenizer"
    elif model_checkpoint is not None:
        directory, origin = Path(model_checkpoint).expanduser(), "model.checkpoint (data.tokenizer is unset)"
    else:
        raise UserError("no tokenizer: data.tokenizer and model.checkpoint are both unset; set data.tokenizer to an HF tokenizer directory")
    if not directory.is_dir():
        raise UserError(f"tokenizer directory {directory} (from {origin}) does not exist")
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise UserError(f"{directory} (from {origin}) has no tokenizer.json; it must be an HF tokenizer directory of a fast tokenizer")
    raw = file.read_bytes()
    try:
        tokenizer = Tokenizer.from_str(raw.decode())
    except Exception as e:  # tokenizers raises plain Exception subclasses for every parse problem
        raise UserError(f"{file}: not a valid HF tokenizer ({e})") from None
    eos = _eos_token(directory)
    eod = tokenizer.token_to_id(eos)
    if eod is None:
        raise UserError(f"{directory}: eos_token {eos!r} from tokenizer_config.json is not in the vocabulary")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size > model_vocab_size:
        raise UserError(
            f"tokenizer/model mismatch: {directory} has {vocab_size} tokens but model.vocab_size is {model_vocab_size}; "
            f"ids >= {model_vocab_size} would have no embedding. Use the model's tokenizer or raise model.vocab_size"
        )
    return CorpusTokenizer(directory, hashlib.sha256(raw).hexdigest(), vocab_size, eod)


def _eos_token(directory: Path) -> str:
    config_file = directory / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise UserError(f"{directory}: no tokenizer_config.json, so no eos_token to end documents with") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_file}: unreadable ({e})") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):  # serialised AddedToken
        eos = eos.get("content")
    if not isinstance(eos, str) or not eos:
        raise UserError(f"{config_file}: no eos_token; documents need an end-of-document token")
    return eos


# --- inputs ------------------------------------------------------------------------------------


def expand_paths(source: DataSource, index: int) -> list[Path]:
    """Input files of a source, sorted; every pattern must match at least one file."""
    stdlib = sysconfig.get_paths()["stdlib"]
    # The interpreter's own site-packages sits inside the stdlib directory but is not the standard library.
    installed = tuple(os.path.join(stdlib, d) + os.sep for d in ("site-packages", "dist-packages"))
    files: set[Path] = set()
    for pattern in source.paths:
        expanded = os.path.expanduser(pattern.replace("{stdlib}", stdlib))
        matched = [
            Path(p)
            for p in glob.glob(expanded, recursive=True)
            if not os.path.isdir(p) and not ("{stdlib}" in pattern and p.startswith(installed))
        ]
        if not matched:
            shown = pattern if expanded == pattern else f"{pattern!r} ({expanded})"
            raise UserError(f"data.sources[{index}] ({source.name}): {shown} matches no files; the corpus would be empty")
        files.update(p.absolute() for p in matched)
    return sorted(files)


def cache_key(source: DataSource, files: list[Path], tokenizer: CorpusTokenizer) -> str:
    """Hash of everything the tokens of a source depend on (see the module docstring for why stat data)."""
    stats = []
    for file in files:
        try:
            st = file.stat()
        except OSError as e:
            raise UserError(f"{file}: cannot read ({e.strerror})") from None
        stats.append([str(file), st.st_size, st.st_mtime_ns])
    described = {
        "cache_format": CACHE_FORMAT,
        "format": source.format,
        "jsonl_field": source.jsonl_field if source.format == "jsonl" else None,
        "tokenizer_sha256": tokenizer.sha256,
        "eod": tokenizer.eod,
        "files": stats,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


# --- tokenizing (runs in the worker processes) --------------------------------------------------


@dataclass(frozen=True)
class FileTokens:
    tokens: np.ndarray
    """Every document of the file, each followed by the end-of-document id."""
    document_lengths: np.ndarray
    """Length of each document in `tokens`, EOD included."""
    replaced_utf8: bool
    """The file was not valid UTF-8; bad bytes became U+FFFD."""


_worker_tokenizer: Tokenizer | None = None  # one per pool process, loaded once by the initializer


def _init_worker(tokenizer_file: str) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled once, by the parent, which stops the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; no Rust threads inside each worker
    _worker_tokenizer = Tokenizer.from_file(tokenizer_file)


def tokenize_file(path: Path, fmt: str, jsonl_field: str, eod: int, dtype: type[np.number], tokenizer: Tokenizer | None = None) -> FileTokens:
    """Tokens of one input file; `tokenizer` defaults to the pool worker's own."""
    if tokenizer is None:
        tokenizer = _worker_tokenizer
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    replaced = False
    if fmt == "text":
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text, replaced = raw.decode("utf-8", errors="replace"), True
        texts = [text] if text.strip() else []
    else:
        texts = _jsonl_documents(path, raw, jsonl_field)
    # The fast variant skips computing character offsets, which nothing here needs (about 20% less CPU).
    documents = [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    lengths = np.array([len(ids) + 1 for ids in documents], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    at = 0
    for ids in documents:
        tokens[at : at + len(ids)] = ids
        tokens[at + len(ids)] = eod
        at += len(ids) + 1
    return FileTokens(tokens, lengths, replaced)


def _jsonl_documents(path: Path, raw: bytes, field: str) -> list[str]:
    texts = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            raise UserError(f"{path}:{number}: not valid UTF-8") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{number}: invalid JSON ({e.msg} at column {e.colno})") from None
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise UserError(f"{path}:{number}: no string field {field!r} (set data.sources[].jsonl_field)")
        if value.strip():
            texts.append(value)
    return texts


# --- prepare -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedSource:
    name: str
    prefix: Path
    """Megatron path prefix: `prefix.bin` and `prefix.idx`."""
    weight: float
    num_files: int
    num_documents: int
    num_tokens: int
    num_files_not_utf8: int
    """Text files that were not valid UTF-8; their bad bytes became U+FFFD."""
    cached: bool
    """Found in the cache: nothing was tokenized."""


@dataclass(frozen=True)
class PreparedData:
    sources: list[PreparedSource]
    tokenizer: CorpusTokenizer

    @property
    def all_cached(self) -> bool:
        return all(s.cached for s in self.sources)


ENTRY_PREFIX = "tokens"  # file names inside a cache entry: tokens.bin, tokens.idx
MANIFEST = "manifest.json"


def prepare_data(data: DataSection, *, model_checkpoint: str | None, model_vocab_size: int, console: Console | None = None) -> PreparedData:
    """Tokenize every source not yet in the cache; return where each source's indexed dataset lies.

    Progress (files/s, tokens/s) is shown on `console` when given.
    """
    tokenizer = load_tokenizer(data, model_checkpoint, model_vocab_size)
    cache_dir = Path(data.cache_dir).expanduser()
    plans = []
    for index, source in enumerate(data.sources):
        files = expand_paths(source, index)
        key = cache_key(source, files, tokenizer)
        plans.append((source, files, cache_dir / f"{source.name}-{key[:20]}"))

    prepared: list[PreparedSource | None] = [_cached_source(s, f, entry) for s, f, entry in plans]
    if all(p is not None for p in prepared):
        return PreparedData(prepared, tokenizer)

    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temp_dirs(cache_dir)
    # fork (the Linux default of this Python): workers start in milliseconds with the modules already loaded.
    context = multiprocessing.get_context("fork")
    with (
        context.Pool(data.num_workers, initializer=_init_worker, initargs=(str(tokenizer.file),)) as pool,
        _progress(console) as progress,
    ):
        for i, (source, files, entry) in enumerate(plans):
            if prepared[i] is None:
                prepared[i] = _build_entry(pool, data.num_workers, progress, source, i, files, entry, tokenizer)
    return PreparedData(prepared, tokenizer)


def _cached_source(source: DataSource, files: list[Path], entry: Path) -> PreparedSource | None:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    return PreparedSource(
        source.name, entry / ENTRY_PREFIX, source.weight, len(files), manifest["num_documents"], manifest["num_tokens"], manifest["num_files_not_utf8"], cached=True
    )


def _build_entry(pool: Pool, num_workers: int, progress: Progress, source: DataSource, index: int, files: list[Path], entry: Path, tokenizer: CorpusTokenizer) -> PreparedSource:
    """Tokenize one source into a temporary directory, then rename it to `entry` (all or nothing)."""
    with warnings.catch_warnings():
        # Imported here, not at the top: megatron.core takes seconds to import and a cache hit needs none of it.
        # It announces on import that the optional Transformer Engine / Apex kernels are absent.
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    temp = entry.parent / f".tmp-{entry.name}-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        task = progress.add_task(source.name, total=len(files), tokens=0)
        work = functools.partial(tokenize_file, fmt=source.format, jsonl_field=source.jsonl_field, eod=tokenizer.eod, dtype=tokenizer.token_dtype)
        builder = IndexedDatasetBuilder(str(temp / f"{ENTRY_PREFIX}.bin"), dtype=tokenizer.token_dtype)
        num_documents = num_tokens = num_not_utf8 = 0
        # Ordered imap keeps documents in file order, so the same corpus always gives the same dataset.
        chunksize = max(1, min(32, len(files) // (8 * num_workers)))
        for result in pool.imap(work, files, chunksize=chunksize):
            at = 0
            for length in result.document_lengths:
                builder.add_document(result.tokens[at : at + length], [int(length)])
                at += length
            num_documents += len(result.document_lengths)
            num_tokens += len(result.tokens)
            num_not_utf8 += result.replaced_utf8
            progress.update(task, advance=1, tokens=num_tokens)
        builder.finalize(str(temp / f"{ENTRY_PREFIX}.idx"))
        if num_documents == 0:
            raise UserError(f"data.sources[{index}] ({source.name}): its {len(files)} file(s) hold no text; the corpus would be empty")
        for name in (f"{ENTRY_PREFIX}.bin", f"{ENTRY_PREFIX}.idx"):
            _fsync_file(temp / name)
        manifest = {
            "name": source.name,
            "format": source.format,
            "tokenizer": str(tokenizer.directory),
            "tokenizer_sha256": tokenizer.sha256,
            "num_files": len(files),
            "num_documents": num_documents,
            "num_tokens": num_tokens,
            "num_files_not_utf8": num_not_utf8,
        }
        atomic_write_text(temp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        try:
            temp.rename(entry)
        except OSError:
            if not (entry / MANIFEST).is_file():
                raise
            shutil.rmtree(temp)  # another prepare of the same corpus finished first; its entry is identical
        fsync_dir(entry.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return PreparedSource(source.name, entry / ENTRY_PREFIX, source.weight, len(files), num_documents, num_tokens, num_not_utf8, cached=False)


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _remove_abandoned_temp_dirs(cache_dir: Path) -> None:
    """Delete temporary entries of killed prepares on this host (their process no longer exists)."""
    host = socket.gethostname()
    for temp in cache_dir.glob(f".tmp-*-{host}-*"):
        pid = temp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(temp, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _RateColumn(ProgressColumn):
    """Average rate since the task started: of completed files, or of a numeric task field."""

    def __init__(self, unit: str, field: str | None = None):
        super().__init__()
        self.unit, self.field = unit, field

    def render(self, task: Task) -> Text:
        amount = task.completed if self.field is None else task.fields.get(self.field, 0)
        elapsed = task.elapsed or 0.0
        return Text(f"{_human(amount / elapsed if elapsed > 0 else 0.0)} {self.unit}", style="cyan")


def _human(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.1f}"


def _progress(console: Console | None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        _RateColumn("files/s"),
        _RateColumn("tokens/s", "tokens"),
        TimeElapsedColumn(),
        console=console,
        disable=console is None,
    )
