"""Resumable training checkpoints: Megatron distributed checkpoints of model and optimizer, plus trainer state.

Layout of `checkpoints/`:
    step-00000040/      one complete checkpoint (Megatron dist-checkpoint files + trainer_state.json)
    latest              the name of the newest complete checkpoint (replaced atomically)
A checkpoint is written into `.tmp-step-N/` by every rank and renamed by rank 0 only after all ranks finished,
so a run killed while saving leaves the previous checkpoint as `latest`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from composer.recipes.errors import UserError
from composer.recipes.schema import LAYOUT_KEYS
from composer.runtime.processes import die_with_parent
from composer.runtime.run_dir import atomic_write_text, fsync_dir
from composer.trainer.cpu_compat import cuda_calls_on_cpu
from composer.trainer.optimizer import TrainOptimizer

_writer_queue_manager = None


def _results_queue_that_dies_with_this_rank() -> None:
    """Megatron's checkpoint writer keeps its results queue in a multiprocessing Manager process that outlives a
    killed rank (an orphan of ~300 MB per rank per crash); this Manager is ended with the rank instead."""
    global _writer_queue_manager
    from multiprocessing import get_context
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _writer_queue_manager is None:
        _writer_queue_manager = SyncManager(ctx=get_context("spawn"))
        _writer_queue_manager.start(initializer=die_with_parent)
        filesystem_async._results_queue = _writer_queue_manager.Queue()


class Checkpointer:
    def __init__(self, directory: Path, keep: int):
        self.directory = directory
        self.keep = keep

    def latest(self) -> Path | None:
        pointer = self.directory / "latest"
        if not pointer.is_file():
            return None
        path = self.directory / pointer.read_text().strip()
        if not (path / "trainer_state.json").is_file():
            raise UserError(f"{pointer} names {path.name}, which is not a complete checkpoint")
        return path

    def save(self, step: int, model, optimizer: TrainOptimizer, state: dict) -> Path:
        """Collective. `model` is the unwrapped GPTModel; `state` (JSON-serialisable, e.g. data position and
        `layout`) is saved by rank 0 with the schedule."""
        from megatron.core import dist_checkpointing

        name = f"step-{step:08d}"
        tmp, final = self.directory / f".tmp-{name}", self.directory / name
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_state = model.sharded_state_dict(prefix="")
        sharded = {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state)}
        _results_queue_that_dies_with_this_rank()
        with cuda_calls_on_cpu():
            dist_checkpointing.save(sharded, str(tmp))
        dist.barrier()
        if dist.get_rank() == 0:
            full_state = {
                "step": step,
                "optimizer": optimizer.name,
                "scheduler": optimizer.scheduler.state_dict(),
                "adam_steps": optimizer.adam_steps(),
                **state,
            }
            atomic_write_text(tmp / "trainer_state.json", json.dumps(full_state))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            fsync_dir(self.directory)
            atomic_write_text(self.directory / "latest", name)
            self._prune()
        dist.barrier()
        return final

    def load(self, path: Path, model, optimizer: TrainOptimizer, layout: dict) -> dict:
        """Collective. Restores model, optimizer, schedule and RNG; returns the saved trainer state."""
        from megatron.core import dist_checkpointing

        state = check_layout(path, layout)
        saved_optimizer = state.get("optimizer", "adam")  # checkpoints from before optim.name trained with Adam
        if saved_optimizer != optimizer.name:
            raise UserError(
                f"{path}: trained with optim.name {saved_optimizer}, the recipe says {optimizer.name}; switching "
                f"optimizer on resume is refused (its state would not carry over): use {saved_optimizer}, or start a new run"
            )
        model_state = model.sharded_state_dict(prefix="")
        sharded = {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True)}
        with cuda_calls_on_cpu():
            loaded = dist_checkpointing.load(sharded, str(path))
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"], state["scheduler"], state["adam_steps"])
        return state

    def load_model(self, path: Path, model, layout: dict) -> None:
        """Collective. Restores the model weights only (for export)."""
        from megatron.core import dist_checkpointing

        check_layout(path, layout)
        with cuda_calls_on_cpu():
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="")}, str(path))
        model.load_state_dict(loaded["model"])

    def _prune(self) -> None:
        complete = sorted(p for p in self.directory.glob("step-*") if (p / "trainer_state.json").is_file())
        for old in complete[: -self.keep]:
            shutil.rmtree(old)


def check_layout(path: Path, layout: dict) -> dict:
    """The checkpoint's trainer state; refuses a model-parallel layout other than the one it was saved with."""
    state = json.loads((path / "trainer_state.json").read_text())
    saved = state.get("layout", {})
    changed = {k: (saved.get(k), layout[k]) for k in LAYOUT_KEYS if saved.get(k) != layout[k]}
    if changed:
        what = ", ".join(f"{k}={a} in the checkpoint, {b} now" for k, (a, b) in changed.items())
        raise UserError(
            f"{path}: cannot resume with another model-parallel layout ({what}); optimizer state is resharded across "
            f"data parallelism only: resume with the checkpoint's parallelism, or start a new run from an exported HF checkpoint"
        )
    return state
