"""The HF tokenizer a corpus is tokenized with, and its special tokens for FIM and repository documents."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from composer.recipes.errors import UserError
from composer.recipes.schema import DataSection
from composer.runtime.prepared_data import TokenizerIdentity

SPECIAL_TOKENS = {
    # role: names in the tokenizers that have them (Qwen2.5-Coder style first, then StarCoder style)
    "fim_prefix": ("<|fim_prefix|>", "<fim_prefix>"),
    "fim_middle": ("<|fim_middle|>", "<fim_middle>"),
    "fim_suffix": ("<|fim_suffix|>", "<fim_suffix>"),
    "repo_name": ("<|repo_name|>", "<reponame>"),
    "file_sep": ("<|file_sep|>", "<file_sep>"),
}
"""The special tokens shaping uses; `composer model init` gives composer's own tokenizer the first name of each."""


@dataclass(frozen=True)
class CorpusTokenizer:
    """What the cache key, the shaping steps and the datasets need from the tokenizer."""

    directory: Path
    sha256: str
    """Hash of tokenizer.json: part of every cache key."""
    vocab_size: int
    eod: int
    """End-of-document id appended after every document (the tokenizer's eos_token)."""
    special: dict[str, int]
    """Ids of the SPECIAL_TOKENS roles this tokenizer has."""

    @property
    def file(self) -> Path:
        return self.directory / "tokenizer.json"

    @property
    def token_dtype(self) -> type[np.number]:
        return np.uint16 if self.vocab_size < 65500 else np.int32  # Megatron's DType.optimal_dtype rule

    @property
    def identity(self) -> TokenizerIdentity:
        return TokenizerIdentity(self.directory, self.sha256, self.vocab_size, self.eod)

    def require(self, roles: tuple[str, ...], why: str) -> None:
        missing = [SPECIAL_TOKENS[r][0] for r in roles if r not in self.special]
        if missing:
            raise UserError(
                f"{why} needs the special tokens {', '.join(missing)}, which {self.directory} lacks; "
                "`composer model init` makes a tokenizer with them"
            )


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
    special = {}
    for role, names in SPECIAL_TOKENS.items():
        ids = [tokenizer.token_to_id(name) for name in names]
        if any(i is not None for i in ids):
            special[role] = next(i for i in ids if i is not None)
    return CorpusTokenizer(directory, hashlib.sha256(raw).hexdigest(), vocab_size, eod, special)


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


def text_tokenizer(file: Path) -> Tokenizer:
    """The tokenizer for document text: special-token strings inside a document stay text (a file that contains
    "<|fim_prefix|>" must not become a FIM example); shaping inserts the special ids itself."""
    tokenizer = Tokenizer.from_file(str(file))
    tokenizer.encode_special_tokens = True
    return tokenizer
