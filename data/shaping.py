"""Shaping for code models, then tokens: fill-in-the-middle, repository-level documents, one Megatron indexed
dataset per task.

Written here because datatrove has neither a FIM transform nor repository documents, and its tokenizers write
their own format or take text as it is (the special tokens of FIM and file headers must be inserted as ids, never
parsed out of a file that happens to contain their strings).

FIM (Bavarian et al. 2022), per file, at character level: two cut points drawn uniformly split a file into
prefix, middle and suffix;
    PSM: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM: <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle
Each file's draw is seeded by `fim.seed` and the document id alone, so it is the same in any task or worker.

A repository document: <repo_name> name "\\n", then per file <file_sep> path "\\n" content (or its FIM form), files in
dependency order (a file's local imports/includes before it, then by path; cycles broken by path order).
Megatron's GPTDataset then packs documents into `seq_length` sequences (concatenated, no padding), keeping each
document inside one of the train/valid/test splits.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from pathlib import Path

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from composer.data.tokenizer import CorpusTokenizer, text_tokenizer
from composer.recipes.schema import FimSection


def fim_split(text: str, rng: random.Random) -> tuple[str, str, str]:
    """Prefix, middle, suffix of `text` at two uniformly drawn cut points."""
    a, b = sorted(rng.randrange(len(text) + 1) for _ in range(2))
    return text[:a], text[a:b], text[b:]


# --- dependency order --------------------------------------------------------------------------

_PY_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(\.*[\w.]*)[ \t]+import|import[ \t]+([\w., \t]+))", re.M)
_JS_IMPORT = re.compile(r"""(?:\bfrom\s*|\brequire\(\s*|\bimport\s*\(?\s*)['"](\.{1,2}/[^'"]+)['"]""")
_C_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)
_JS_SUFFIXES = ("", ".js", ".ts", ".jsx", ".tsx", ".mjs", "/index.js", "/index.ts")


def _python_modules(paths: set[str]) -> dict[str, str]:
    """Dotted module name -> path of every Python file (also without a leading `src.`: the src layout)."""
    modules = {}
    for path in sorted(p for p in paths if p.endswith(".py")):
        name = path[:-3].replace("/", ".").removesuffix(".__init__")
        modules[name] = path
        modules.setdefault(name.removeprefix("src."), path)
    return modules


def _python_imports(path: str, text: str) -> list[str]:
    """Absolute dotted names `path` imports (relative imports resolved against its package)."""
    package = path[:-3].replace("/", ".").removesuffix(".__init__")
    if not path.endswith("__init__.py"):
        package = package.rpartition(".")[0]
    names = []
    for relative, plain in _PY_IMPORT.findall(text):
        if not relative:
            names += [n.split()[0] for n in plain.split(",") if n.split()]
            continue
        dots = len(relative) - len(relative.lstrip("."))
        base = package.split(".")[: len(package.split(".")) - dots + 1] if dots and package else []
        names.append(".".join([*base, relative.lstrip(".")] if relative.lstrip(".") else base) if dots else relative)
    return names


def local_dependencies(path: str, text: str, paths: set[str], modules: dict[str, str]) -> set[str]:
    """The files of the repository that `path` imports or includes."""
    found = set()
    directory = os.path.dirname(path)
    if path.endswith(".py"):
        for name in _python_imports(path, text):
            # `from a.b import c`: c may be a module (a/b/c.py) or a name in a/b.py
            target = modules.get(name) or modules.get(name.rpartition(".")[0])
            if target:
                found.add(target)
    elif path.endswith((".js", ".ts", ".jsx", ".tsx", ".mjs", ".cjs")):
        for spec in _JS_IMPORT.findall(text):
            base = os.path.normpath(os.path.join(directory, spec))
            found.update(base + s for s in _JS_SUFFIXES if base + s in paths)
    elif path.endswith((".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh")):
        for spec in _C_INCLUDE.findall(text):
            local = os.path.normpath(os.path.join(directory, spec))
            if local in paths:
                found.add(local)
            elif spec in paths:
                found.add(spec)
    found.discard(path)
    return found


def dependency_order(files: dict[str, str]) -> list[str]:
    """Paths with each file's local dependencies before it (depth first, in path order)."""
    paths = set(files)
    modules = _python_modules(paths)
    order, seen = [], set()

    def visit(path: str) -> None:
        seen.add(path)
        for dependency in sorted(local_dependencies(path, files[path], paths, modules)):
            if dependency not in seen:
                visit(dependency)
        order.append(path)

    for path in sorted(paths):
        if path not in seen:
            visit(path)
    return order


# --- tokens ------------------------------------------------------------------------------------


class Shaper(PipelineStep):
    """Turns this task's cleaned documents into token documents (FIM, repository documents) and writes them to
    `shard_folder/<rank>.bin/.idx` (a Megatron indexed dataset), in order."""

    type = "🔢 - TOKENIZER"
    name = "composer shaping"

    def __init__(self, tokenizer: CorpusTokenizer, fim: FimSection, repository_documents: bool, shard_folder: Path):
        super().__init__()
        self.tokenizer, self.fim, self.repository_documents, self.shard_folder = tokenizer, fim, repository_documents, shard_folder
        if fim.rate > 0:
            tokenizer.require(("fim_prefix", "fim_middle", "fim_suffix"), f"data.fim.rate={fim.rate}")
        if repository_documents:
            tokenizer.require(("repo_name", "file_sep"), "repository documents (data.sources[].repository_documents)")

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> None:
        """Consumes the stream at once (the last step of its stage): nothing comes after it."""
        with warnings.catch_warnings():
            # Imported here: megatron.core takes seconds to import (the local driver imports it before forking).
            warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
        self.encoder = text_tokenizer(self.tokenizer.file)
        self.shard_folder.mkdir(parents=True, exist_ok=True)
        temp = self.shard_folder / f".{rank:05d}.tmp"
        builder = IndexedDatasetBuilder(f"{temp}.bin", dtype=self.tokenizer.token_dtype)
        for group in self._groups(data):
            with self.track_time():
                ids = self._repository_tokens(group) if self.repository_documents else self._file_tokens(group[0])
                ids.append(self.tokenizer.eod)
                builder.add_document(np.asarray(ids, dtype=self.tokenizer.token_dtype), [len(ids)])
            self.stat_update("documents_out")
            self.stat_update("tokens_out", value=len(ids))
        builder.finalize(f"{temp}.idx")
        for suffix in (".bin", ".idx"):
            os.replace(f"{temp}{suffix}", self.shard_folder / f"{rank:05d}{suffix}")

    def _groups(self, data: DocumentsPipeline):
        """Consecutive documents of one repository (a repository is read by one task, its files in a row)."""
        group: list[Document] = []
        for document in data:
            if group and (not self.repository_documents or document.metadata.get("repository") != group[0].metadata.get("repository")):
                yield group
                group = []
            group.append(document)
        if group:
            yield group

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.encoder.encode_batch_fast(texts, add_special_tokens=False)]

    def _file_tokens(self, document: Document) -> list[int]:
        language = document.metadata.get("language", "unknown")
        self.stat_update(f"language_{language}")
        rng = random.Random(f"{self.fim.seed}:{document.id}")
        if self.fim.rate == 0 or rng.random() >= self.fim.rate:
            ids = self._encode([document.text])[0]
        else:
            special = self.tokenizer.special
            prefix, middle, suffix = fim_split(document.text, rng)
            if rng.random() < self.fim.spm_rate:
                encoded_suffix, encoded_rest = self._encode([suffix, prefix + middle])
                ids = [special["fim_prefix"], special["fim_suffix"], *encoded_suffix, special["fim_middle"], *encoded_rest]
                self.stat_update("fim_spm")
            else:
                encoded_prefix, encoded_suffix, encoded_middle = self._encode([prefix, suffix, middle])
                ids = [
                    special["fim_prefix"],
                    *encoded_prefix,
                    special["fim_suffix"],
                    *encoded_suffix,
                    special["fim_middle"],
                    *encoded_middle,
                ]
                self.stat_update("fim_psm")
        self.stat_update(f"language_tokens_{language}", value=len(ids))
        return ids

    def _repository_tokens(self, group: list[Document]) -> list[int]:
        special = self.tokenizer.special
        by_path = {d.metadata["path"]: d for d in group}
        order = dependency_order({path: d.text for path, d in by_path.items()})
        name = os.path.basename(group[0].metadata.get("repository", "").rstrip("/"))
        headers = self._encode([name + "\n", *(path + "\n" for path in order)])
        ids = [special["repo_name"], *headers[0]]
        for path, header in zip(order, headers[1:]):
            ids += [special["file_sep"], *header, *self._file_tokens(by_path[path])]
        self.stat_update("repository_documents")
        self.stat_update("repository_files", value=len(order))
        return ids
