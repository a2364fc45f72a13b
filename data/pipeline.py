"""The data pipeline of one source, on datatrove: stages of tasks, resumable, the same tokens for any number of
workers, run on this machine or as SLURM job arrays.

    clean              (data.tasks)  read units, redact, licence and quality filters -> clean/<rank>.jsonl.zst
    exact-signatures   (data.tasks)  content hash of every clean document                (datatrove exact dedup)
    exact-duplicates   (1)           which documents repeat an earlier one
    minhash-signatures (data.tasks)  MinHash of the exact-deduplicated documents        (datatrove MinHash dedup)
    minhash-buckets    (bands)       LSH: pairs that share a band
    minhash-clusters   (1)           union of pairs; one document kept per cluster
    shape              (data.tasks)  drop duplicates, FIM, repository documents, tokens -> shards/<rank>.bin/.idx
    publish            (1)           concatenate the shards in rank order, summary, publish the cache entry

Every stage is a datatrove pipeline run task by task by `TaskExecutor` (datatrove's logging, statistics and
`completions/` markers): a stage starts when the one before it has completed every task, a completed task is never
run again, and a task killed part way (kill -9 of its worker, or of the driver) runs again from its start and
overwrites what it had written. What a task reads and writes depends only on its rank and `data.tasks`, never on
which worker runs it, so any number of workers (or SLURM array jobs) gives the same bytes.

Locally a pool of forked workers (dying with the driver) runs the tasks; a worker that dies is replaced and its
task runs again. On SLURM (`composer data prepare --submit`) each stage is one job array over its unfinished tasks,
`--dependency=afterok` on the stage before, each array task running `python -m composer.data.pipeline WORK STAGE`;
a task that fails or is cancelled cancels the arrays after it, and submitting again reruns the unfinished tasks.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import zstandard
from datatrove.data import Document, DocumentsPipeline
from datatrove.executor.base import DistributedEnvVars, PipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.exact_dedup import (
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
)
from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.utils.hashing import HashConfig
from datatrove.utils.word_tokenizers import WordTokenizer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from composer.data.cleaning import LicenseFilter, QualityFilter, Redactor, RemovedTally, read_tallies
from composer.data.inputs import SourceReader, plan_units
from composer.data.shaping import Shaper
from composer.data.tokenizer import CorpusTokenizer
from composer.recipes.errors import UserError
from composer.recipes.schema import ClusterSection, DataSection, DataSource
from composer.runtime.processes import die_with_parent
from composer.runtime.run_dir import atomic_write_text, fsync_dir

CACHE_FORMAT = 3
"""Bump when the layout of cache entries or the preparation rules change, so old entries are not reused."""
MINHASH_HASHES = 128
"""MinHash values per document, split into bands x rows by `lsh_bands` for the stated threshold."""
MAX_WORKER_DEATHS = 3
"""Workers that may die in one prepare (each one's task runs again) before it stops and says so."""
ENTRY_PREFIX = "tokens"  # file names inside a cache entry: tokens.bin, tokens.idx
MANIFEST = "manifest.json"
TIMINGS = "timings.json"
"""Seconds each stage's steps took, summed over its tasks (beside the manifest: they differ from run to run)."""
SUBMITTED = "slurm-jobs.json"
"""In a source's work directory: the SLURM jobs of its last `--submit`."""


def lsh_bands(threshold: float) -> tuple[int, int]:
    """(bands, rows) of MINHASH_HASHES whose LSH threshold (1/bands)^(1/rows) is nearest `threshold`."""
    return min(((MINHASH_HASHES // r, r) for r in range(1, 33)), key=lambda br: abs((1 / br[0]) ** (1 / br[1]) - threshold))


def catch_probability(similarity: float, bands: int, rows: int) -> float:
    """Probability that LSH pairs two documents of this Jaccard similarity."""
    return 1 - (1 - similarity**rows) ** bands


# --- the plan of one source (written by the driver, read by every task) --------------------------


@dataclass(frozen=True)
class SourcePlan:
    data: DataSection
    index: int
    """Position of the source in data.sources."""
    units: list[str]
    tokenizer: CorpusTokenizer
    entry: Path
    """The cache entry this plan publishes."""

    @property
    def source(self) -> DataSource:
        return self.data.sources[self.index]

    @property
    def work(self) -> Path:
        return self.entry.parent / f".work-{self.entry.name}"

    @property
    def repository_documents(self) -> bool:
        return self.source.format == "repository" and self.source.repository_documents

    def save(self) -> None:
        record = {
            "data": self.data.model_dump(mode="json"),
            "index": self.index,
            "units": self.units,
            "tokenizer": {**asdict(self.tokenizer), "directory": str(self.tokenizer.directory)},
            "entry": str(self.entry),
        }
        atomic_write_text(self.work / "plan.json", json.dumps(record) + "\n")

    @classmethod
    def load(cls, work: Path) -> SourcePlan:
        record = json.loads((work / "plan.json").read_text())
        tokenizer = record["tokenizer"]
        return cls(
            DataSection.model_validate(record["data"]),
            record["index"],
            record["units"],
            CorpusTokenizer(**{**tokenizer, "directory": Path(tokenizer["directory"])}),
            Path(record["entry"]),
        )


def plan_source(data: DataSection, index: int, tokenizer: CorpusTokenizer) -> SourcePlan:
    """The source's units and its cache entry, named by a hash of everything its tokens depend on (inputs by stat
    data, not content: a cache hit must not read a corpus of terabytes again; any write changes an mtime)."""
    source = data.sources[index]
    units = plan_units(source, index)
    described = {
        "cache_format": CACHE_FORMAT,
        "datatrove": version("datatrove"),
        "source": source.model_dump(exclude={"weight", "name"}),
        "files": data.files.model_dump(),
        "cleaning": data.cleaning.model_dump(),
        "fim": data.fim.model_dump(),
        "tasks": data.tasks,
        "tokenizer_sha256": tokenizer.sha256,
        "eod": tokenizer.eod,
        "units": [[u.path, u.fingerprint] for u in units],
    }
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    entry = Path(data.cache_dir).expanduser().absolute() / f"{source.name}-{key[:20]}"
    return SourcePlan(data, index, [u.path for u in units], tokenizer, entry)


# --- stages ------------------------------------------------------------------------------------


def document_text(document: Document) -> str:
    return document.text


class CodeWords(WordTokenizer):
    """Words for MinHash shingles of code: whitespace-separated runs after datatrove's text normalisation
    (lower case, punctuation removed), so identifiers and keywords are the words."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [text]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]


class CleanWriter(PipelineStep):
    """Writes this task's clean documents to `folder/<rank>.jsonl.zst` (all at the end, atomically)."""

    type = "💽 - WRITER"
    name = "composer clean shard"

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        temp = self.folder / f".{rank:05d}.tmp"
        with open(temp, "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as out:
            for document in data:
                out.write(json.dumps({"text": document.text, "id": document.id, "metadata": document.metadata}).encode() + b"\n")
                self.stat_update("documents_clean")
        os.replace(temp, self.folder / f"{rank:05d}.jsonl.zst")


class CleanReader(PipelineStep):
    """Reads this task's clean documents back, in the order they were written."""

    type = "📖 - READER"
    name = "composer clean shard reader"

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with open(self.folder / f"{rank:05d}.jsonl.zst", "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as stream:
            for line in io.TextIOWrapper(stream, encoding="utf-8"):
                yield Document(**json.loads(line))


class Publish(PipelineStep):
    """Concatenates the shape stage's shards in rank order into the source's indexed dataset, writes the summary
    and the redaction report, and renames the finished entry into place (all or nothing)."""

    type = "💽 - WRITER"
    name = "composer publish"

    def __init__(self, plan: SourcePlan):
        super().__init__()
        self.plan = plan

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
            from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
        plan, work = self.plan, self.plan.work
        temp = plan.entry.parent / f".tmp-{plan.entry.name}"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        builder = IndexedDatasetBuilder(str(temp / f"{ENTRY_PREFIX}.bin"), dtype=plan.tokenizer.token_dtype)
        for shard in range(plan.data.tasks):
            # document by document: the builder's add_index runs a full gc.collect() per shard (seconds each,
            # with torch loaded), which thousands of shards cannot afford
            if (work / "shards" / f"{shard:05d}.bin").stat().st_size == 0:
                continue  # a task whose documents were all removed (Megatron cannot map an empty file)
            dataset = IndexedDataset(str(work / "shards" / f"{shard:05d}"))
            for i in range(len(dataset)):
                builder.add_document(dataset[i], [int(dataset.sequence_lengths[i])])
            del dataset
        builder.finalize(str(temp / f"{ENTRY_PREFIX}.idx"))
        summary = summarise(plan)
        if summary["documents"] == 0:
            shutil.rmtree(temp)
            raise UserError(
                f"data.sources[{plan.index}] ({plan.source.name}): its {len(plan.units)} input(s) hold no text; "
                "the corpus would be empty (see `data.files` and `data.cleaning` for what was left out)"
            )
        with open(temp / "redactions.jsonl", "wb") as report:
            for part in sorted((work / "redactions").glob("*.jsonl")):
                report.write(part.read_bytes())
        for name in (f"{ENTRY_PREFIX}.bin", f"{ENTRY_PREFIX}.idx", "redactions.jsonl"):
            with open(temp / name, "rb") as f:
                os.fsync(f.fileno())
        seconds = {stage.name: round(stage_seconds(work, stage.name), 3) for stage in stages(plan) if stage.name != "publish"}
        atomic_write_text(temp / TIMINGS, json.dumps(seconds, indent=2) + "\n")
        manifest = {  # the same bytes wherever and however often the tasks ran (timings are apart, in TIMINGS)
            "name": plan.source.name,
            "format": plan.source.format,
            "tokenizer": str(plan.tokenizer.directory),
            "tokenizer_sha256": plan.tokenizer.sha256,
            "num_inputs": len(plan.units),
            "summary": summary,
        }
        atomic_write_text(temp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        try:
            temp.rename(plan.entry)
        except OSError:
            if not (plan.entry / MANIFEST).is_file():
                raise
            shutil.rmtree(temp)  # another prepare of the same corpus finished first; its entry is identical
        fsync_dir(plan.entry.parent)


@dataclass(frozen=True)
class Stage:
    name: str
    tasks: int
    build: Callable[[], list[PipelineStep]]
    """A fresh pipeline for one task (steps keep per-task statistics)."""


def stages(plan: SourcePlan) -> list[Stage]:
    data, work, tokenizer = plan.data, plan.work, plan.tokenizer
    folder = lambda name: str(work / name)  # datatrove takes folders as strings
    cleaning, n = data.cleaning, data.tasks
    removed = work / "removed"
    hashing = HashConfig(precision=64, hash_fc="sha1")
    exact = ExactDedupConfig(content_getter=document_text, hash_config=hashing)
    bands, rows = lsh_bands(cleaning.near_threshold)
    minhash = MinhashConfig(n_grams=cleaning.ngram_size, num_buckets=bands, hashes_per_bucket=rows, seed=1, hash_config=hashing)
    clean = work / "clean"

    def tally(step: str) -> RemovedTally:
        return RemovedTally(removed, step, tokenizer.file)

    def cleaned() -> list[PipelineStep]:
        steps: list[PipelineStep] = [SourceReader(plan.source, plan.units, data.files)]
        if cleaning.redact_secrets or cleaning.redact_pii:
            steps.append(Redactor(cleaning, work / "redactions"))
        if plan.source.format == "repository" and cleaning.licenses is not None:
            steps.append(LicenseFilter(cleaning.licenses, tally("licence")))
        return [*steps, QualityFilter(cleaning, tally("quality")), CleanWriter(clean)]

    def exact_filter(counted: bool) -> list[PipelineStep]:
        if not cleaning.exact_dedup:
            return []
        return [ExactDedupFilter(folder("exact-duplicates"), exact, exclusion_writer=tally("exact duplicates") if counted else None)]

    def shaped() -> list[PipelineStep]:
        near = [MinhashDedupFilter(folder("minhash-remove"), exclusion_writer=tally("near duplicates"))] if cleaning.near_dedup else []
        return [
            CleanReader(clean),
            *exact_filter(counted=True),
            *near,
            Shaper(tokenizer, data.fim, plan.repository_documents, work / "shards"),
        ]

    out = [Stage("clean", n, cleaned)]
    if cleaning.exact_dedup:
        out += [
            Stage("exact-signatures", n, lambda: [CleanReader(clean), ExactDedupSignature(folder("exact-signatures"), exact)]),
            Stage("exact-duplicates", 1, lambda: [ExactFindDedups(folder("exact-signatures"), folder("exact-duplicates"), exact)]),
        ]
    if cleaning.near_dedup:
        out += [
            Stage(
                "minhash-signatures",
                n,
                lambda: [
                    CleanReader(clean),
                    *exact_filter(counted=False),
                    MinhashDedupSignature(folder("minhash-signatures"), minhash, language=CodeWords()),
                ],
            ),
            Stage(
                "minhash-buckets",
                bands,
                lambda: [MinhashDedupBuckets(folder("minhash-signatures"), folder("minhash-buckets"), config=minhash)],
            ),
            Stage(
                "minhash-clusters",
                1,
                lambda: [MinhashDedupCluster(folder("minhash-buckets"), folder("minhash-remove"), config=minhash, save_cluster_id=True)],
            ),
        ]
    return [*out, Stage("shape", n, shaped), Stage("publish", 1, lambda: [Publish(plan)])]


class TaskExecutor(PipelineExecutor):
    """Runs tasks of one stage in this process, through datatrove's task runner: its per-task logs and statistics
    in the stage's folder, and a `completions/<rank>` marker once a task has finished."""

    def __init__(self, stage: Stage, folder: Path):
        super().__init__([], logging_dir=str(folder), skip_completed=True)
        self.stage, self.tasks = stage, stage.tasks

    def run(self) -> None:
        for rank in self.get_incomplete_ranks():
            self.run_task(rank)

    def run_task(self, rank: int) -> None:
        self.pipeline = self.stage.build()
        self._run_for_rank(rank)

    @property
    def world_size(self) -> int:
        return self.tasks

    def get_distributed_env(self, node_rank: int = -1) -> DistributedEnvVars:
        return DistributedEnvVars(
            datatrove_node_ips="localhost",
            datatrove_cpus_per_task="1",
            datatrove_mem_per_cpu="-1",
            datatrove_gpus_on_node="0",
            datatrove_executor="LOCAL",
        )


def executor(plan: SourcePlan, stage: Stage) -> TaskExecutor:
    return TaskExecutor(stage, plan.work / stage.name)


def pending_tasks(plan: SourcePlan, stage: Stage) -> list[int]:
    completed = plan.work / stage.name / "completions"
    return [rank for rank in range(stage.tasks) if not (completed / f"{rank:05d}").exists()]


def run_task(work: Path, stage_name: str, rank: int) -> None:
    """One task of one stage (in a pool worker, or a SLURM array task)."""
    plan = SourcePlan.load(work)
    stage = next(s for s in stages(plan) if s.name == stage_name)
    executor(plan, stage).run_task(rank)


# --- statistics --------------------------------------------------------------------------------


def stage_counters(work: Path, stage: str) -> dict[str, float]:
    """Every counter of a stage's steps, summed over its tasks (datatrove's stats/<rank>.json: a list of steps,
    each with `stats` of label -> a number, or a dict whose `total` is the sum)."""
    out: dict[str, float] = {}
    for file in sorted((work / stage / "stats").glob("*.json")):
        for step in json.loads(file.read_text()):
            for label, value in step["stats"].items():
                out[label] = out.get(label, 0) + (value["total"] if isinstance(value, dict) else value)
    return out


def stage_seconds(work: Path, stage: str) -> float:
    """Time the stage's steps took, summed over its tasks (datatrove's per-step timers; a step's time includes
    pulling documents through the steps before it only where it times its whole run)."""
    total = 0.0
    for file in sorted((work / stage / "stats").glob("*.json")):
        for step in json.loads(file.read_text()):
            timer = step["time_stats"]
            total += timer["total"] if isinstance(timer, dict) else timer
    return total


def summarise(plan: SourcePlan) -> dict:
    """What each step did to the source: read, left out, redacted, removed (documents and tokens), kept."""
    work = plan.work
    read, shaped = stage_counters(work, "clean"), stage_counters(work, "shape")
    bands, rows = lsh_bands(plan.data.cleaning.near_threshold)
    clusters = stage_counters(work, "minhash-clusters") if plan.data.cleaning.near_dedup else {}
    removed = read_tallies(work / "removed")
    languages = {
        label.removeprefix("language_tokens_"): {
            "files": int(shaped.get("language_" + label.removeprefix("language_tokens_"), 0)),
            "tokens": int(v),
        }
        for label, v in shaped.items()
        if label.startswith("language_tokens_")
    }
    return {
        "inputs": len(plan.units),
        "read_documents": int(read.get("documents_read", 0)),
        "left_out": {label.removeprefix("skipped_"): int(v) for label, v in read.items() if label.startswith("skipped_")},
        "not_utf8": int(read.get("not_utf8", 0)),
        "redactions": {label.removeprefix("redacted_"): int(v) for label, v in read.items() if label.startswith("redacted_")},
        "removed": {
            step: {"documents": r["documents"], "tokens": r["tokens"], "reasons": dict(r["reasons"])} for step, r in removed.items()
        },
        "near_dedup": {
            "threshold": plan.data.cleaning.near_threshold,
            "bands": bands,
            "rows": rows,
            "catch_probability": {
                str(s): round(catch_probability(s, bands, rows), 4) for s in (0.5, plan.data.cleaning.near_threshold, 0.8, 0.9)
            },
            "clusters": int(clusters.get("clusters", 0)),
        }
        if plan.data.cleaning.near_dedup
        else None,
        "languages": languages,
        "fim": {
            "psm": int(shaped.get("fim_psm", 0)),
            "spm": int(shaped.get("fim_spm", 0)),
            "files": sum(v["files"] for v in languages.values()),
        },
        "repository_documents": int(shaped.get("repository_documents", 0)),
        "repository_files": int(shaped.get("repository_files", 0)),
        "documents": int(shaped.get("documents_out", 0)),
        "tokens": int(shaped.get("tokens_out", 0)),
    }


# --- running it: this machine ---------------------------------------------------------------------


def _init_worker(log: str) -> None:
    die_with_parent()  # a killed driver takes its workers with it: no orphan writes into a rerun's files
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled once, by the driver
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # datatrove's task logs and any traceback go to the log, not the terminal
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)  # datatrove's logger writes to sys.stderr


class WorkerPool:
    """Forked workers for tasks; one that dies (kill -9, out of memory) is replaced and its task runs again."""

    def __init__(self, num_workers: int, log: Path):
        self.num_workers, self.log, self.deaths = num_workers, log, 0
        self.pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self.pool is None:
            import multiprocessing

            self.log.parent.mkdir(parents=True, exist_ok=True)
            self.pool = ProcessPoolExecutor(
                self.num_workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_worker, initargs=(str(self.log),)
            )
        return self.pool

    def run(self, work: Path, stage: str, ranks: list[int], on_done: Callable[[], None]) -> None:
        remaining = list(ranks)
        while remaining:
            futures = {self._executor().submit(run_task, work, stage, rank): rank for rank in remaining}
            try:
                while futures:
                    done, _ = wait(futures, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
                        remaining.remove(futures.pop(future))
                        on_done()
            except BrokenProcessPool:
                self.pool.shutdown(wait=True, cancel_futures=True)
                self.pool = None
                self.deaths += 1
                if self.deaths > MAX_WORKER_DEATHS:
                    raise UserError(
                        f"data workers died {self.deaths} times (killed, or out of memory?); see {self.log}. "
                        "Run the command again to go on from the finished tasks"
                    ) from None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def run_locally(plan: SourcePlan, pool: WorkerPool, progress: Progress) -> None:
    for stage in stages(plan):
        ranks = pending_tasks(plan, stage)
        task = progress.add_task(f"{plan.source.name}: {stage.name}", total=stage.tasks, completed=stage.tasks - len(ranks))
        if ranks:
            pool.run(plan.work, stage.name, ranks, lambda: progress.advance(task))


class WorkLock:
    """One prepare at a time per source work directory (a second one would write the same task files)."""

    def __init__(self, work: Path):
        work.mkdir(parents=True, exist_ok=True)
        self.file = open(work / "lock", "w")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise UserError(f"another `data prepare` is preparing {work} right now; wait for it to finish") from None

    def release(self) -> None:
        self.file.close()


def prepare_locally(plans: list[SourcePlan], num_workers: int, console: Console | None) -> None:
    with warnings.catch_warnings():
        # Imported before the workers fork, so each has it loaded (an import takes seconds).
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        import megatron.core.datasets.indexed_dataset  # noqa: F401
    refuse_while_submitted(plans)
    locks = [WorkLock(plan.work) for plan in plans]
    pool = WorkerPool(num_workers, plans[0].entry.parent / ".logs" / "workers.log")
    try:
        with _progress(console) as progress:
            for plan in plans:
                plan.save()
                run_locally(plan, pool, progress)
    finally:
        pool.close()
        for lock in locks:
            lock.release()
    for plan in plans:
        shutil.rmtree(plan.work, ignore_errors=True)


def _progress(console: Console | None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TextColumn("tasks"),
        TimeElapsedColumn(),
        console=console,
        disable=console is None,
    )


# --- running it: SLURM job arrays ------------------------------------------------------------------


def slurm_logs(plan: SourcePlan) -> Path:
    """Where the array tasks of a source write their output (outside its work directory, which publish removes)."""
    return plan.entry.parent / ".logs" / "slurm" / plan.entry.name


def submitted_jobs_alive(plan: SourcePlan) -> list[str]:
    """The jobs of this source's last `--submit` still queued or running (none when it was never submitted, or where
    SLURM's `squeue` is not on PATH)."""
    record = plan.work / SUBMITTED
    squeue = shutil.which("squeue")
    if squeue is None or not record.is_file():
        return []
    submitted = json.loads(record.read_text())
    result = subprocess.run([squeue, "-h", "-o", "%F"], capture_output=True, text=True)  # %F: an array task's array job
    if result.returncode != 0:
        raise UserError(f"squeue failed: {(result.stderr or result.stdout).strip()}")
    queued = set(result.stdout.split())
    return [job for job in submitted if job in queued]


def refuse_while_submitted(plans: list[SourcePlan]) -> None:
    """Two runs of the same tasks would write the same files: wait for (or cancel) a submission's jobs first."""
    for plan in plans:
        if alive := submitted_jobs_alive(plan):
            raise UserError(
                f"data.sources[{plan.index}] ({plan.source.name}): SLURM jobs {', '.join(alive)} of its last --submit are still "
                "queued or running; wait for them (or scancel them), then run this again to go on from the finished tasks"
            )


def submit_to_slurm(plans: list[SourcePlan], cluster: ClusterSection) -> list[tuple[str, str, str]]:
    """One job array per stage with unfinished tasks, each after the one before; returns (source, stage, job id).
    A task that fails or is cancelled cancels the arrays after it (`--kill-on-invalid-dep`); submitting again, once
    the arrays have left the queue, reruns only the unfinished tasks."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError("--submit: `sbatch` is not on PATH; run it on a SLURM login node")
    refuse_while_submitted(plans)
    python = cluster.python or sys.executable
    workdir = cluster.workdir or os.getcwd()
    submitted = []
    for plan in plans:
        plan.save()
        slurm_logs(plan).mkdir(parents=True, exist_ok=True)
        previous, jobs = None, []
        for stage in stages(plan):
            ranks = pending_tasks(plan, stage)
            if not ranks:
                continue
            argv = [
                sbatch,
                "--parsable",
                f"--job-name=composer-data-{plan.source.name}-{stage.name}",
                f"--array={','.join(map(str, ranks))}%{plan.data.num_workers}",
                "--ntasks=1",
                "--cpus-per-task=1",
                f"--output={slurm_logs(plan) / f'{stage.name}-%A_%a.out'}",
                f"--chdir={workdir}",
                "--kill-on-invalid-dep=yes",  # a failed task cancels the stages after it instead of leaving them queued
            ]
            for flag, value in (
                ("partition", cluster.slurm.partition),
                ("account", cluster.slurm.account),
                ("time", cluster.slurm.time_limit),
            ):
                if value:
                    argv.append(f"--{flag}={value}")
            if previous:
                argv.append(f"--dependency=afterok:{previous}")
            argv.append("--wrap=" + " ".join(["exec", python, "-m", "composer.data.pipeline", str(plan.work), stage.name]))
            result = subprocess.run(argv, capture_output=True, text=True)
            if result.returncode != 0:
                raise UserError(f"sbatch for {plan.source.name} {stage.name} failed: {(result.stderr or result.stdout).strip()}")
            previous = result.stdout.strip().split(";")[0]
            jobs.append(previous)
            atomic_write_text(plan.work / SUBMITTED, json.dumps(jobs) + "\n")  # each at once: a later sbatch may fail
            submitted.append((plan.source.name, stage.name, previous))
    return submitted


def main(argv: list[str]) -> int:
    """`python -m composer.data.pipeline WORK STAGE [RANK]`: one task (RANK, else SLURM_ARRAY_TASK_ID). The publish
    task removes the work directory once the entry is in place, as a local prepare does."""
    work, stage = Path(argv[0]), argv[1]
    rank = int(argv[2]) if len(argv) > 2 else int(os.environ["SLURM_ARRAY_TASK_ID"])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        run_task(work, stage, rank)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if stage == "publish":
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
