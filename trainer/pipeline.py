"""Pipeline parallelism: a training step through Megatron-Core's schedules (1F1B when pp > 1), on gloo as on NCCL.

Each pipeline stage holds a contiguous block of layers (`trainer.model.build_model` builds this rank's block, the
embedding on the first stage, the final norm and output layer on the last). `forward_backward` runs a step's
micro-batches through `megatron.core.pipeline_parallel.get_forward_backward_func()`: activations go stage to
stage, gradients come back, and only the last stage sees losses, which it then shares with the others.
The loss it back-propagates is that of `trainer.midtrain.train_step` (token sum over the rank's tokens), so a
pp=2 step equals a pp=1 step (same weights, same data) to rounding.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from composer.trainer.cpu_compat import cuda_calls_on_cpu
from composer.trainer.model import causal_mask


def _forward_step(local_tokens: float, num_micro_batches: int, data_iterator, model):
    batch = next(data_iterator)
    seq = batch["tokens"].shape[1]
    token_losses = model(batch["tokens"], batch["position_ids"], causal_mask(seq), labels=batch["labels"])
    return token_losses, partial(_loss, batch["loss_mask"], local_tokens, num_micro_batches)


def _loss(loss_mask: torch.Tensor, local_tokens: float, num_micro_batches: int, token_losses: torch.Tensor):
    summed = (token_losses * loss_mask).sum()
    # the schedule divides a (loss, stats) pair by the number of micro-batches; undone so that gradients are
    # those of sum(losses) / local_tokens, as in midtrain.train_step
    return summed * (num_micro_batches / local_tokens), {"summed": summed.detach()}


def forward_backward(ddp, micro_batches: list[dict[str, torch.Tensor]], *, forward_only: bool = False) -> float:
    """Forward (and backward unless `forward_only`) of this rank's micro-batches through the pipeline.

    micro_batches: dicts of tokens, labels, loss_mask, position_ids [micro_batch, seq] (midtrain's layout), the
    same on every stage of a pipeline. Returns the summed token loss of these micro-batches on every stage.
    Gradients accumulate in the DDP buffers; the optimizer step stays with the caller.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    local_tokens = float(sum(b["loss_mask"].sum() for b in micro_batches))
    micro_batch, seq = micro_batches[0]["tokens"].shape
    # the schedules allocate their token counters and p2p shape buffers with device="cuda"
    with cuda_calls_on_cpu():
        outputs = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, local_tokens, len(micro_batches)),
            data_iterator=iter(micro_batches),
            model=[ddp],
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=micro_batch,
            forward_only=forward_only,
        )
    summed = torch.tensor([float(sum(o["summed"] for o in outputs)) if outputs else 0.0], dtype=torch.float64)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(summed, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return float(summed[0])
