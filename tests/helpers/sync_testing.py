"""Shared helpers for the sync tests: checkpoints that evolve like training steps, and the real CLI."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

from composer.recipes.schema import SyncSection
from composer.sync.checkpoint import write_safetensors
from tests.conftest import run_composer

REPO = Path(__file__).resolve().parents[2]


def to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, round to nearest even (what torch does)."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


class TrainingRun:
    """A tiny model whose fp32 master weights take small sparse optimizer steps; each step is saved as a
    bf16 safetensors checkpoint (two shards, a config file), so consecutive versions differ like RL steps."""

    def __init__(self, root: Path, seed: int = 0, rows: int = 256, cols: int = 512, density: float = 0.02):
        self.root = root
        self.rng = np.random.default_rng(seed)
        self.density = density
        self.master = {
            "model.embed.weight": self.rng.standard_normal((rows, cols)).astype(np.float32) * 0.02,
            "model.layers.0.mlp.weight": self.rng.standard_normal((cols, rows)).astype(np.float32) * 0.02,
            "model.norm.weight": np.ones(cols, np.float32),
        }
        self.step_count = 0

    def step(self) -> None:
        for w in self.master.values():
            touched = self.rng.random(w.shape) < self.density
            w += touched * self.rng.standard_normal(w.shape).astype(np.float32) * np.abs(w) * 0.05
        self.step_count += 1

    def save(self) -> Path:
        out = self.root / f"step{self.step_count:04d}"
        out.mkdir(parents=True)
        names = list(self.master)
        write_safetensors(out / "model-00001-of-00002.safetensors", {n: ("BF16", to_bf16(self.master[n])) for n in names[:2]})
        write_safetensors(
            out / "model-00002-of-00002.safetensors",
            {names[2]: ("BF16", to_bf16(self.master[names[2]])), "model.step": ("I64", np.array([self.step_count], np.int64))},
        )
        (out / "config.json").write_text('{"architectures": ["Tiny"], "torch_dtype": "bfloat16"}\n')
        return out

    def next_checkpoint(self) -> Path:
        self.step()
        return self.save()


def sync_section(store: Path | str, **kw) -> SyncSection:
    codec = kw.pop("codec", {"chunk_mb": 1, "threads": 2})
    return SyncSection(store=str(store), codec=codec, **kw)


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


run_cli = run_composer


def kill_once_chunks_are_written(proc, chunk_dir, chunks: int, timeout_s: float) -> None:
    """kill -9 the pushing process as soon as `chunks` chunk files are in the store (before its manifest)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if chunk_dir.is_dir() and sum(not n.startswith(".") for n in os.listdir(chunk_dir)) >= chunks:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the push finished before it could be killed"
