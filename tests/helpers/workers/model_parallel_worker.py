"""torchrun worker for tests/integration/test_model_engines.py: the same HF checkpoints under several tp/ep splits.

For each split: full logits of a fixed batch, an HF export of the loaded weights, then one SGD step through
Megatron's DDP and finalize_model_grads: the loss before and after the step and the updated weights.
Usage: model_parallel_worker.py OUT_DIR CHECKPOINT...; MoE checkpoints run MOE_SPLITS, dense ones DENSE_SPLITS;
rank 0 saves OUT_DIR/results.pt, keyed by family.
"""

import sys

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from composer.recipes.schema import ParallelismSection
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.model import build_model, causal_mask, forward_logits
from composer.trainer.weights import export_hf, iter_hf_tensors, load_hf_into

# name -> (parallel sizes, MoE token dispatcher)
MOE_SPLITS = {
    "tp1": (ParallelismSection(), "alltoall"),
    "tp2_sp": (ParallelismSection(tp=2, sequence_parallel=True), "alltoall"),
    "ep2": (ParallelismSection(ep=2), "alltoall"),
    "ep2_allgather": (ParallelismSection(ep=2), "allgather"),
    "tp2_sp_ep2": (ParallelismSection(tp=2, ep=2, sequence_parallel=True), "alltoall"),
}
DENSE_SPLITS = {
    "tp1": (ParallelismSection(), "alltoall"),
    "tp2": (ParallelismSection(tp=2), "alltoall"),
}
LR = 0.5


def run_split(m, p, checkpoint, tokens, export_dir):
    init_distributed(p)
    model = build_model(m, p)
    load_hf_into(model, m, checkpoint)
    export_hf(model, m, export_dir)
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
        module=model,
    )
    batch, seq = tokens.shape
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(seq - 1).expand(batch, seq - 1)
    with torch.no_grad():
        logits = forward_logits(ddp, inputs)
    ddp.zero_grad_buffer()
    loss_before = ddp(inputs, position_ids, causal_mask(seq - 1), labels=labels).mean()
    loss_before.backward()
    finalize_model_grads([ddp])
    with torch.no_grad():
        for param in ddp.parameters():
            param.add_(param.main_grad, alpha=-LR)
        loss_after = ddp(inputs, position_ids, causal_mask(seq - 1), labels=labels).mean()
        weights_after = {name: tensor.clone() for name, tensor in iter_hf_tensors(model, m)}
    return {"logits": logits, "loss_before": loss_before.detach(), "loss_after": loss_after, "weights_after": weights_after}


def main() -> None:
    out, checkpoints = sys.argv[1], sys.argv[2:]
    results = {}
    for checkpoint in checkpoints:
        m = model_section_from_hf(checkpoint)
        splits = MOE_SPLITS if m.is_moe else DENSE_SPLITS
        tokens = torch.randint(0, m.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
        results[m.family] = {
            name: run_split(
                m.model_copy(update={"moe_token_dispatcher": dispatcher}), p, checkpoint, tokens, f"{out}/export-{m.family}-{name}"
            )
            for name, (p, dispatcher) in splits.items()
        }
    if torch.distributed.get_rank() == 0:
        torch.save(results, f"{out}/results.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main()
