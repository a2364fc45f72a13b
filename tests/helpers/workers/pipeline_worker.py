"""torchrun worker for tests/integration/test_pipeline.py: one training step at pp=1 and at pp=2 on 2 gloo processes.

pp=1 runs the 2 ranks as data-parallel replicas fed the same micro-batches (so the step equals a single
process's); pp=2 splits the layers over them. Per layout, through trainer.pipeline.forward_backward (Megatron's
schedules): the step's summed loss, one SGD step on the reduced gradients, the loss after it and the updated weights,
and an HF export gathered from both stages.
Usage: pipeline_worker.py OUT_DIR CHECKPOINT...; rank 0 saves OUT_DIR/results.pt keyed by family and layout.
"""

import sys

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from composer.recipes.schema import ParallelismSection
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.model import build_model
from composer.trainer.pipeline import forward_backward
from composer.trainer.weights import export_hf, iter_hf_tensors, load_hf_into

LAYOUTS = {"pp1": ParallelismSection(), "pp2": ParallelismSection(pp=2)}
LR = 0.5


def micro_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):  # more micro-batches than stages: the 1F1B schedule has a steady phase
        tokens = torch.randint(0, vocab, (2, 33), generator=generator)
        mask = torch.ones(2, 32)
        mask[1, 20:] = 0  # a padded tail
        batches.append(
            {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask, "position_ids": torch.arange(32).expand(2, 32)}
        )
    return batches


def run_layout(m, p, checkpoint, export_dir):
    init_distributed(p)
    model = build_model(m, p)
    load_hf_into(model, m, checkpoint)
    export_hf(model, m, export_dir)
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
        module=model,
    )
    batches = micro_batches(m.vocab_size)
    ddp.zero_grad_buffer()
    loss_before = forward_backward(ddp, batches)
    ddp.finish_grad_sync()
    with torch.no_grad():
        for param in ddp.parameters():
            param.add_(param.main_grad, alpha=-LR)
    loss_after = forward_backward(ddp, batches, forward_only=True)
    weights_after = {name: tensor.clone() for name, tensor in iter_hf_tensors(model, m)}
    return {"loss_before": loss_before, "loss_after": loss_after, "weights_after": weights_after, "rank0_layers": len(model.decoder.layers)}


def main() -> None:
    out, checkpoints = sys.argv[1], sys.argv[2:]
    results = {}
    for checkpoint in checkpoints:
        m = model_section_from_hf(checkpoint)
        results[m.family] = {name: run_layout(m, p, checkpoint, f"{out}/export-{m.family}-{name}") for name, p in LAYOUTS.items()}
    if torch.distributed.get_rank() == 0:
        torch.save(results, f"{out}/results.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main()
