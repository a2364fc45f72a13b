"""Tokens/s per core of `data prepare`'s full pipeline against the tokenize-only path, the cost of each stage, and
1 -> 2 workers, in one run on the same corpus (by default the Python standard library).

  tokenize-only: every cleaning step off and no FIM (read -> tokenize -> Megatron dataset: what `data prepare`
                 did before the pipeline), 1 worker
  full pipeline: redaction, licence and quality filters, exact + MinHash dedup, FIM at 0.5, tokenize; 1 worker, then
                 2 workers (their outputs must be byte-identical)

Tokens/s per core divides by the CPU seconds the prepare and its workers used, so a machine shared with other jobs
still gives comparable figures; the wall-clock ratio of 1 -> 2 workers is bounded by the cores actually obtained
(CPU / wall, printed). Stage costs are datatrove's per-step timers summed over tasks.

    PYTHONPATH=. python benchmarks/data_prepare_bench.py [--paths GLOB ...] [--tasks N] [--vocab-size V]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from composer.data.inputs import plan_units  # noqa: E402
from composer.data.pipeline import TIMINGS  # noqa: E402
from composer.data.prepare import prepare_data  # noqa: E402
from composer.recipes.schema import DataSection  # noqa: E402

EOS = "<|endoftext|>"
SPECIAL = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|repo_name|>", "<|file_sep|>"]
OFF = {
    "redact_secrets": False,
    "redact_pii": False,
    "exact_dedup": False,
    "near_dedup": False,
    "licenses": None,
    "max_line_length": 10**9,
    "max_mean_line_length": 10**9,
    "min_alphanumeric_fraction": 0,
    "drop_generated": False,
}


def train_tokenizer(directory: Path, files: list[str], vocab_size: int) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, *SPECIAL], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator((Path(f).read_bytes().decode("utf-8", errors="replace") for f in files), trainer)
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(f'{{"eos_token": "{EOS}"}}')
    return directory


def cpu_seconds() -> float:
    return sum(
        resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )


def timed_prepare(data: DataSection, vocab_size: int):
    started, cpu = time.perf_counter(), cpu_seconds()
    prepared = prepare_data(data, model_checkpoint=None, model_vocab_size=vocab_size)
    return prepared.sources[0], time.perf_counter() - started, cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", nargs="+", default=["{stdlib}/**/*.py"], help="input globs (default: the standard library)")
    parser.add_argument("--tasks", type=int, default=8, help="data.tasks")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def section(name: str, workers: int, full: bool) -> DataSection:
            return DataSection(
                sources=[{"name": "corpus", "paths": args.paths}],
                seq_length=256,
                cache_dir=str(root / name),
                tokenizer=str(root / "tokenizer"),
                tasks=args.tasks,
                num_workers=workers,
                cleaning={} if full else OFF,
                fim={"rate": 0.5 if full else 0.0},
            )

        files = [u.path for u in plan_units(section("x", 1, False).sources[0], 0)]
        train_tokenizer(root / "tokenizer", files[::4], args.vocab_size)
        print(
            f"corpus: {len(files)} files, {sum(os.path.getsize(f) for f in files) / 1e6:.1f} MB; tasks {args.tasks}; "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        )
        import megatron.core.datasets.indexed_dataset  # noqa: F401  (imported once, before any timing)

        base, base_s, base_cpu = timed_prepare(section("tokenize-only", 1, False), args.vocab_size)
        full, full_s, full_cpu = timed_prepare(section("full-1", 1, True), args.vocab_size)
        full2, full2_s, full2_cpu = timed_prepare(section("full-2", 2, True), args.vocab_size)
        same = all(full.prefix.with_suffix(s).read_bytes() == full2.prefix.with_suffix(s).read_bytes() for s in (".bin", ".idx"))

    def line(name: str, source, wall: float, cpu: float) -> None:
        print(
            f"{name:<28}: {source.num_tokens / cpu / 1e3:8.1f} k tokens/s per core   {source.num_tokens / wall / 1e3:8.1f} k tokens/s   "
            f"({source.num_tokens:,} tokens, {wall:.1f} s wall, {cpu:.1f} s CPU = {cpu / wall:.2f} cores)"
        )

    line("tokenize-only, 1 worker", base, base_s, base_cpu)
    line("full pipeline, 1 worker", full, full_s, full_cpu)
    line("full pipeline, 2 workers", full2, full2_s, full2_cpu)
    print(
        f"full / tokenize-only per core : {full.num_tokens / full_cpu / (base.num_tokens / base_cpu):.2f}x "
        f"(the full pipeline keeps {full.num_tokens / base.num_tokens:.1%} of the tokens)"
    )
    print(f"1 -> 2 workers (wall)         : {full_s / full2_s:.2f}x; outputs byte-identical: {same}")
    summary = full.summary
    removed = ", ".join(f"{step} {r['documents']} docs / {r['tokens']:,} tokens" for step, r in summary["removed"].items())
    print(f"removed: {removed or 'nothing'}; redactions: {summary['redactions']}")
    stage_seconds = json.loads((full.prefix.parent / TIMINGS).read_text())
    total = sum(stage_seconds.values())
    print("stage cost (full, 1 worker; step timers summed over tasks):")
    for stage, seconds in stage_seconds.items():
        print(f"  {stage:<20} {seconds:7.2f} s  {seconds / total:6.1%}")
    if not same:
        raise SystemExit("1 and 2 workers wrote different bytes")


if __name__ == "__main__":
    main()
