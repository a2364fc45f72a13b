"""Megatron's blended GPT datasets (train/valid/test) over the sources `data` prepared (`runtime.prepared_data`)."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Dataset

from composer.recipes.errors import UserError
from composer.runtime.prepared_data import PreparedData

with warnings.catch_warnings():
    # Importing megatron.core announces that the optional Transformer Engine / Apex kernels are absent.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class _DatasetTokenizer:
    """What Megatron's GPTDataset reads from a tokenizer (no text is tokenized at training time)."""

    vocab_size: int
    eod: int
    pad: int
    unique_identifiers: OrderedDict


@dataclass(frozen=True)
class GPTDatasets:
    """Each split is a GPTDataset (one source) or a BlendedDataset over GPTDatasets; None where the split has no
    share, or on a rank where `is_built_on_rank()` is False."""

    train: Dataset | None
    valid: Dataset | None
    test: Dataset | None


def build_gpt_datasets(
    prepared: PreparedData,
    *,
    seq_length: int,
    split: tuple[float, float, float],
    seed: int,
    num_samples: tuple[int, int, int],
    index_cache_dir: Path,
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> GPTDatasets:
    """Megatron's blended GPT datasets over the prepared sources, weighted by their blend weights.

    Each sample holds `tokens` and `labels` (the next tokens) of `seq_length`, `loss_mask` and
    `position_ids` (blends add `dataset_id`); the model builds the causal mask itself (a per-sample
    [s, s] mask would cost O(s^2) memory per sample). For given sources and sizes the order depends only
    on `seed`. Under torch.distributed call it on every rank: rank 0 writes the index files under
    `index_cache_dir` while the others wait, then they read them. A blend of several sources needs the
    process group even at world size 1 (Megatron's BlendedDataset asks for the rank); one source does not.
    """
    _check_splits_have_documents(prepared, split)
    tokenizer = prepared.tokenizer
    identity = OrderedDict(kind="hf-tokenizers", tokenizer_sha256=tokenizer.sha256, eod=tokenizer.eod)
    prefixes = [str(s.prefix) for s in prepared.sources]
    # A single source needs no blending layer; Megatron then samples it directly.
    weights = [s.weight for s in prepared.sources] if len(prefixes) > 1 else None
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=",".join(str(x) for x in split),
        path_to_cache=str(index_cache_dir),
        # Prepared data is never padded, so no real id may be taken for padding (-1 matches nothing).
        tokenizer=_DatasetTokenizer(tokenizer.vocab_size, tokenizer.eod, -1, identity),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), is_built_on_rank, config).build()
    return GPTDatasets(train, valid, test)


def _check_splits_have_documents(prepared: PreparedData, split: tuple[float, float, float]) -> None:
    """Megatron splits each source by whole documents; a split with a share but no document cannot sample."""
    bookends = convert_split_vector_to_split_matrix(parse_and_normalize_split(",".join(str(x) for x in split)))
    for source in prepared.sources:
        for name, ends in zip(SPLIT_NAMES, bookends):
            if ends is None:
                continue
            begin, end = (int(round(x * source.num_documents)) for x in ends)
            if begin == end:
                raise UserError(
                    f"data.split {list(split)} leaves the {name} split of source {source.name!r} without documents "
                    f"(it has {source.num_documents}); add documents or give {name} a larger share"
                )
