"""Sync delta of RL policies shipped in the serving formats of the published checkpoints: bf16 vs block fp8 vs INT4.

The Kimi-K2-Thinking twin (tests/helpers/published_twins.py: INT4 routed experts, YaRN) gets a tokenizer; an RL run of its
fp32 copy on the smoke tasks is recorded with the fp32 embedded engine (vLLM on this CPU runs neither block-fp8
linears nor INT4 MoE without AMX). The learner then replays those groups (`--replay`: no engines) from the INT4
twin itself, once per `rollout.dtype` (bfloat16, fp8, int4) at the learning rate of recipes/kimi-k2-rl.yaml, and
pushes every policy as a delta. Printed per step: the delta's ratio (full bytes / stored bytes) and the fraction
of stored values that changed, per format; the learner's publish seconds (export + push).

    python benchmarks/quantized_policy_bench.py [--steps 4] [--lr 1e-6] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def composer(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "composer.cli", *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"composer {' '.join(args)} failed:\n{result.stderr[-3000:]}")


def prepare(work: Path) -> tuple[Path, Path]:
    """(the INT4 twin with a tokenizer, its fp32 copy)."""
    import torch

    from composer.trainer.checkpoint_init import train_tokenizer
    from composer.trainer.hf_config import model_section_from_hf
    from composer.trainer.weights import convert_hf
    from tests.helpers.published_twins import make_twin

    twin = make_twin(work / "kimi-k2-thinking", "kimi_k2_thinking")
    config = json.loads((twin / "config.json").read_text())
    tokenizer = train_tokenizer(config["vocab_size"], max_bytes=2**20)
    tokenizer.save_pretrained(twin)
    config["eos_token_id"] = tokenizer.eos_token_id
    (twin / "config.json").write_text(json.dumps(config, indent=2))
    return twin, convert_hf(model_section_from_hf(twin), work / "fp32", dtype=torch.float32)


def recipe(work: Path, checkpoint: Path, steps: int) -> Path:
    from composer.trainer.hf_config import model_section_from_hf

    model = model_section_from_hf(checkpoint).model_dump(mode="json", exclude_defaults=True)
    data = {
        "run": {"name": "record", "dir": str(work / "runs")},
        "model": model,
        "optim": {"lr": 1e-3, "schedule": "constant"},
        "train": {"steps": steps, "micro_batch_size": 4, "global_batch_size": 8, "checkpoint_every": steps},
        "rollout": {
            "engine": "embedded",
            "max_context": 256,
            "kv_cache_gib": 0.0625,
            "dtype": "float32",
            "sampling": {"temperature": 1.0, "max_tokens": 16, "stop": ["\n"]},
        },
        "env": {"tasks": [{"name": "smoke"}], "sandbox": {"cpu_seconds": 5, "wall_seconds": 10}},
        "rl": {"group_size": 4, "prompts_per_step": 2, "max_staleness": 1},
        "sync": {"store": str(work / "store-record")},
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="quantized-policy-bench-"))
    try:
        twin, dense = prepare(work)
        path = recipe(work, dense, args.steps)
        composer("train", "rl", str(path))
        recorded = work / "runs/record"
        rows = {}
        for dtype in ("bfloat16", "fp8", "int4"):
            composer(
                "train",
                "rl",
                str(path),
                "--replay",
                str(recorded),
                "--set",
                f"run.name=replay-{dtype}",
                "--set",
                f"model.checkpoint={twin}",
                "--set",
                f"rollout.dtype={dtype}",
                "--set",
                f"optim.lr={args.lr}",
                "--set",
                "model.dtype=float32",
            )
            rows[dtype] = [json.loads(line) for line in (work / f"runs/replay-{dtype}/metrics.jsonl").read_text().splitlines()]
        print(
            f"Kimi-K2-Thinking twin, {args.steps} replayed steps at lr {args.lr:g}; per step: delta ratio (full / stored bytes), "
            "changed fraction, publish seconds"
        )
        print("step  " + "  ".join(f"{dtype:>30}" for dtype in rows))
        for step in range(args.steps):
            cells = [
                f"{r[step]['sync_ratio']:>8.1f}x {r[step]['sync_changed_fraction']:>9.5f} {r[step]['publish_seconds']:>8.1f}s"
                for r in rows.values()
            ]
            print(f"{step + 1:>4}  " + "  ".join(f"{c:>30}" for c in cells))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
