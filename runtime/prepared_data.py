"""What `data` hands to training: where each source's Megatron indexed dataset lies and which tokenizer made it.

`composer train midtrain` prepares the corpus (package `data`) before it launches the ranks and writes this record
into the run directory; every rank reads it there (`trainer` reads datasets, it does not prepare them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from composer.recipes.errors import UserError
from composer.runtime.run_dir import atomic_write_text

FILE = "prepared-data.json"
"""Its name in the run directory."""


@dataclass(frozen=True)
class TokenizerIdentity:
    directory: Path
    sha256: str
    """Hash of tokenizer.json."""
    vocab_size: int
    eod: int
    """End-of-document id, after every document."""


@dataclass(frozen=True)
class TokenSource:
    name: str
    prefix: Path
    """Megatron path prefix: `prefix.bin` and `prefix.idx`."""
    weight: float
    num_documents: int
    num_tokens: int


@dataclass(frozen=True)
class PreparedData:
    sources: list[TokenSource]
    tokenizer: TokenizerIdentity

    def write(self, run_root: Path) -> None:
        record = {"sources": [asdict(s) for s in self.sources], "tokenizer": asdict(self.tokenizer)}
        atomic_write_text(run_root / FILE, json.dumps(record, indent=2, default=str) + "\n")

    @classmethod
    def read(cls, run_root: Path) -> PreparedData:
        try:
            record = json.loads((run_root / FILE).read_text())
        except FileNotFoundError:
            raise UserError(f"{run_root}: no {FILE}; `composer train midtrain` prepares the data before it starts the ranks") from None
        tokenizer = record["tokenizer"]
        return cls(
            [TokenSource(s["name"], Path(s["prefix"]), s["weight"], s["num_documents"], s["num_tokens"]) for s in record["sources"]],
            TokenizerIdentity(Path(tokenizer["directory"]), tokenizer["sha256"], tokenizer["vocab_size"], tokenizer["eod"]),
        )
