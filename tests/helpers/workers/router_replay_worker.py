"""torchrun worker for tests/integration/test_router_replay.py: router replay of engine routes under tp=2 (sequence parallel)
and ep=2, on 2 gloo processes.

tp=2 with ep=2 over the same two ranks too. Per layout: the learner (routers perturbed, so free routing differs from the engine's) runs once routing freely and
once replaying the engine's routes, then backward under replay. Each rank saves what its routers used, the
disagreement rates, its logprobs and its router-weight gradient norms.
Usage: router_replay_worker.py OUT_DIR CHECKPOINT ROLLOUTS_PT; each rank saves OUT_DIR/rank{r}.pt.
"""

import sys

import torch

from composer.recipes.schema import ParallelismSection
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.logprobs import pad_micro_batch, token_logprobs
from composer.trainer.model import build_model
from composer.trainer.router_replay import moe_routers, replay_for_micro_batch, routing, routing_disagreement
from composer.trainer.weights import load_hf_into

LAYOUTS = {
    "tp2_sp": ParallelismSection(tp=2, sequence_parallel=True),
    "ep2": ParallelismSection(ep=2),
    "tp2_sp_ep2": ParallelismSection(tp=2, ep=2, sequence_parallel=True),
}


def perturb_routers(model, seed: int = 7, scale: float = 0.1) -> None:
    """The same noise on every rank (routers are replicated): the learner's free routing then differs from the engine's."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, router in moe_routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * scale)


def run_layout(m, p, checkpoint, rollouts):
    init_distributed(p)
    model = build_model(m, p)
    load_hf_into(model, m, checkpoint)
    perturb_routers(model)
    model.train()
    # data parallel ranks (ep2: dp=2) take different sequences; tensor-parallel peers the same ones
    dp_rank = torch.distributed.get_rank() // p.tp
    dp_size = torch.distributed.get_world_size() // p.tp
    picked = [i for i in range(len(rollouts["tokens"])) if i % dp_size == dp_rank]
    tokens = [rollouts["tokens"][i] for i in picked]
    routes = [rollouts["routes"][i] for i in picked]
    batch = pad_micro_batch(tokens, multiple=p.tp)
    out = {"picked": picked}
    for name, mode in (("free", "off"), ("replay", "r3")):
        replay = replay_for_micro_batch(model, mode, routes, batch.layout)
        model.zero_grad()
        with routing(model, replay) as used:
            logprobs = token_logprobs(model, batch.tokens)
            logprobs.sum().backward()
        out[name] = {
            "routes": used.routes(),
            "disagreement": routing_disagreement(used.routes(), used.layers, routes, batch.layout),
            "own_disagreement": routing_disagreement(used.preferred(), used.layers, routes, batch.layout),
            "logprobs": logprobs.detach(),
            "router_grad_norms": [router.weight.grad.norm().item() for _, router in moe_routers(model)],
        }
    return out


def main() -> None:
    out_dir, checkpoint, rollouts_path = sys.argv[1:4]
    rollouts = torch.load(rollouts_path, weights_only=False)
    m = model_section_from_hf(checkpoint)
    results = {name: run_layout(m, p, checkpoint, rollouts) for name, p in LAYOUTS.items()}
    torch.save(results, f"{out_dir}/rank{torch.distributed.get_rank()}.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main()
