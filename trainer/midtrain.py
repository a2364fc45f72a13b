"""Mid-training (continued pre-training) on code tokens: one process per rank under torchrun.

    python -m composer.trainer.midtrain train RUN_DIR [--resume]     (started by `composer train midtrain`)
    python -m composer.trainer.midtrain export RUN_DIR OUT_DIR       (started by `composer export`)

Every rank reads the resolved recipe from RUN_DIR/recipe.yaml. The loop (`Midtrainer.run`) evaluates,
checkpoints and logs; `train_step` does one optimizer step and returns its metrics. Global batch `k` (0-based)
is always train samples [k*G, (k+1)*G) of the blended dataset, so a resumed run reads exactly the data an
uninterrupted one would. A UserError on any rank is written to RUN_DIR/logs/ for the launcher and ends the rank
with exit code 2 (see `cluster.launch`).
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from composer.recipes.checks import refuse_resume_changes, refuse_unhonoured
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.recipes.schema import ARCHITECTURE_FIELDS, Recipe
from composer.runtime.prepared_data import PreparedData
from composer.runtime.processes import die_with_parent
from composer.runtime.progress import StepClock, Trackers
from composer.runtime.run_dir import RunDir, drop_records_after
from composer.trainer.checkpointing import Checkpointer, check_layout
from composer.trainer.core import Every, TrainerCore, export_checkpoint
from composer.trainer.distributed import shutdown_distributed
from composer.trainer.kernels import check_kernels_installed
from composer.trainer.launch import record_rank_error, redirect_rank_output
from composer.trainer.logprobs import forward_token_losses
from composer.trainer.model import causal_mask
from composer.trainer.optimizer import TrainOptimizer
from composer.trainer.packing import SequenceLayout, document_lengths, segment_lengths
from composer.trainer.pipeline import forward_backward
from composer.trainer.weights import check_checkpoint_before_launch

MODULE = __spec__.name
"""This entry point, as `python -m` names it (the CLI starts it under torchrun)."""

UNHONOURED = {
    "rollout": "a midtrain run has no rollout engines (an RL recipe?)",
    "env": "a midtrain run has no environments (an RL recipe?)",
    "rl": "a midtrain run has no RL objective (an RL recipe?)",
    "sync": "midtrain exports an HF checkpoint at the end; it does not push weight versions",
}


def check_recipe(recipe: Recipe) -> None:
    """Refuse what the loop cannot honour, before anything launches."""
    refuse_unhonoured(recipe, "train midtrain", UNHONOURED)
    check_kernels_installed(recipe.model.kernels)
    if recipe.data is None:
        raise UserError("train midtrain: the recipe has no data section; add data.sources and data.seq_length")
    check_checkpoint_before_launch(recipe.model)


RESUME_FIXED = (
    "data.sources",
    "data.tokenizer",
    "data.seq_length",
    "data.split",
    "data.files",
    "data.cleaning",
    "data.fim",
    "data.tasks",
    "train.steps",
    "train.global_batch_size",
    "train.eval_batches",
    "train.seed",
    "optim.name",
)
"""What decides the sample order (Megatron's shuffle depends on the number of samples) and the evaluation set, and
the optimizer whose state the checkpoints hold."""


def check_resume(run: RunDir, recipe: Recipe, fixed: tuple[str, ...] = RESUME_FIXED, saved: Recipe | None = None) -> None:
    """Refuse a resume whose recipe does not fit the run's checkpoints or changes a key in `fixed` (its data order)
    from the run's (`saved`: its recipe.yaml as the caller reads it; else loaded here)."""
    if not run.recipe_path.is_file():
        return  # RunDir.prepare reports the missing run
    refuse_resume_changes(
        saved or load_recipe(run.recipe_path),
        recipe,
        [*fixed, *(f"model.{key}" for key in ARCHITECTURE_FIELDS)],
        str(run.recipe_path),
        "the run's checkpoints and data order",
    )
    latest = Checkpointer(run.checkpoints, recipe.train.keep_checkpoints).latest()
    if latest is not None:
        check_layout(latest, recipe.parallelism.layout())


# --- data ----------------------------------------------------------------------------------------


class BatchPlacement:
    """How this rank feeds a micro-batch of samples to the model (`trainer.packing`): the sample rows
    (data.attention=causal) or their documents packed with attention and positions per document (document), this
    context-parallel rank's share either way.

    A document ends at the `eod` token, unless the samples carry `segments` (each position's document within its
    sample, -1 for padding: SFT's packed conversations, which hold EOS tokens inside); their padding is left out."""

    def __init__(self, attention: str, eod: int, cp_size: int = 1, cp_rank: int = 0, multiple: int = 1):
        self.by_document, self.eod = attention == "document", eod
        self.cp_size, self.cp_rank, self.multiple = cp_size, cp_rank, multiple

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict:
        rows, seq = batch["tokens"].shape
        keep = slice(None)
        if self.by_document and "segments" in batch:
            lengths, keep = segment_lengths(batch["segments"]), batch["segments"].flatten() >= 0
        else:
            lengths = document_lengths(batch["tokens"], self.eod) if self.by_document else [seq] * rows
        layout = SequenceLayout.build(lengths, self.by_document, self.cp_size, self.cp_rank, self.multiple)
        placed = {key: layout.local(batch[key].flatten()[keep]) for key in ("tokens", "labels", "loss_mask")}
        return {**placed, "position_ids": layout.position_ids, "layout": layout}


class BatchSource:
    """This data-parallel rank's micro-batches of global batch `index` of a dataset (a pure function of `index`),
    placed for this rank by `placement` (the sample rows as they are when None)."""

    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, placement: BatchPlacement | None = None):
        self.dataset = dataset
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.per_rank = global_batch // dp_size
        self.dp_rank = dp_rank
        self.placement = placement

    @property
    def num_micro_batches(self) -> int:
        return self.per_rank // self.micro_batch

    def micro_batches(self, index: int) -> list[dict[str, torch.Tensor]]:
        first = index * self.global_batch + self.dp_rank * self.per_rank
        out = []
        for m in range(self.num_micro_batches):
            samples = [self.dataset[first + m * self.micro_batch + i] for i in range(self.micro_batch)]
            keys = ("tokens", "labels", "loss_mask", "position_ids", *(("segments",) if "segments" in samples[0] else ()))
            batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in keys}
            out.append(self.placement(batch) if self.placement else batch)
        return out


# --- one step ------------------------------------------------------------------------------------


class ExpertLoad:
    """Counts the tokens each router sends to each expert during training forwards (hooks on Megatron's routers)."""

    def __init__(self, model, num_experts: int):
        # one row per global layer, so that ranks holding different layers (pipeline stages) reduce alike;
        # dense layers' rows stay 0
        self.counts = torch.zeros(model.config.num_layers, num_experts, dtype=torch.float64)
        for layer in model.decoder.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.register_forward_hook(self._hook(layer.layer_number - 1))

    def _hook(self, layer: int):
        def count(module, inputs, outputs):
            if module.training:
                routing_map = outputs[1]
                self.counts[layer] += routing_map.sum(dim=0).to(torch.float64)

        return count

    def take(self) -> torch.Tensor:
        """This rank's counts [layers, experts] since the last call."""
        counts = self.counts.clone()
        self.counts.zero_()
        return counts


def _token_losses(ddp, batch: dict) -> torch.Tensor:
    if "layout" in batch:
        return forward_token_losses(ddp, batch["layout"], batch["tokens"], batch["labels"])
    seq = batch["tokens"].shape[1]
    return ddp(batch["tokens"], batch["position_ids"], causal_mask(seq), labels=batch["labels"])


def _pipelined() -> bool:
    """pp > 1: steps go through Megatron's pipeline schedule (trainer.pipeline); the loss exists on the last stage."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size() > 1


def _take_aux_losses() -> torch.Tensor:
    """This rank's part of Megatron's load-balancing loss per layer, summed over the step's micro-batches."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    # aux_loss (qwen3_moe) or seq_aux_loss (deepseek_v3) records under its own name
    entry = tracker.get("load_balancing_loss") or tracker.get("seq_load_balancing_loss")
    if entry is None:
        return torch.zeros(0, dtype=torch.float64)
    values = entry["values"].clone().to(torch.float64)
    clear_aux_losses_tracker()
    return values


def _reduce_step(loss_sum: float, tokens: float, aux: torch.Tensor, counts: torch.Tensor, num_micro_batches: int) -> dict[str, float]:
    """Every per-step metric in one all-reduce over all ranks: on a busy machine each collective is a wait."""
    from megatron.core import parallel_state

    world, rank = dist.get_world_size(), dist.get_rank()
    rss = torch.zeros(world, dtype=torch.float64)
    rss[rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    packed = torch.cat([torch.tensor([loss_sum, tokens], dtype=torch.float64), aux, counts.flatten(), rss])
    dist.all_reduce(packed)
    # Tensor-parallel peers and pipeline stages hold the same samples (so the same loss sums), tensor-parallel
    # peers their own tokens' routes and their own part of each layer's load-balancing loss; data-parallel ranks
    # hold separate samples, context-parallel ranks separate tokens of the same samples.
    copies = parallel_state.get_tensor_model_parallel_world_size() * parallel_state.get_pipeline_model_parallel_world_size()
    loss_sum, tokens = (packed[:2] / copies).tolist()
    at = 2
    metrics = {"loss": loss_sum / tokens, "tokens": tokens}
    if len(aux):
        per_layer = packed[at : at + len(aux)] / (parallel_state.get_data_parallel_world_size() * num_micro_batches)
        # as Megatron reports it: 1.0 when balanced; dense layers (deepseek_v3's first_k_dense) record none
        metrics["moe_aux_loss"] = float(per_layer[per_layer > 0].mean())
        at += len(aux)
    if counts.numel():
        per_expert = packed[at : at + counts.numel()].view(counts.shape)
        mean = per_expert.mean(dim=1).clamp_min(1e-12)
        for layer in per_expert.sum(dim=1).nonzero().flatten().tolist():  # the MoE layers
            metrics[f"moe_max_over_mean_l{layer}"] = float(per_expert[layer].max() / mean[layer])
            metrics[f"moe_cv_l{layer}"] = float(per_expert[layer].std(unbiased=False) / mean[layer])
        at += counts.numel()
    metrics["peak_rss_mb"] = round(float(packed[at:].max()), 1)
    return metrics


def train_step(
    ddp, optimizer: TrainOptimizer, micro_batches: list[dict[str, torch.Tensor]], expert_load: ExpertLoad | None
) -> dict[str, float]:
    """One optimizer step on this rank's micro-batches (collective); the loss is the global batch's token mean.

    Gradients accumulate over the micro-batches; Megatron's DDP averages them over data parallelism. Megatron's
    routers add the load-balancing loss to the gradients themselves, scaled here like the main loss.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    started = time.perf_counter()
    ddp.train()
    optimizer.zero_grad()
    local_tokens = float(sum(b["loss_mask"].sum() for b in micro_batches))  # this rank's share under cp
    if _pipelined():
        # Megatron's schedule sets the load-balancing loss scale itself (into a [1] tensor: one set here first,
        # shaped [], would refuse it on a step that no pipelined evaluation preceded, as after --resume)
        loss_sum = forward_backward(ddp, micro_batches)  # the same loss and gradients, through the stages
    else:
        # Under cp each rank holds part of every sample: its losses (the main one and each router's load-balancing
        # part) are its parts of the replica's, times cp because Megatron's DDP averages gradients over dp x cp ranks.
        cp = parallel_state.get_context_parallel_world_size()
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(cp / len(micro_batches)))
        replica_tokens = torch.tensor([local_tokens], dtype=torch.float64)
        if cp > 1:
            dist.all_reduce(replica_tokens, group=parallel_state.get_context_parallel_group())
        scale = cp / float(replica_tokens[0])
        loss_sum = 0.0
        for batch in micro_batches:
            token_losses = _token_losses(ddp, batch)
            summed = (token_losses * batch["loss_mask"]).sum()
            (summed * scale).backward()
            loss_sum += float(summed.detach())
    update = optimizer.step()
    counts = expert_load.take() if expert_load is not None else torch.zeros(0, dtype=torch.float64)
    metrics = _reduce_step(loss_sum, local_tokens, _take_aux_losses(), counts, len(micro_batches))
    seconds = time.perf_counter() - started
    return {**metrics, **update, "step_seconds": seconds, "tokens_per_s": metrics["tokens"] / seconds}


@torch.no_grad()
def evaluate(ddp, source: BatchSource, num_batches: int) -> float:
    """Mean token loss over the first `num_batches` global batches of the held-out split (collective)."""
    from megatron.core import parallel_state

    ddp.eval()
    loss_sum = tokens = 0.0
    for index in range(num_batches):
        batches = source.micro_batches(index)
        if _pipelined():
            loss_sum += forward_backward(ddp, batches, forward_only=True)
        else:
            loss_sum += sum(float((_token_losses(ddp, batch) * batch["loss_mask"]).sum()) for batch in batches)
        tokens += sum(float(batch["loss_mask"].sum()) for batch in batches)
    sums = torch.tensor([loss_sum, tokens], dtype=torch.float64)
    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return float(sums[0] / sums[1])


# --- the loop ------------------------------------------------------------------------------------


@dataclass
class MidtrainData:
    train: BatchSource
    valid: BatchSource
    tokenizer_dir: Path


def prepare_batches(recipe: Recipe, run: RunDir) -> MidtrainData:
    """The blended datasets over the prepared corpus (`composer train midtrain` prepared it before the launch),
    sized for the whole run, on every rank."""
    from megatron.core import parallel_state

    from composer.trainer.datasets import build_gpt_datasets

    data, train = recipe.data, recipe.train
    prepared = PreparedData.read(run.root)
    num_samples = (train.steps * train.global_batch_size, train.eval_batches * train.global_batch_size, 0)
    datasets = build_gpt_datasets(
        prepared,
        seq_length=data.seq_length,
        split=data.split,
        seed=train.seed,
        num_samples=num_samples,
        index_cache_dir=run.root / "dataset-index",
    )
    if datasets.valid is None:
        raise UserError(f"data.split {list(data.split)} gives no validation share; evaluation needs one, e.g. [98, 2, 0]")
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    placement = None
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:  # the pipeline schedule takes the sample rows
        p = recipe.parallelism
        placement = BatchPlacement(
            data.attention,
            prepared.tokenizer.eod,
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_context_parallel_rank(),
            p.tp if p.sequence_parallel else 1,
        )
    batch = (train.global_batch_size, train.micro_batch_size, dp_rank, dp_size, placement)
    return MidtrainData(BatchSource(datasets.train, *batch), BatchSource(datasets.valid, *batch), prepared.tokenizer.directory)


BatchBuilder = Callable[[Recipe, RunDir], MidtrainData]
"""A loop's data: the corpus of mid-training (`prepare_batches`), or SFT's conversations (`trainer.sft`)."""


class Midtrainer:
    """One rank of a mid-training (or SFT: `label`, `batches`) run: the trainer core, the batches and the expert-load
    counters."""

    def __init__(
        self, recipe: Recipe, run: RunDir, console: Console | None, batches: BatchBuilder = prepare_batches, label: str = "midtrain"
    ):
        self.recipe, self.run_dir, self.console, self.label = recipe, run, console, label
        self.core = TrainerCore(recipe.model, recipe.parallelism, recipe.optim, recipe.train, run.checkpoints)
        self.data = batches(recipe, run)
        self.expert_load = ExpertLoad(self.core.model, recipe.model.num_experts) if recipe.model.is_moe else None

    def resume(self) -> int:
        """Restore the newest checkpoint; returns the number of steps already done (0 when there is none)."""
        state = self.core.resume()
        return int(state["step"]) if state else 0

    def run(self, first_step: int) -> None:
        t = self.recipe.train
        is_writer = dist.get_rank() == 0
        if is_writer:
            # a killed run's records past its checkpoint (all of them without one: step 0's evaluation is redone)
            drop_records_after(self.run_dir.metrics_path, first_step if first_step else -1)
        metrics = self.run_dir.metrics() if is_writer else None
        board = Trackers(self.run_dir.root, self.recipe.run.name, first_step) if is_writer else None
        eval_due, log_due, save_due = (Every(n, t.steps) for n in (t.eval_every, t.log_every, t.checkpoint_every))
        ddp = self.core.ddp
        try:
            with MidtrainProgress(self.console, t.steps, first_step, self.label) as progress:
                if first_step == 0:
                    self._log(metrics, board, 0, {"eval_loss": evaluate(ddp, self.data.valid, t.eval_batches)}, progress)
                for step in range(first_step + 1, t.steps + 1):
                    record = train_step(ddp, self.core.optimizer, self.data.train.micro_batches(step - 1), self.expert_load)
                    if eval_due(step):
                        record["eval_loss"] = evaluate(ddp, self.data.valid, t.eval_batches)
                    if log_due(step) or "eval_loss" in record:
                        # logged before the checkpoint: a run killed in between redoes this step and rewrites its record
                        self._log(metrics, board, step, record, progress)
                    if save_due(step):
                        self.core.save(step)
        finally:
            if metrics:
                metrics.close()
            if board:
                board.close()

    def _log(self, metrics, board, step: int, record: dict, progress: MidtrainProgress) -> None:
        if metrics is None:
            return
        metrics.write(step, **record)
        board.write(step, record)
        fields = {k: record[k] for k in ("loss", "eval_loss", "tokens_per_s") if k in record}
        progress.update(step, **fields)

    def export(self, out_dir: Path) -> None:
        self.core.export(out_dir, self.data.tokenizer_dir)


class MidtrainProgress:
    """Rank 0's view of the run: a rich bar with ETA on a terminal, a plain line now and then elsewhere."""

    def __init__(self, console: Console | None, total: int, done: int, label: str = "midtrain"):
        self.console, self.total, self.clock, self.label = console, total, StepClock(total, done), label
        self.fields = {"loss": math.nan, "eval_loss": math.nan, "tokens_per_s": 0.0}
        self.bar = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}  eval {task.fields[eval_loss]:.4f}  {task.fields[tokens_per_s]:.0f} tok/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            disable=console is None or not console.is_terminal,
            redirect_stdout=False,  # what libraries print stays in the rank's log
            redirect_stderr=False,
        )
        self.task = self.bar.add_task(label, total=total, completed=done, **self.fields)

    def __enter__(self) -> MidtrainProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def update(self, step: int, **fields: float) -> None:
        """The step's figures; an evaluation is also printed: above the bar, or as a plain line of its own."""
        self.fields.update(fields)
        self.bar.update(self.task, completed=step, **fields)
        if self.console is None:
            return
        evaluated = "eval_loss" in fields
        if not self.bar.disable:
            if evaluated:
                self.console.print(f"step {step}: eval loss {fields['eval_loss']:.4f}", highlight=False)
        elif step > self.clock.start_step and self.clock.plain_due(step, now_anyway=evaluated):
            f = self.fields
            self.console.print(
                f"{self.label} step {step}/{self.total}  loss {f['loss']:.4f}  eval {f['eval_loss']:.4f}  "
                f"{f['tokens_per_s']:.0f} tok/s  eta {self.clock.eta_text(step)}",
                highlight=False,
            )


# --- entry points ------------------------------------------------------------------------------


def train(run: RunDir, resume: bool, terminal: TextIO | None, batches: BatchBuilder = prepare_batches, label: str = "midtrain") -> None:
    recipe = load_recipe(run.recipe_path)
    console = Console(file=terminal, highlight=False) if terminal else None
    trainer = Midtrainer(recipe, run, console, batches, label)
    first_step = trainer.resume() if resume else 0
    trainer.run(first_step)
    export_dir = run.root / "export"
    if not export_dir.exists():
        trainer.export(export_dir)
    if console:
        console.print(f"[green]✓[/] exported {export_dir}", highlight=False)


def export(run: RunDir, out_dir: Path, tokenizer_dir: Path | str | None = None) -> None:
    """Export the newest checkpoint of a run as an HF checkpoint (with the prepared corpus's tokenizer unless given)."""
    recipe = load_recipe(run.recipe_path)
    tokenizer_dir = tokenizer_dir or PreparedData.read(run.root).tokenizer.directory
    if not export_checkpoint(recipe.model, recipe.parallelism, recipe.train, run.checkpoints, out_dir, tokenizer_dir):
        raise UserError(f"{run.root}: no checkpoint to export yet")


def dist_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str], train_run=train, export_run=export) -> int:
    """A rank's entry point: mid-training's loop and export, or another loop's (`trainer.sft`)."""
    die_with_parent(forks_too=True)
    command, run = argv[0], RunDir(Path(argv[1]))
    terminal = redirect_rank_output(run, dist_rank())
    try:
        if command == "train":
            train_run(run, resume="--resume" in argv[2:], terminal=terminal)
        else:
            export_run(run, Path(argv[2]))
    except UserError as e:
        record_rank_error(run, dist_rank(), str(e))
        return e.exit_code
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
