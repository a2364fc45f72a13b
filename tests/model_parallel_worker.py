"""torchrun worker for tests/test_model_parallel.py: the same HF checkpoint under several tp/ep splits.

For each split: full logits of a fixed batch, then one SGD step through Megatron's DDP and
finalize_model_grads, then the loss before and after the step. Rank 0 saves everything to OUT.
"""

import sys

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from recipes.schema import ParallelismSection
from trainer.distributed import init_distributed, shutdown_distributed
from trainer.model import build_model, causal_mask, forward_logits, model_section_from_hf
from trainer.weights import load_hf_into

SPLITS = {
    "tp1": ParallelismSection(),
    "tp2_sp": ParallelismSection(tp=2, sequence_parallel=True),
    "ep2": ParallelismSection(ep=2),
}
LR = 0.5


def run_split(m, p, checkpoint, tokens):
    init_distributed(p)
    model = build_model(m, p)
    load_hf_into(model, m, checkpoint)
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
    return {"logits": logits, "loss_before": loss_before.detach(), "loss_after": loss_after}


def main() -> None:
    checkpoint, out = sys.argv[1], sys.argv[2]
    m = model_section_from_hf(checkpoint).model_copy(update={"moe_token_dispatcher": sys.argv[3]})
    tokens = torch.randint(0, m.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    results = {name: run_split(m, p, checkpoint, tokens) for name, p in SPLITS.items()}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)
    shutdown_distributed()


if __name__ == "__main__":
    main()
