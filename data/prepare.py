"""`data prepare`: every source of a recipe's `data` section through the pipeline (`data.pipeline`) into a cached
Megatron indexed dataset, and what training reads of them (`runtime.prepared_data.PreparedData`).

A source's cache entry is named by a hash of everything its tokens depend on (inputs by stat data, settings,
`data.tasks`, tokenizer); its blend weight is not among them, so a stage with another mixture reuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from composer.data.pipeline import (
    ENTRY_PREFIX,
    MANIFEST,
    SUBMITTED,
    SourcePlan,
    plan_source,
    prepare_locally,
    slurm_logs,
    submit_to_slurm,
    submitted_jobs_alive,
)
from composer.data.tokenizer import CorpusTokenizer, load_tokenizer
from composer.recipes.errors import UserError
from composer.recipes.schema import ClusterSection, DataSection
from composer.runtime.prepared_data import PreparedData, TokenSource


@dataclass(frozen=True)
class PreparedSource:
    name: str
    prefix: Path
    """Megatron path prefix: `prefix.bin` and `prefix.idx`."""
    weight: float
    summary: dict
    """What each step did (see `data.pipeline.summarise`)."""
    cached: bool
    """Found in the cache: nothing was prepared."""

    @property
    def num_documents(self) -> int:
        return self.summary["documents"]

    @property
    def num_tokens(self) -> int:
        return self.summary["tokens"]


@dataclass(frozen=True)
class PreparedCorpus:
    sources: list[PreparedSource]
    tokenizer: CorpusTokenizer

    @property
    def all_cached(self) -> bool:
        return all(s.cached for s in self.sources)

    def for_training(self) -> PreparedData:
        return PreparedData(
            [TokenSource(s.name, s.prefix, s.weight, s.num_documents, s.num_tokens) for s in self.sources], self.tokenizer.identity
        )


def _plans(data: DataSection, model_checkpoint: str | None, model_vocab_size: int) -> tuple[CorpusTokenizer, list[SourcePlan]]:
    tokenizer = load_tokenizer(data, model_checkpoint, model_vocab_size)
    if data.fim.rate > 0:
        tokenizer.require(("fim_prefix", "fim_middle", "fim_suffix"), f"data.fim.rate={data.fim.rate}")
    for index, source in enumerate(data.sources):
        if source.format == "repository" and source.repository_documents:
            tokenizer.require(("repo_name", "file_sep"), f"data.sources[{index}] ({source.name}): repository documents")
    return tokenizer, [plan_source(data, index, tokenizer) for index in range(len(data.sources))]


def _cached(plan: SourcePlan, cached: bool) -> PreparedSource | None:
    try:
        manifest = json.loads((plan.entry / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    return PreparedSource(plan.source.name, plan.entry / ENTRY_PREFIX, plan.source.weight, manifest["summary"], cached)


def prepare_data(
    data: DataSection, *, model_checkpoint: str | None, model_vocab_size: int, console: Console | None = None
) -> PreparedCorpus:
    """Prepare every source not yet in the cache on this machine (`data.num_workers` processes); progress on
    `console` when given."""
    tokenizer, plans = _plans(data, model_checkpoint, model_vocab_size)
    hits = [_cached(plan, cached=True) for plan in plans]
    missing = [plan for plan, hit in zip(plans, hits) if hit is None]
    if missing:
        prepare_locally(missing, data.num_workers, console)
    return PreparedCorpus([hit or _cached(plan, cached=False) for plan, hit in zip(plans, hits)], tokenizer)


def submit_data(
    data: DataSection, cluster: ClusterSection, *, model_checkpoint: str | None, model_vocab_size: int
) -> list[tuple[str, str, str]]:
    """Submit the sources not yet in the cache as SLURM job arrays; (source, stage, job id) of each array."""
    _, plans = _plans(data, model_checkpoint, model_vocab_size)
    return submit_to_slurm([plan for plan in plans if _cached(plan, cached=True) is None], cluster)


def prepared_sources(data: DataSection, *, model_checkpoint: str | None, model_vocab_size: int) -> PreparedCorpus:
    """The sources as prepared; an error naming the first one not prepared yet."""
    tokenizer, plans = _plans(data, model_checkpoint, model_vocab_size)
    found = []
    for plan in plans:
        hit = _cached(plan, cached=True)
        if hit is None:
            raise UserError(f"data.sources[{plan.index}] ({plan.source.name}) {_why_not_prepared(plan)}")
        found.append(hit)
    return PreparedCorpus(found, tokenizer)


def _why_not_prepared(plan: SourcePlan) -> str:
    if not (plan.work / SUBMITTED).is_file():
        return "is not prepared with these settings yet; run `composer data prepare`"
    if alive := submitted_jobs_alive(plan):
        return f"is not prepared yet: its SLURM jobs {', '.join(alive)} have not finished"
    return (
        f"is not prepared: its SLURM jobs ended before the last stage (a task failed or was cancelled; their output: "
        f"{slurm_logs(plan)}); run `composer data prepare --submit` again to rerun the unfinished tasks"
    )
