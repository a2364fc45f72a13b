"""What SFT preparation (`rl.sft_data`) hands to training: conversations as token ids with a loss mask, train and
held-out, in the run directory (`sft-examples/`). `trainer` reads them; it does not render conversations.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from composer.recipes.errors import UserError
from composer.runtime.run_dir import publish_dir

DIR = "sft-examples"
"""Its name in the run directory."""


@dataclass(frozen=True)
class TokenizedConversations:
    """Conversations of one split, concatenated: `tokens` int32, `loss_mask` bool (the assistant's tokens),
    `offsets` int64 [n+1] (conversation i is tokens[offsets[i]:offsets[i+1]])."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, conversations: list[tuple[list[int], list[bool]]]) -> TokenizedConversations:
        lengths = [len(t) for t, _ in conversations]
        tokens = np.fromiter((x for t, _ in conversations for x in t), dtype=np.int32, count=sum(lengths))
        mask = np.fromiter((x for _, m in conversations for x in m), dtype=bool, count=sum(lengths))
        return cls(tokens, mask, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.loss_mask[a:b]


@dataclass(frozen=True)
class SftExamples:
    train: TokenizedConversations
    valid: TokenizedConversations
    pad: int
    """Padding id after each conversation (never trained on)."""
    tokenizer_dir: str
    summary: dict
    """Counts of the preparation (per source, cut, dropped), for the report."""

    def write(self, run_root: Path) -> None:
        """Atomically: a run directory holds the whole set or none."""
        final = run_root / DIR
        staged = run_root / f".{DIR}.tmp"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        for name, split in (("train", self.train), ("valid", self.valid)):
            np.save(staged / f"{name}-tokens.npy", split.tokens)
            np.save(staged / f"{name}-mask.npy", split.loss_mask)
            np.save(staged / f"{name}-offsets.npy", split.offsets)
        record = {"pad": self.pad, "tokenizer_dir": self.tokenizer_dir, "summary": self.summary}
        (staged / "examples.json").write_text(json.dumps(record, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        publish_dir(staged, final)

    @classmethod
    def read(cls, run_root: Path) -> SftExamples:
        root = run_root / DIR
        try:
            record = json.loads((root / "examples.json").read_text())
        except FileNotFoundError:
            raise UserError(f"{run_root}: no {DIR}/; `composer train sft` prepares the conversations before it starts the ranks") from None

        def split(name: str) -> TokenizedConversations:
            return TokenizedConversations(*(np.load(root / f"{name}-{part}.npy") for part in ("tokens", "mask", "offsets")))

        return cls(split("train"), split("valid"), record["pad"], record["tokenizer_dir"], record["summary"])

    @staticmethod
    def exists(run_root: Path) -> bool:
        return (run_root / DIR / "examples.json").is_file()
