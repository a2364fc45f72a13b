"""torchrun worker for tests/integration/test_context_parallel.py: the same micro-batch under cp1 (tp1), cp2 and cp2 x tp2 on 4
gloo ranks, padded and packed, both families (fp32).

Every data-parallel replica gets the same sequences, so the reduced gradient is that of one micro-batch whatever
the layout. Per layout and packing: full-vocabulary logits and the learner's per-token logprobs of the whole
micro-batch (gathered from the context-parallel ranks), a loss over a mask, every weight's gradient after
Megatron's DDP reduction (gathered into HF tensors as an export gathers the weights) and the experts used, every
layout replaying the routes of a free cp1 pass (router replay under cp), the load-balancing loss included. Usage: context_parallel_worker.py OUT_DIR
CHECKPOINT...; rank 0 saves OUT_DIR/results.pt keyed by family, layout and packing.
"""

import sys

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from composer.recipes.schema import ParallelismSection
from composer.trainer import context_parallel
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.logprobs import layout_for, sequence_logprobs
from composer.trainer.model import build_model, causal_mask
from composer.trainer.optimizer import wrap_data_parallel
from composer.trainer.packing import stream_of
from composer.trainer.router_replay import replay_for_micro_batch, routing
from composer.trainer.weights import iter_hf_tensors, load_hf_into

LAYOUTS = {
    "cp1": ParallelismSection(),
    "cp2": ParallelismSection(cp=2),
    "cp2_tp2": ParallelismSection(cp=2, tp=2, sequence_parallel=True),
}
LENGTHS = [37, 20, 9]  # 37: not a multiple of 2*cp*tp = 8, so both layouts pad


def engine_routes(used, layout, num_layers: int) -> list[np.ndarray]:
    """The experts used, as an engine reports them per sequence ([n-1, all layers, top_k])."""
    stream = layout.stream(used.routes())
    full = torch.zeros(stream.shape[0], num_layers, stream.shape[-1], dtype=torch.int64)
    full[:, used.layers] = stream
    ends = np.cumsum(layout.lengths)
    return [full[end - n : end - 1].numpy() for end, n in zip(ends, layout.lengths)]


def run(m, p: ParallelismSection, checkpoint, sequences, packed: bool, routes):
    init_distributed(p)
    model = build_model(m, p)
    load_hf_into(model, m, checkpoint)
    ddp = wrap_data_parallel(model, p)
    ddp.zero_grad_buffer()
    layout = layout_for(ddp, LENGTHS, packed)
    replay = replay_for_micro_batch(ddp, "r3", [r.numpy() for r in routes], layout) if routes is not None else None
    # DDP averages over dp x cp: every cp rank computes the whole loss (its backward reaching its own tokens) and
    # its part of each router's load-balancing loss, so both count cp times
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(p.cp)))
    with routing(ddp, replay) as used:
        logprobs = sequence_logprobs(ddp, layout, sequences)
        mask = torch.zeros_like(logprobs)
        for b, n in enumerate(LENGTHS):
            mask[b, n // 4 : n - 1] = 1.0
        loss = -(logprobs * mask).sum() / mask.sum()
        (loss * p.cp).backward()
    recorded = engine_routes(used, layout, m.num_layers)
    finalize_model_grads([ddp])  # as TrainOptimizer.step reduces them
    logits = full_logits(ddp, layout, sequences, replay)
    for param in model.parameters():
        param.data.copy_(param.main_grad)  # gathered below as an export gathers weights
    grads = {name: t.clone() for name, t in iter_hf_tensors(model, m)}
    return {
        "logits": logits,
        "logprobs": logprobs.detach(),
        "loss": float(loss),
        "grads": grads,
        "routes": [torch.from_numpy(r) for r in recorded],
        "rows": layout.shape,
    }


def full_logits(ddp, layout, sequences, replay) -> torch.Tensor:
    tokens = layout.local(stream_of(sequences))
    with torch.no_grad(), routing(ddp, replay):
        logits = ddp(
            tokens,
            layout.position_ids,
            None if layout.packed else causal_mask(tokens.shape[1]),
            runtime_gather_output=True,
            packed_seq_params=layout.packed_seq_params(),
        )
    return layout.padded(layout.stream(logits))


def main() -> None:
    out, checkpoints = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    context_parallel.TILE_BYTES = 0  # the smallest query tiles: several per block, so tiling and its key ranges are exercised
    results = {}
    for checkpoint in checkpoints:
        m = model_section_from_hf(checkpoint)
        rng = np.random.default_rng(0)
        sequences = [rng.integers(1, m.vocab_size, n) for n in LENGTHS]
        results[m.family] = {}
        for packed in (False, True):
            routes = run(m, LAYOUTS["cp1"], checkpoint, sequences, packed, None)["routes"]  # free routes, as an engine's
            for name, p in LAYOUTS.items():
                results[m.family][name, packed] = run(m, p, checkpoint, sequences, packed, routes)
    if dist.get_rank() == 0:
        torch.save(results, f"{out}/results.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main()
