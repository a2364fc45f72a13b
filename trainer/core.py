"""What one rank of every training loop stands on: process groups, the Megatron model, data-parallel wrapper,
optimizer, checkpoints (save, resume with a layout check) and HF export.

Mid-training (`trainer.midtrain`) and the RL learner (`trainer.rl_learner`) each build one `TrainerCore` from
their recipe sections and add only their own data and step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from composer.recipes.schema import ModelSection, OptimSection, ParallelismSection, TrainSection
from composer.trainer.checkpointing import Checkpointer
from composer.trainer.distributed import init_distributed
from composer.trainer.model import build_model
from composer.trainer.optimizer import TrainOptimizer, wrap_data_parallel
from composer.trainer.weights import HFTensors, export_hf, export_hf_tensors, load_hf_into


@dataclass(frozen=True)
class Every:
    """A periodic action of a loop: due every `n` steps and at the last step."""

    n: int
    last: int

    def __call__(self, step: int) -> bool:
        return step % self.n == 0 or step == self.last


class TrainerCore:
    """One rank's model (from `model.checkpoint`, or a seeded random initialisation), DDP, optimizer and checkpoints."""

    def __init__(self, model: ModelSection, parallelism: ParallelismSection, optim: OptimSection, train: TrainSection, checkpoints: Path):
        self.model_section, self.parallelism = model, parallelism
        init_distributed(parallelism, seed=train.seed)
        torch.manual_seed(train.seed)  # random initialisation is a function of the seed
        self.model = build_model(model, parallelism, recompute_activations=train.recompute_activations, qk_clip=optim.qk_clip)
        if model.checkpoint:
            load_hf_into(self.model, model, model.checkpoint)
        self.ddp = wrap_data_parallel(self.model, parallelism)
        self.optimizer = TrainOptimizer(self.ddp, optim, parallelism, train.steps, getattr(torch, model.dtype))
        self.checkpointer = Checkpointer(checkpoints, train.keep_checkpoints)

    def frozen_copy(self):
        """A copy of the model as it is now that no step changes (e.g. the RL reference policy)."""
        copy = build_model(self.model_section, self.parallelism)
        copy.load_state_dict(self.model.state_dict())
        copy.eval()
        for param in copy.parameters():
            param.requires_grad_(False)
        return copy

    def resume(self) -> dict | None:
        """Collective. Restore the newest checkpoint; returns its saved state (None on a fresh start)."""
        latest = self.checkpointer.latest()
        return self.checkpointer.load(latest, self.model, self.optimizer, self.parallelism.layout()) if latest else None

    def save(self, step: int, state: dict | None = None) -> None:
        """Collective. A checkpoint of `step` holding `state` (JSON-serialisable) beside model and optimizer."""
        self.checkpointer.save(step, self.model, self.optimizer, {"layout": self.parallelism.layout(), **(state or {})})

    def export(
        self, out_dir: Path, tokenizer_dir: str | Path | None, dtype: torch.dtype | None = None, quantize: str | None = None
    ) -> None:
        """Collective. The model as an HF checkpoint (safetensors, config.json, tokenizer), in `dtype` when given,
        quantized (`fp8`, `int4`) when asked."""
        export_hf(self.model, self.model_section, out_dir, tokenizer_dir=tokenizer_dir, dtype=dtype, quantize=quantize)

    def export_tensors(
        self, out_dir: Path, tokenizer_dir: str | Path | None, dtype: torch.dtype | None = None, quantize: str | None = None
    ) -> HFTensors | None:
        """Collective. As `export`, with the tensors kept in memory on global rank 0 (None elsewhere) and only the
        other files written to `out_dir`."""
        return export_hf_tensors(self.model, self.model_section, out_dir, tokenizer_dir=tokenizer_dir, dtype=dtype, quantize=quantize)


def export_checkpoint(
    model: ModelSection,
    parallelism: ParallelismSection,
    train: TrainSection,
    checkpoints: Path,
    out_dir: Path,
    tokenizer_dir: str | Path | None,
) -> bool:
    """Collective. The newest checkpoint's model as an HF checkpoint (no optimizer built); False when there is none."""
    init_distributed(parallelism, seed=train.seed)
    checkpointer = Checkpointer(checkpoints, train.keep_checkpoints)
    latest = checkpointer.latest()
    if latest is None:
        return False
    megatron_model = build_model(model, parallelism)
    checkpointer.load_model(latest, megatron_model, parallelism.layout())
    export_hf(megatron_model, model, out_dir, tokenizer_dir=tokenizer_dir)
    return True
