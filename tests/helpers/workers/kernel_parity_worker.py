"""Grouped-GEMM experts + SDPA attention against SequentialMLP + Megatron's local attention, same weights, fp32.

`kernel_parity` loads one HF checkpoint into both builds of one layout and runs a forward and backward of the
same batch in each, routing freely, then the fast build once more replaying the baseline's routes. It returns
the largest differences (logprobs, every parameter's gradient) and the routing disagreements.
As a torchrun worker: kernel_parity_worker.py OUT_DIR CHECKPOINT...; each rank saves OUT_DIR/rank{r}.pt with
{family: {layout: result}} for the layouts below.
"""

import sys

import numpy as np
import torch

from composer.recipes.schema import KernelsSection, ParallelismSection
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.logprobs import pad_micro_batch, token_logprobs
from composer.trainer.model import build_model
from composer.trainer.router_replay import replay_for_micro_batch, routing
from composer.trainer.weights import load_hf_into

BASELINE = KernelsSection(experts="sequential", attention="local")
FAST = KernelsSection(experts="grouped", attention="sdpa")
LAYOUTS = {
    "tp2_sp": ParallelismSection(tp=2, sequence_parallel=True),
    "ep2": ParallelismSection(ep=2),
    "tp2_sp_ep2": ParallelismSection(tp=2, ep=2, sequence_parallel=True),
}


def _run(model, tokens, replay=None):
    model.zero_grad()
    with routing(model, replay) as used:
        logprobs = token_logprobs(model, tokens)
        logprobs.sum().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    return logprobs.detach(), grads, used


def _engine_routes(used, num_layers: int, seq_len: int) -> list[np.ndarray]:
    """What the routers used, as the engine reports it per sequence ([S-1, all layers, top_k])."""
    routes = used.routes()
    full = torch.zeros(routes.shape[0], seq_len, num_layers, routes.shape[-1], dtype=torch.int64)
    full[:, :, used.layers] = routes
    return [seq[: seq_len - 1].numpy() for seq in full]


def kernel_parity(m, p: ParallelismSection, checkpoint, tokens: torch.Tensor) -> dict:
    models = {}
    for name, kernels in (("baseline", BASELINE), ("fast", FAST)):
        built = m.model_copy(update={"kernels": kernels})
        model = build_model(built, p)
        load_hf_into(model, built, checkpoint)
        models[name] = model.train()
    assert (models["fast"].kernels.experts, models["fast"].kernels.attention) == ("grouped", "sdpa")
    batch = pad_micro_batch(list(tokens.numpy()), multiple=p.tp if p.sequence_parallel else 1)
    base_lp, base_grads, base_used = _run(models["baseline"], batch.tokens)
    fast_lp, fast_grads, fast_used = _run(models["fast"], batch.tokens)
    assert base_grads.keys() == fast_grads.keys() and base_grads
    recorded = _engine_routes(base_used, m.num_layers, batch.seq_len)
    replay = replay_for_micro_batch(models["fast"], "r3", recorded, batch.layout)
    _, _, replayed = _run(models["fast"], batch.tokens, replay)
    used = _engine_routes(replayed, m.num_layers, batch.seq_len)
    return {
        "logprob_max_diff": float((base_lp - fast_lp).abs().max()),
        "grad_max_diff": max(float((base_grads[k] - fast_grads[k]).abs().max()) for k in base_grads),
        "grad_max": max(float(g.abs().max()) for g in base_grads.values()),
        "free_route_mismatches": int((base_used.routes() != fast_used.routes()).sum()),
        "replayed_route_mismatches": sum(int((u != r).sum()) for u, r in zip(used, recorded)),
        "routes_compared": sum(r.size for r in recorded),
    }


def main() -> None:
    out, checkpoints = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    results = {}
    for checkpoint in checkpoints:
        m = model_section_from_hf(checkpoint)
        tokens = torch.randint(1, m.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        results[m.family] = {}
        for name, p in LAYOUTS.items():
            init_distributed(p)
            results[m.family][name] = kernel_parity(m, p, checkpoint, tokens)
    torch.save(results, f"{out}/rank{torch.distributed.get_rank()}.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main()
