"""Tokens/s of `data prepare` on the Python standard library against a plain single-process loop.

Both sides run the same per-file tokenization (`trainer.data.tokenize_file`, with a ByteLevel BPE trained here
on part of the stdlib) on the same files; the baseline loops over them in this process and keeps the tokens in
memory (no dataset written), so the ratio is what the process pool buys net of writing the Megatron dataset. A second prepare measures a cache hit.
CPU seconds are printed next to wall seconds: on a machine shared with other jobs, the cores actually obtained
(CPU / wall) bound the speed-up, whatever the number of workers.

    PYTHONPATH=. python benchmarks/data_prepare_bench.py [--workers N] [--vocab-size V]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the baseline is one thread; set before tokenizers loads

import numpy as np  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from recipes.schema import DataSection  # noqa: E402
from trainer.data import expand_paths, prepare_data, tokenize_file  # noqa: E402

EOS = "<|endoftext|>"


def train_tokenizer(directory: Path, files: list[Path], vocab_size: int) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((f.read_bytes().decode("utf-8", errors="replace") for f in files), trainer)
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(f'{{"eos_token": "{EOS}"}}')
    return directory


def cpu_seconds() -> float:
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def single_process_loop(tokenizer_dir: Path, files: list[Path]) -> tuple[int, float, float]:
    """Tokens, wall seconds and CPU seconds of the same per-file tokenization, file by file in this process."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eod = tokenizer.token_to_id(EOS)
    start, cpu = time.perf_counter(), cpu_seconds()
    tokens = sum(len(tokenize_file(file, "text", "text", eod, np.uint16, tokenizer).tokens) for file in files)
    return tokens, time.perf_counter() - start, cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes of data prepare (default: all cores)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = DataSection(
            sources=[{"name": "python-stdlib", "paths": ["{stdlib}/**/*.py"]}],
            seq_length=256,
            cache_dir=str(root / "cache"),
            num_workers=args.workers,
            tokenizer=str(root / "tokenizer"),
        )
        files = expand_paths(data.sources[0], 0)
        started = time.perf_counter()
        train_tokenizer(root / "tokenizer", files[::4], args.vocab_size)
        print(f"corpus: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB; "
              f"tokenizer (vocab {args.vocab_size}) trained on a quarter of them in {time.perf_counter() - started:.1f} s")

        baseline_tokens, baseline_s, baseline_cpu = single_process_loop(root / "tokenizer", files)
        started, cpu = time.perf_counter(), cpu_seconds()
        prepared = prepare_data(data, model_checkpoint=None, model_vocab_size=args.vocab_size)
        prepare_s, prepare_cpu = time.perf_counter() - started, cpu_seconds() - cpu
        started = time.perf_counter()
        again = prepare_data(data, model_checkpoint=None, model_vocab_size=args.vocab_size)
        hit_s = time.perf_counter() - started

    tokens = prepared.sources[0].num_tokens
    if tokens != baseline_tokens or not again.all_cached:
        raise SystemExit(f"mismatch: prepare wrote {tokens} tokens, the baseline counted {baseline_tokens}")
    print(f"single-process loop       : {baseline_tokens / baseline_s / 1e6:6.2f} M tokens/s ({baseline_s:.1f} s wall, {baseline_cpu:.1f} s CPU)")
    print(f"data prepare, {args.workers} worker(s) : {tokens / prepare_s / 1e6:6.2f} M tokens/s ({prepare_s:.1f} s wall, {prepare_cpu:.1f} s CPU"
          f" = {prepare_cpu / prepare_s:.1f} cores obtained; includes importing Megatron and writing .bin/.idx)")
    print(f"speed-up                  : {baseline_s / prepare_s:.2f}x")
    print(f"cache hit                 : {hit_s:.2f} s ({baseline_s / hit_s:.0f}x faster than tokenizing)")


if __name__ == "__main__":
    main()
