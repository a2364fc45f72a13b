"""Blended Megatron GPT datasets over prepared sources: real GPTDataset/BlendedDataset on a 1-process gloo group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core.datasets.indexed_dataset import IndexedDataset

from composer.data.prepare import prepare_data
from composer.recipes.errors import UserError
from composer.recipes.schema import DataSection
from composer.runtime.prepared_data import PreparedData
from composer.trainer.datasets import build_gpt_datasets
from tests.helpers.data_helpers import train_tokenizer, write_jsonl

SEQ = 32


@pytest.fixture
def process_group(tmp_path):
    # Megatron's BlendedDataset asks for the rank when it writes its index cache, so blending needs a group.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> PreparedData:
    root = tmp_path_factory.mktemp("data")
    snippets = write_jsonl(root / "snippets.jsonl", [{"text": f"value_{i} = {i} * {i}\n"} for i in range(40)])
    data = DataSection(
        tokenizer=str(train_tokenizer(root / "tokenizer")),
        cache_dir=str(root / "cache"),
        seq_length=SEQ,
        cleaning={"exact_dedup": False, "near_dedup": False, "drop_generated": False},
        sources=[
            {"name": "json-lib", "paths": ["{stdlib}/json/*.py"], "weight": 3},
            {"name": "snippets", "paths": [str(snippets)], "format": "jsonl", "weight": 1},
        ],
    )
    return prepare_data(data, model_checkpoint=None, model_vocab_size=4096).for_training()


def build(prepared: PreparedData, index_cache_dir: Path, seed: int = 7, split=(80.0, 20.0, 0.0)):
    return build_gpt_datasets(prepared, seq_length=SEQ, split=split, seed=seed, num_samples=(64, 16, 0), index_cache_dir=index_cache_dir)


def documents(dataset: IndexedDataset) -> np.ndarray:
    return np.concatenate([dataset[i] for i in range(len(dataset))])


def samples(dataset, count: int) -> list[dict]:
    return [dataset[i] for i in range(count)]


def test_samples_are_windows_of_the_corpus_with_labels_shifted_by_one(prepared, process_group, tmp_path):
    datasets = build(prepared, tmp_path / "indices")
    assert datasets.test is None
    assert len(datasets.train) >= 64 and len(datasets.valid) >= 16
    streams = [",".join(map(str, documents(IndexedDataset(str(s.prefix))).tolist())) for s in prepared.sources]
    eod = prepared.tokenizer.eod
    for sample in samples(datasets.train, 64) + samples(datasets.valid, 16):
        assert {k: tuple(sample[k].shape) for k in ("tokens", "labels", "loss_mask", "position_ids")} == {
            k: (SEQ,) for k in ("tokens", "labels", "loss_mask", "position_ids")
        }
        assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert torch.equal(sample["position_ids"], torch.arange(SEQ))
        assert bool(sample["loss_mask"].all())
        # A window of its source's stream of shuffled documents: every piece between EODs is a run of that source.
        window = torch.cat([sample["tokens"], sample["labels"][-1:]]).tolist()
        for piece in ",".join(map(str, window)).split(f",{eod},"):
            assert piece in streams[int(sample["dataset_id"])]
    assert any(eod in s["tokens"].tolist() for s in samples(datasets.train, 64))


def test_sources_are_drawn_in_proportion_to_their_weights(prepared, process_group, tmp_path):
    train = build(prepared, tmp_path / "indices").train
    drawn = np.bincount(np.asarray(train.dataset_index[:64]), minlength=2)
    assert abs(drawn[0] - 48) <= 1 and abs(drawn[1] - 16) <= 1  # weights 3:1


def test_order_depends_only_on_the_seed(prepared, process_group, tmp_path):
    first = build(prepared, tmp_path / "a").train
    rebuilt = build(prepared, tmp_path / "b").train  # a fresh index cache: the order is recomputed, not reloaded
    reseeded = build(prepared, tmp_path / "c", seed=8).train
    tokens = lambda dataset: torch.stack([s["tokens"] for s in samples(dataset, 32)])
    assert torch.equal(tokens(first), tokens(rebuilt))
    assert not torch.equal(tokens(first), tokens(reseeded))


def test_a_single_source_builds_without_a_process_group(prepared, tmp_path):
    assert not dist.is_initialized()
    single = PreparedData(prepared.sources[:1], prepared.tokenizer)
    datasets = build(single, tmp_path / "indices")
    assert tuple(datasets.train[0]["tokens"].shape) == (SEQ,)


def test_a_split_without_documents_is_a_user_error(prepared, tmp_path):
    with pytest.raises(UserError, match=r"leaves the valid split of source 'json-lib' without documents \(it has 5\)"):
        build(prepared, tmp_path / "indices", split=(99.0, 1.0, 0.0))
