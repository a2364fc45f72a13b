"""Wall time of `composer data prepare --submit` (the pipeline's stages as SLURM job arrays) against the local pool
(`composer data prepare`), on the same corpus and settings, in one run; their outputs must be byte-identical.

The SLURM side runs on the test suite's one-node cluster (`tests/helpers/slurm_cluster.py`: slurmctld, slurmd and
munge on this machine, as root), so both sides get the same cores: the difference is what SLURM adds (a Python
process per array task, the scheduler's passes between dependent arrays), not more hardware. Each side's wall time
runs from starting the command to the published entry (for --submit: until its last array has left the queue).

    .venv/bin/python benchmarks/data_slurm_bench.py [--paths GLOB ...] [--tasks N] [--workers W]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import cpu_model  # noqa: E402
from tests.helpers import slurm_cluster  # noqa: E402
from tests.helpers.data_helpers import train_tokenizer, write_recipe  # noqa: E402

ENTRY_FILES = ("tokens.bin", "tokens.idx", "manifest.json", "redactions.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=["{stdlib}/json/*.py", "{stdlib}/email/**/*.py", "{stdlib}/asyncio/*.py"])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="local pool workers, and the array width (%%N) on SLURM")
    args = parser.parse_args()
    if reason := slurm_cluster.why_not():
        raise SystemExit(f"cannot start the test SLURM cluster: {reason}")
    with tempfile.TemporaryDirectory(prefix="data-slurm-bench-") as tmp:
        d = Path(tmp)
        tokenizer = train_tokenizer(d / "tokenizer")

        def recipe(cache: str) -> Path:
            section = {
                "tokenizer": str(tokenizer),
                "cache_dir": str(d / cache),
                "tasks": args.tasks,
                "num_workers": args.workers,
                "fim": {"rate": 0.5},
                "sources": [{"name": "corpus", "paths": args.paths}],
            }
            path = write_recipe(d / f"{cache}.yaml", section)
            path.write_text(path.read_text() + "cluster:\n  launcher: slurm\n")
            return path

        (d / "slurm").mkdir()
        cluster = slurm_cluster.SlurmCluster(d / "slurm")
        try:
            env = {**cluster.env, "COLUMNS": "400"}
            composer = [sys.executable, "-m", "composer.cli", "data", "prepare"]
            load_before = os.getloadavg()[0]

            started = time.monotonic()
            subprocess.run([*composer, str(recipe("local"))], cwd=d, env=env, check=True, capture_output=True)
            local_s = time.monotonic() - started

            started = time.monotonic()
            done = subprocess.run(
                [*composer, str(recipe("slurm-cache")), "--submit"], cwd=d, env=env, check=True, capture_output=True, text=True
            )
            jobs = [line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("submitted ")]
            while set(jobs) & set(subprocess.run(["squeue", "-h", "-o", "%F"], env=env, capture_output=True, text=True).stdout.split()):
                time.sleep(0.5)
            slurm_s = time.monotonic() - started
            load_after = os.getloadavg()[0]
        finally:
            cluster.close()
        [local] = (d / "local").glob("corpus-*")
        entries = list((d / "slurm-cache").glob("corpus-*"))
        if not entries:
            raise SystemExit(f"the SLURM arrays did not publish the corpus; see {d / 'slurm-cache' / '.logs'}")
        same = all((local / name).read_bytes() == (entries[0] / name).read_bytes() for name in ENTRY_FILES)
    print(
        f"{cpu_model()}, {os.cpu_count()} CPUs; load average {load_before:.1f} before, {load_after:.1f} after; "
        f"{args.tasks} tasks, {args.workers} workers / array width {args.workers}, {len(jobs)} arrays"
    )
    print(f"local pool (composer data prepare)            : {local_s:7.1f} s")
    print(f"SLURM job arrays (data prepare --submit)      : {slurm_s:7.1f} s   ({slurm_s / local_s:.2f}x the local pool)")
    print(f"outputs byte-identical ({', '.join(ENTRY_FILES)}): {same}")
    if not same:
        raise SystemExit("SLURM and the local pool wrote different bytes")


if __name__ == "__main__":
    main()
