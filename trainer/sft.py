"""Supervised fine-tuning on rendered conversations: one process per rank under torchrun, on mid-training's loop.

    python -m composer.trainer.sft train RUN_DIR [--resume]     (started by `composer train sft`)
    python -m composer.trainer.sft export RUN_DIR OUT_DIR       (started by `composer export`)

`composer train sft` renders the conversations (`rl.sft_data`) into RUN_DIR/sft-examples/ before the launch; here
each becomes one sample of `sft.max_length` positions, padded after its end (causal attention: the padding never
reaches a real token, and its loss mask is 0). Everything else (model, optimizer, steps, evaluation, checkpoints,
`--resume`, export) is mid-training's (`trainer.midtrain`). Sample `k` of training is conversation
`order(k // n)[k % n]` with a fresh seeded permutation per pass over the n conversations: a pure function of `k`, so a
resumed run reads exactly the data an uninterrupted one would.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from composer.recipes.errors import UserError
from composer.recipes.schema import Recipe
from composer.runtime.run_dir import RunDir
from composer.runtime.sft_examples import SftExamples, TokenizedConversations
from composer.trainer import midtrain
from composer.trainer.kernels import check_kernels_installed
from composer.trainer.weights import check_checkpoint_before_launch

MODULE = __spec__.name
"""This entry point, as `python -m` names it (the CLI starts it under torchrun)."""

UNHONOURED = {
    "rollout": "an SFT run has no rollout engines (an RL recipe?)",
    "rl": "an SFT run has no RL objective (an RL recipe?)",
    "sync": "SFT exports an HF checkpoint at the end; it does not push weight versions",
    "data": "SFT trains on sft.sources; a corpus is mid-training's",
}

RESUME_FIXED = ("sft", "train.steps", "train.global_batch_size", "train.eval_batches", "train.seed", "optim.name")
"""What decides the conversations, their order and the evaluation set, and the optimizer the checkpoints hold."""


def check_recipe(recipe: Recipe) -> None:
    """Refuse what the loop cannot honour, before anything launches."""
    from composer.recipes.checks import refuse_unhonoured

    refuse_unhonoured(recipe, "train sft", UNHONOURED)
    if recipe.sft is None:
        raise UserError("train sft: the recipe has no sft section; add sft.sources and sft.max_length")
    references = any(s.kind == "references" for s in recipe.sft.sources)
    if references and recipe.env is None:
        raise UserError("sft.sources: a references source renders the tasks of env.tasks; the recipe has no env section")
    if recipe.env is not None and not references:
        raise UserError("env: train sft reads env only for an sft source of kind references; add one or drop env")
    if not recipe.model.checkpoint:
        raise UserError(
            "train sft: model.checkpoint is required (SFT starts from a trained model, whose tokenizer renders the conversations)"
        )
    check_kernels_installed(recipe.model.kernels)
    try:
        check_checkpoint_before_launch(recipe.model)
    except UserError:
        raise
    except Exception as e:  # a checkpoint directory the readers cannot parse at all
        raise UserError(f"model.checkpoint {recipe.model.checkpoint}: cannot read it ({type(e).__name__}: {e})") from None


def check_resume(run: RunDir, recipe: Recipe) -> None:
    midtrain.check_resume(run, recipe, fixed=RESUME_FIXED)


class ConversationSamples(torch.utils.data.Dataset):
    """Samples of `length` positions (tokens, labels, loss_mask, position_ids) over conversations; `shuffle`: a new
    seeded order every pass (training), else the stored order over and over (held-out)."""

    def __init__(self, conversations: TokenizedConversations, length: int, pad: int, seed: int, shuffle: bool):
        self.conversations, self.length, self.pad, self.seed, self.shuffle = conversations, length, pad, seed, shuffle
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.conversations)

    def _conversation(self, k: int) -> int:
        n = len(self.conversations)
        if not self.shuffle:
            return k % n
        epoch = k // n
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n)}
        return int(self._orders[epoch][k % n])

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        ids, mask = self.conversations[self._conversation(k)]
        s, n = self.length, len(ids) - 1  # the last token is only a label
        tokens = np.full(s, self.pad, dtype=np.int64)
        labels = np.full(s, self.pad, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        tokens[:n], labels[:n], loss_mask[:n] = ids[:-1], ids[1:], mask[1:]
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": np.arange(s, dtype=np.int64)}


def conversation_batches(recipe: Recipe, run: RunDir) -> midtrain.MidtrainData:
    """This rank's batches over the run's rendered conversations (`composer train sft` wrote them before the launch)."""
    from megatron.core import parallel_state

    examples = SftExamples.read(run.root)
    length, seed = recipe.sft.max_length, recipe.train.seed
    train = ConversationSamples(examples.train, length, examples.pad, seed, shuffle=True)
    valid = ConversationSamples(examples.valid, length, examples.pad, seed, shuffle=False)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    placement = None
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:  # the pipeline schedule takes the sample rows
        p = recipe.parallelism
        placement = midtrain.BatchPlacement(
            "causal",
            examples.pad,
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_context_parallel_rank(),
            p.tp if p.sequence_parallel else 1,
        )
    t = recipe.train
    batch = (t.global_batch_size, t.micro_batch_size, dp_rank, dp_size, placement)
    return midtrain.MidtrainData(midtrain.BatchSource(train, *batch), midtrain.BatchSource(valid, *batch), Path(examples.tokenizer_dir))


def train(run: RunDir, resume: bool, terminal: TextIO | None) -> None:
    midtrain.train(run, resume, terminal, conversation_batches, "sft")


def export(run: RunDir, out_dir: Path) -> None:
    midtrain.export(run, out_dir, SftExamples.read(run.root).tokenizer_dir)


if __name__ == "__main__":
    sys.exit(midtrain.main(sys.argv[1:], train, export))
