"""Supervised fine-tuning on rendered conversations: one process per rank under torchrun, on mid-training's loop.

    python -m composer.trainer.sft train RUN_DIR [--resume]     (started by `composer train sft`)
    python -m composer.trainer.sft export RUN_DIR OUT_DIR       (started by `composer export`)

`composer train sft` renders the conversations (`rl.sft_data`) into RUN_DIR/sft-examples/ before the launch. Here
`sft.pack: true` puts whole conversations first-fit into samples of `sft.max_length` positions, each attending only
to itself with positions from 0 (mid-training's document placement, the conversations' bounds carried in the sample:
an EOS inside a conversation bounds nothing); `false` makes each conversation one sample, padded after its end
(causal attention: the padding never reaches a real token, and its loss mask is 0). Everything else (model,
optimizer, steps, evaluation, checkpoints, `--resume`, export) is mid-training's (`trainer.midtrain`). Pass p over
the training conversations is a fresh seeded permutation, packed in that order; sample `k` is found by counting
the passes' samples: a pure function of `k`, so a resumed run reads exactly the data an uninterrupted one would.
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
    saved = None
    if run.recipe_path.is_file():
        import yaml

        from composer.recipes.loader import load_recipe

        saved = load_recipe(run.recipe_path)
        if saved.sft is not None and "pack" not in ((yaml.safe_load(run.recipe_path.read_text()) or {}).get("sft") or {}):
            # a run started before `sft.pack` trained one conversation a sample: resumed so, or refused
            saved = saved.model_copy(update={"sft": saved.sft.model_copy(update={"pack": False})})
    midtrain.check_resume(run, recipe, fixed=RESUME_FIXED, saved=saved)


def first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """Items of `sizes` (each at most `capacity`), in order, each into the first bin with room for it (a new bin when
    none has): lists of item indices per bin, in the order the bins opened. O(n log n): a max-tree over the bins' room,
    where bins not yet opened have all of it, so the leftmost bin with room is the first fit or the next new bin."""
    leaves = 1
    while leaves < len(sizes):
        leaves *= 2
    room = [capacity] * (2 * leaves)
    bins: list[list[int]] = []
    for item, need in enumerate(sizes):
        if need > capacity:
            raise ValueError(f"item {item} of size {need} exceeds the bins' capacity {capacity}")
        node = 1
        while node < leaves:
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        b = node - leaves
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        room[node] -= need
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
    return bins


class ConversationSamples(torch.utils.data.Dataset):
    """Samples of `length` positions (tokens, labels, loss_mask, position_ids) over conversations; `shuffle`: a new
    seeded order every pass (training), else the stored order over and over (held-out).

    `pack`: the pass's conversations go, in its order, first-fit into samples (bins) of `length` positions, whole;
    each position's conversation within its sample is `segments` (-1: padding), which the placement turns into
    attention and positions per conversation (the EOS a conversation may hold inside is no boundary). Else each
    conversation is a sample of its own. Sample `k` is bin `k - start(p)` of pass p, where pass p holds samples
    [start(p), start(p+1)): a pure function of `k`.
    """

    def __init__(self, conversations: TokenizedConversations, length: int, pad: int, seed: int, shuffle: bool, pack: bool = False):
        self.conversations, self.length, self.pad, self.seed, self.shuffle, self.pack = conversations, length, pad, seed, shuffle, pack
        self._positions = np.diff(conversations.offsets) - 1  # the last token of a conversation is only a label
        self._starts = [0]  # first sample of each pass packed so far, and where the last one ends
        self._pass: tuple[int, list[list[int]]] | None = None

    def bins(self, p: int) -> list[list[int]]:
        """The conversations of each sample of pass `p`."""
        p = p if self.shuffle else 0  # the held-out samples are the same every pass
        if self._pass is None or self._pass[0] != p:
            n = len(self.conversations)
            order = np.random.default_rng([self.seed, p]).permutation(n) if self.shuffle else np.arange(n)
            if self.pack:
                bins = [[int(order[i]) for i in b] for b in first_fit(self._positions[order].tolist(), self.length)]
            else:
                bins = [[int(i)] for i in order]
            self._pass = (p, bins)
        return self._pass[1]

    def locate(self, k: int) -> tuple[int, int]:
        """(pass, sample of the pass) of sample `k`; the passes before are packed once to count their samples."""
        while self._starts[-1] <= k:
            self._starts.append(self._starts[-1] + len(self.bins(len(self._starts) - 1)))
        p = int(np.searchsorted(self._starts, k, side="right")) - 1
        return p, k - self._starts[p]

    def sample_conversations(self, k: int) -> list[int]:
        p, i = self.locate(k)
        return self.bins(p)[i]

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        s = self.length
        tokens = np.full(s, self.pad, dtype=np.int64)
        labels = np.full(s, self.pad, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        positions = np.arange(s, dtype=np.int64)
        segments = np.full(s, -1, dtype=np.int64)
        at = 0
        for j, c in enumerate(self.sample_conversations(k)):
            ids, mask = self.conversations[c]
            n = len(ids) - 1
            # labels are the conversation's own next tokens: its last position predicts its last token, never the
            # first token of the conversation after it
            tokens[at : at + n], labels[at : at + n], loss_mask[at : at + n] = ids[:-1], ids[1:], mask[1:]
            positions[at : at + n], segments[at : at + n] = np.arange(n), j
            at += n
        sample: dict[str, np.ndarray] = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions}
        if self.pack:
            sample["segments"] = segments
        return sample


def packing_summary(conversations: TokenizedConversations, length: int, seed: int, pack: bool) -> dict[str, float]:
    """Samples of the first training pass, conversations per sample and the share of positions that hold a token."""
    count = len(ConversationSamples(conversations, length, 0, seed, shuffle=True, pack=pack).bins(0))
    real = int((np.diff(conversations.offsets) - 1).sum())
    return {
        "samples": count,
        "conversations_per_sample": round(len(conversations) / count, 2),
        "real_share": round(real / (count * length), 4),
        "real_share_unpacked": round(real / (len(conversations) * length), 4),
    }


def conversation_batches(recipe: Recipe, run: RunDir) -> midtrain.MidtrainData:
    """This rank's batches over the run's rendered conversations (`composer train sft` wrote them before the launch)."""
    from megatron.core import parallel_state

    examples = SftExamples.read(run.root)
    length, seed, pack = recipe.sft.max_length, recipe.train.seed, recipe.sft.pack
    train = ConversationSamples(examples.train, length, examples.pad, seed, shuffle=True, pack=pack)
    valid = ConversationSamples(examples.valid, length, examples.pad, seed, shuffle=False, pack=pack)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    placement = None
    # the pipeline schedule takes the sample rows (recipes.checks refuses sft.pack with pp > 1)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        p = recipe.parallelism
        placement = midtrain.BatchPlacement(
            "document" if pack else "causal",
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
