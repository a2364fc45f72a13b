"""Shared by the data tests: a real ByteLevel BPE tokenizer trained in a moment, and a midtrain recipe around it."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

STDLIB = Path(sysconfig.get_paths()["stdlib"])
EOS = "<|endoftext|>"
SPECIAL = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|repo_name|>", "<|file_sep|>"]


def train_tokenizer(directory: Path, vocab_size: int = 512, special: bool = True) -> Path:
    """An HF tokenizer directory (tokenizer.json + tokenizer_config.json) trained on a few stdlib files, with the
    FIM and repository tokens unless `special` is False."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, *(SPECIAL if special else [])], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([str(p) for p in sorted((STDLIB / "json").glob("*.py"))], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def write_recipe(path: Path, data: dict, vocab_size: int = 4096) -> Path:
    """A valid midtrain recipe (the shipped tiny MoE) with the given `data` section, without the shipped recipe's FIM
    unless `data` asks for it (the documents then read back as their files)."""
    shipped = Path(__file__).resolve().parents[2] / "recipes" / "smoke-midtrain.yaml"
    recipe = {
        "extends": str(shipped),
        "run": {"name": "data-test", "dir": str(path.parent / "runs")},
        "model": {"vocab_size": vocab_size},
        "data": {"fim": {"rate": 0.0}, **data},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
