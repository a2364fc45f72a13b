"""torchrun worker (2 gloo ranks) for tests/integration/test_muon.py: Megatron's Muon under tensor and expert parallelism (in
mid-training steps and in RL learner steps), and QK-clip on grouped-query (llama) and latent (deepseek_v3)
attention at tp=2.

Usage: python -m torch.distributed.run --nproc-per-node 2 -m tests.helpers.workers.muon_parallel OUT_DIR
Every split starts from the same weights (a seeded tp=1 model exported as an HF checkpoint). tp=1 runs as two
data-parallel replicas of the same batch, which is one rank's update. Rank 0 saves OUT_DIR/results.pt.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from composer.recipes.loader import load_recipe
from composer.recipes.schema import ModelSection, MuonSection, OptimSection, ParallelismSection, RLSection, TrainSection
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.model import build_model, causal_mask
from composer.trainer.optimizer import TrainOptimizer, wrap_data_parallel
from composer.trainer.rl_learner import LearnerSequence, RLLearner
from composer.trainer.weights import export_hf, iter_hf_tensors, load_hf_into

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
MUON_SPLITS = {
    "tp1": ParallelismSection(),
    "tp2_sp": ParallelismSection(tp=2, sequence_parallel=True),
    "ep2": ParallelismSection(ep=2),
}
MUON_STEPS = 3
BATCH, SEQ = 4, 64


def tiny_models() -> dict[str, ModelSection]:
    moe = load_recipe(RECIPES / "smoke-midtrain.yaml").model
    llama = moe.model_copy(update=dict(family="llama", num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0, ffn_hidden_size=256))
    return {"qwen3_moe": moe, "llama": llama, "deepseek_v3": load_recipe(RECIPES / "smoke-deepseek-v3-midtrain.yaml").model}


def initial_checkpoint(m: ModelSection, out: Path) -> Path:
    init_distributed(ParallelismSection(), seed=0)
    torch.manual_seed(0)
    export_hf(build_model(m, ParallelismSection()), m, out)
    dist.barrier()
    return out


def batch(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))


def train_step(ddp, optimizer: TrainOptimizer, tokens: torch.Tensor) -> dict[str, float]:
    ddp.train()
    optimizer.zero_grad()
    inputs = tokens[:, :-1]
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    ddp(inputs, position_ids, causal_mask(SEQ), labels=tokens[:, 1:]).mean().backward()
    return optimizer.step()


def build(m: ModelSection, p: ParallelismSection, checkpoint: Path, optim: OptimSection):
    init_distributed(p, seed=0)
    model = build_model(m, p, qk_clip=optim.qk_clip)
    load_hf_into(model, m, checkpoint)
    ddp = wrap_data_parallel(model, p)
    return model, ddp, TrainOptimizer(ddp, optim, p, total_steps=10, dtype=torch.float32)


def hf_weights(model, m: ModelSection) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in iter_hf_tensors(model, m)}


def exact_muon() -> OptimSection:
    # fp32 Newton-Schulz: in bf16 one split's update differs from another's by bf16 rounding. The Adam part (embedding,
    # output layer, norms) at eps 1e-4: the splits' gradients differ by rounding (~1e-8), which moves an Adam weight by
    # up to lr * 1e-8 / (4 eps) a step, 5e-7 here; at eps 1e-8 Adam would turn it into steps of lr's size.
    return OptimSection(name="muon", lr=0.02, weight_decay=0.1, eps=1e-4, muon=MuonSection(matmul_precision="highest"))


def muon_updates(m: ModelSection, checkpoint: Path) -> dict:
    """Each split's weights after MUON_STEPS Muon steps; the initial ones too."""
    out = {}
    for name, p in MUON_SPLITS.items():
        model, ddp, optimizer = build(m, p, checkpoint, exact_muon())
        if name == "tp1":
            out["initial"] = hf_weights(model, m)
        for step in range(MUON_STEPS):
            train_step(ddp, optimizer, batch(step, m.vocab_size))
        out[name] = hf_weights(model, m)
    return out


def learner_sequences(step: int, vocab: int) -> list[LearnerSequence]:
    """Four trajectories of different lengths: the prompt's 8 tokens untrained, the answer's trained."""
    generator = np.random.default_rng(step)
    out = []
    for i, length in enumerate((40, 33, 48, 25)):
        mask = np.arange(length) >= 8
        logprobs = np.where(mask, -generator.uniform(1.0, 3.0, length), 0.0).astype(np.float32)
        out.append(
            LearnerSequence(generator.integers(0, vocab, length), mask, logprobs, advantage=(-1.0) ** i, routes=None, episode=str(i))
        )
    return out


def rl_learner_updates(m: ModelSection, checkpoint: Path, root: Path) -> dict:
    """The RL learner's weights after MUON_STEPS policy-gradient steps with Muon at tp=1 and at ep=2 (each the batch
    split over two data-parallel ranks), starting from the checkpoint."""
    m = m.model_copy(update={"checkpoint": str(checkpoint)})
    out = {}
    for name in ("tp1", "ep2"):
        learner = RLLearner(
            m,
            MUON_SPLITS[name],
            exact_muon(),
            TrainSection(steps=10, global_batch_size=4, micro_batch_size=2),
            RLSection(router_replay="off"),
            root / f"rl-checkpoints-{name}",
        )
        out[f"loss_{name}"] = [learner.train_step(learner_sequences(step, m.vocab_size))["loss"] for step in range(MUON_STEPS)]
        out[name] = hf_weights(learner.core.model, m)
    return out


def head_maxima(ddp) -> torch.Tensor:
    """The largest logit per head, all layers and tensor-parallel ranks [layers, heads] (as recorded, before clipping)."""
    from megatron.core import parallel_state

    local = torch.stack([layer.self_attention.core_attention.current_max_attn_logits for layer in ddp.module.decoder.layers])
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
    shards = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, local, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=1)


def step_recording_maxima(ddp, optimizer: TrainOptimizer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    ddp.train()
    optimizer.zero_grad()
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    ddp(tokens[:, :-1], position_ids, causal_mask(SEQ), labels=tokens[:, 1:]).mean().backward()
    maxima = head_maxima(ddp)
    return maxima, optimizer.step()


def qk_clip(m: ModelSection, checkpoint: Path) -> dict:
    """Two steps on one batch with an (almost) frozen optimizer: per-head maxima of both, the logged maximum, and
    the weights after one step with a threshold above every logit against those without QK-clip."""
    p = ParallelismSection(tp=2, sequence_parallel=m.is_moe)
    frozen = dict(lr=1e-12, warmup_steps=0, weight_decay=0.0)
    tokens = batch(0, m.vocab_size)
    out = {}
    model, ddp, optimizer = build(m, p, checkpoint, OptimSection(**frozen))
    train_step(ddp, optimizer, tokens)
    out["unclipped"] = hf_weights(model, m)
    model, ddp, optimizer = build(m, p, checkpoint, OptimSection(**frozen, qk_clip=1e6))
    out["maxima_before"], metrics = step_recording_maxima(ddp, optimizer, tokens)
    out["logged_before"] = metrics["max_attention_logit"]
    out["threshold_above"] = hf_weights(model, m)
    # between the first layer's KV groups (GQA; MLA: heads): some are clipped, some not
    group_maxima = out["maxima_before"][0].view(-1, m.num_attention_heads // m.num_kv_heads).amax(dim=1)
    threshold = float(group_maxima.min() + group_maxima.max()) / 2
    model, ddp, optimizer = build(m, p, checkpoint, OptimSection(**frozen, qk_clip=threshold))
    step_recording_maxima(ddp, optimizer, tokens)
    out["maxima_after"], _ = step_recording_maxima(ddp, optimizer, tokens)
    out["threshold"] = threshold
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    models = tiny_models()
    results = {}
    checkpoint = initial_checkpoint(models["qwen3_moe"], out_dir / "init-qwen3_moe")
    results["muon"] = muon_updates(models["qwen3_moe"], checkpoint)
    results["rl_learner"] = rl_learner_updates(models["qwen3_moe"], checkpoint, out_dir)
    for family in ("llama", "deepseek_v3"):
        results[f"qk_clip_{family}"] = qk_clip(models[family], initial_checkpoint(models[family], out_dir / f"init-{family}"))
    if dist.get_rank() == 0:
        torch.save(results, out_dir / "results.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main()
