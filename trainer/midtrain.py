"""Mid-training (continued pre-training) on code tokens: one process per rank under torchrun.

    python -m trainer.midtrain train RUN_DIR [--resume]     (started by `composer train midtrain`)
    python -m trainer.midtrain export RUN_DIR OUT_DIR       (started by `composer export`)

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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from recipes.checks import refuse_resume_changes, refuse_unhonoured
from recipes.errors import UserError
from recipes.loader import load_recipe
from recipes.processes import die_with_parent
from recipes.runs import RunDir, drop_records_after
from recipes.schema import Recipe
from trainer.checkpointing import LAYOUT_KEYS, Checkpointer, check_layout
from trainer.distributed import init_distributed, shutdown_distributed
from trainer.launch import record_rank_error, redirect_rank_output
from trainer.model import ARCHITECTURE_FIELDS, build_model, causal_mask
from trainer.optimizer import TrainOptimizer, wrap_data_parallel
from trainer.weights import export_hf, load_hf_into

UNHONOURED = {
    "parallelism.pp": "pipeline parallelism is not wired into the loop",
    "parallelism.cp": "context parallelism is not wired into the loop",
    "rollout": "a midtrain run has no rollout engines (an RL recipe?)",
    "env": "a midtrain run has no environments (an RL recipe?)",
    "rl": "a midtrain run has no RL objective (an RL recipe?)",
    "sync": "midtrain exports an HF checkpoint at the end; it does not push weight versions",
}


def check_midtrain_recipe(recipe: Recipe) -> None:
    """Refuse what the loop cannot honour, before anything launches."""
    refuse_unhonoured(recipe, "train midtrain", UNHONOURED)
    if recipe.data is None:
        raise UserError("train midtrain: the recipe has no data section; add data.sources and data.seq_length")


RESUME_FIXED = ("data.sources", "data.tokenizer", "data.seq_length", "data.split", "train.steps", "train.global_batch_size", "train.eval_batches", "train.seed")
"""What decides the sample order (Megatron's shuffle depends on the number of samples) and the evaluation set."""


def check_resume(run: RunDir, recipe: Recipe) -> None:
    """Refuse a resume whose recipe does not fit the run's checkpoints or would change its data order."""
    if not run.recipe_path.is_file():
        return  # RunDir.prepare reports the missing run
    refuse_resume_changes(load_recipe(run.recipe_path), recipe, [*RESUME_FIXED, *(f"model.{key}" for key in ARCHITECTURE_FIELDS)],
                          str(run.recipe_path), "the run's checkpoints and data order")
    latest = Checkpointer(run.checkpoints, recipe.train.keep_checkpoints).latest()
    if latest is not None:
        check_layout(latest, {k: getattr(recipe.parallelism, k) for k in LAYOUT_KEYS})


# --- data ----------------------------------------------------------------------------------------


class BatchSource:
    """This data-parallel rank's micro-batches of global batch `index` of a dataset (a pure function of `index`)."""

    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int):
        self.dataset = dataset
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.per_rank = global_batch // dp_size
        self.dp_rank = dp_rank

    @property
    def num_micro_batches(self) -> int:
        return self.per_rank // self.micro_batch

    def micro_batches(self, index: int) -> list[dict[str, torch.Tensor]]:
        first = index * self.global_batch + self.dp_rank * self.per_rank
        out = []
        for m in range(self.num_micro_batches):
            samples = [self.dataset[first + m * self.micro_batch + i] for i in range(self.micro_batch)]
            out.append({key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in ("tokens", "labels", "loss_mask", "position_ids")})
        return out


# --- one step ------------------------------------------------------------------------------------


class ExpertLoad:
    """Counts the tokens each router sends to each expert during training forwards (hooks on Megatron's routers)."""

    def __init__(self, model, num_experts: int):
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.counts = torch.zeros(len(routers), num_experts, dtype=torch.float64)
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))

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


def _token_losses(ddp, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    seq = batch["tokens"].shape[1]
    return ddp(batch["tokens"], batch["position_ids"], causal_mask(seq), labels=batch["labels"])


def _take_aux_losses() -> torch.Tensor:
    """This rank's part of Megatron's load-balancing loss per layer, summed over the step's micro-batches."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
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
    # pp == cp == 1: tensor-parallel peers hold the same samples (so the same loss sums) but their own tokens' routes
    # and their own part of each layer's load-balancing loss; data-parallel ranks hold separate samples.
    loss_sum, tokens = (packed[:2] / parallel_state.get_tensor_model_parallel_world_size()).tolist()
    at = 2
    metrics = {"loss": loss_sum / tokens, "tokens": tokens}
    if len(aux):
        per_layer = packed[at : at + len(aux)] / (parallel_state.get_data_parallel_world_size() * num_micro_batches)
        metrics["moe_aux_loss"] = float(per_layer.mean())  # as Megatron reports it: 1.0 when balanced
        at += len(aux)
    if counts.numel():
        per_expert = packed[at : at + counts.numel()].view(counts.shape)
        mean = per_expert.mean(dim=1).clamp_min(1e-12)
        for layer in range(per_expert.shape[0]):
            metrics[f"moe_max_over_mean_l{layer}"] = float(per_expert[layer].max() / mean[layer])
            metrics[f"moe_cv_l{layer}"] = float(per_expert[layer].std(unbiased=False) / mean[layer])
        at += counts.numel()
    metrics["peak_rss_mb"] = round(float(packed[at:].max()), 1)
    return metrics


def train_step(ddp, optimizer: TrainOptimizer, micro_batches: list[dict[str, torch.Tensor]], expert_load: ExpertLoad | None) -> dict[str, float]:
    """One optimizer step on this rank's micro-batches (collective); the loss is the global batch's token mean.

    Gradients accumulate over the micro-batches; Megatron's DDP averages them over data parallelism. Megatron's
    routers add the load-balancing loss to the gradients themselves, scaled here like the main loss.
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    started = time.perf_counter()
    ddp.train()
    optimizer.zero_grad()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / len(micro_batches)))
    local_tokens = float(sum(b["loss_mask"].sum() for b in micro_batches))
    loss_sum = 0.0
    for batch in micro_batches:
        token_losses = _token_losses(ddp, batch)
        summed = (token_losses * batch["loss_mask"]).sum()
        (summed / local_tokens).backward()
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
        for batch in source.micro_batches(index):
            loss_sum += float((_token_losses(ddp, batch) * batch["loss_mask"]).sum())
            tokens += float(batch["loss_mask"].sum())
    sums = torch.tensor([loss_sum, tokens], dtype=torch.float64)
    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    return float(sums[0] / sums[1])


# --- the loop ------------------------------------------------------------------------------------


@dataclass
class MidtrainData:
    train: BatchSource
    valid: BatchSource
    tokenizer_dir: Path


def prepare_batches(recipe: Recipe, run: RunDir, console: Console | None) -> MidtrainData:
    """Tokenize on rank 0 (others wait), then build the blended datasets sized for the whole run on every rank."""
    from megatron.core import parallel_state

    from trainer.data import prepare_data
    from trainer.datasets import build_gpt_datasets

    data, train = recipe.data, recipe.train
    args = dict(model_checkpoint=recipe.model.checkpoint, model_vocab_size=recipe.model.vocab_size)
    if dist.get_rank() == 0:
        prepared = prepare_data(data, console=console, **args)
    dist.barrier()
    if dist.get_rank() != 0:
        prepared = prepare_data(data, **args)  # a cache hit: reads manifests only
    num_samples = (train.steps * train.global_batch_size, train.eval_batches * train.global_batch_size, 0)
    datasets = build_gpt_datasets(
        prepared, seq_length=data.seq_length, split=data.split, seed=train.seed, num_samples=num_samples,
        index_cache_dir=run.root / "dataset-index",
    )
    if datasets.valid is None:
        raise UserError(f"data.split {list(data.split)} gives no validation share; evaluation needs one, e.g. [98, 2, 0]")
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    batch = (train.global_batch_size, train.micro_batch_size, dp_rank, dp_size)
    return MidtrainData(BatchSource(datasets.train, *batch), BatchSource(datasets.valid, *batch), prepared.tokenizer.directory)


class Midtrainer:
    """One rank of a mid-training run."""

    def __init__(self, recipe: Recipe, run: RunDir, console: Console | None):
        self.recipe, self.run_dir, self.console = recipe, run, console
        p = recipe.parallelism
        init_distributed(p, seed=recipe.train.seed)
        self.data = prepare_batches(recipe, run, console)
        torch.manual_seed(recipe.train.seed)  # random initialisation is a function of the seed
        self.model = build_model(recipe.model, p, recipe.train.recompute_activations)
        if recipe.model.checkpoint:
            load_hf_into(self.model, recipe.model, recipe.model.checkpoint)
        self.ddp = wrap_data_parallel(self.model, p)
        self.optimizer = TrainOptimizer(self.ddp, recipe.optim, p, recipe.train.steps, getattr(torch, recipe.model.dtype))
        self.checkpointer = Checkpointer(run.checkpoints, recipe.train.keep_checkpoints)
        self.layout = {k: getattr(p, k) for k in LAYOUT_KEYS}
        self.expert_load = ExpertLoad(self.model, recipe.model.num_experts) if recipe.model.is_moe else None

    def resume(self) -> int:
        """Restore the newest checkpoint; returns the number of steps already done (0 when there is none)."""
        latest = self.checkpointer.latest()
        if latest is None:
            return 0
        return int(self.checkpointer.load(latest, self.model, self.optimizer, self.layout)["step"])

    def save(self, step: int) -> None:
        self.checkpointer.save(step, self.model, self.optimizer, {"layout": self.layout})

    def run(self, first_step: int) -> None:
        t = self.recipe.train
        is_writer = dist.get_rank() == 0
        if is_writer:
            # a killed run's records past its checkpoint (all of them without one: step 0's evaluation is redone)
            drop_records_after(self.run_dir.metrics_path, first_step if first_step else -1)
        metrics = self.run_dir.metrics() if is_writer else None
        board = _tensorboard(self.run_dir, first_step) if is_writer else None
        try:
            with _progress(self.console, t.steps, first_step) as progress:
                if first_step == 0:
                    self._log(metrics, board, 0, {"eval_loss": evaluate(self.ddp, self.data.valid, t.eval_batches)}, progress)
                for step in range(first_step + 1, t.steps + 1):
                    record = train_step(self.ddp, self.optimizer, self.data.train.micro_batches(step - 1), self.expert_load)
                    if self._due(step, t.eval_every):
                        record["eval_loss"] = evaluate(self.ddp, self.data.valid, t.eval_batches)
                    if self._due(step, t.log_every) or "eval_loss" in record:
                        # logged before the checkpoint: a run killed in between redoes this step and rewrites its record
                        self._log(metrics, board, step, record, progress)
                    if self._due(step, t.checkpoint_every):
                        self.save(step)
        finally:
            if metrics:
                metrics.close()
            if board:
                board.close()

    def _due(self, step: int, every: int) -> bool:
        return step % every == 0 or step == self.recipe.train.steps

    def _log(self, metrics, board, step: int, record: dict, progress: Progress) -> None:
        if metrics is None:
            return
        metrics.write(step, **record)
        for key, value in record.items():
            board.add_scalar(key, value, step)
        board.flush()
        fields = {k: record[k] for k in ("loss", "eval_loss", "tokens_per_s") if k in record}
        progress.update(progress.task_ids[0], completed=step, **fields)
        if "eval_loss" in record and self.console is not None:
            self.console.print(f"step {step}: eval loss {record['eval_loss']:.4f}", highlight=False)

    def export(self, out_dir: Path) -> None:
        export_hf(self.model, self.recipe.model, out_dir, tokenizer_dir=self.data.tokenizer_dir)


def _tensorboard(run: RunDir, first_step: int):
    from torch.utils.tensorboard import SummaryWriter

    # purge_step hides the events a killed run wrote past the checkpoint it resumes from
    return SummaryWriter(str(run.root / "tensorboard"), purge_step=first_step + 1 if first_step else None)


def _progress(console: Console | None, total: int, done: int) -> Progress:
    progress = Progress(
        TextColumn("[bold]midtrain"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  eval {task.fields[eval_loss]:.4f}  {task.fields[tokens_per_s]:.0f} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=console is None,
    )
    progress.add_task("midtrain", total=total, completed=done, loss=math.nan, eval_loss=math.nan, tokens_per_s=0.0)
    return progress


# --- entry points ------------------------------------------------------------------------------


def train(run: RunDir, resume: bool) -> None:
    recipe = load_recipe(run.recipe_path)
    console = Console() if dist_rank() == 0 else None
    trainer = Midtrainer(recipe, run, console)
    first_step = trainer.resume() if resume else 0
    trainer.run(first_step)
    export_dir = run.root / "export"
    if not export_dir.exists():
        trainer.export(export_dir)
    if console:
        console.print(f"[green]✓[/] exported {export_dir}", highlight=False)


def export(run: RunDir, out_dir: Path) -> None:
    """Export the newest checkpoint of a run as an HF checkpoint."""
    recipe = load_recipe(run.recipe_path)
    init_distributed(recipe.parallelism, seed=recipe.train.seed)
    checkpointer = Checkpointer(run.checkpoints, recipe.train.keep_checkpoints)
    latest = checkpointer.latest()
    if latest is None:
        raise UserError(f"{run.root}: no checkpoint to export yet")
    model = build_model(recipe.model, recipe.parallelism)
    checkpointer.load_model(latest, model, {k: getattr(recipe.parallelism, k) for k in LAYOUT_KEYS})
    from trainer.data import load_tokenizer

    tokenizer = load_tokenizer(recipe.data, recipe.model.checkpoint, recipe.model.vocab_size)
    export_hf(model, recipe.model, out_dir, tokenizer_dir=tokenizer.directory)


def dist_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str]) -> int:
    die_with_parent()
    command, run = argv[0], RunDir(Path(argv[1]))
    redirect_rank_output(run, dist_rank())
    try:
        if command == "train":
            train(run, resume="--resume" in argv[2:])
        else:
            export(run, Path(argv[2]))
    except UserError as e:
        record_rank_error(run, dist_rank(), str(e))
        return e.exit_code
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
