"""torchrun worker for tests/integration/test_cluster_plan.py: what each rank of real mid-training steps holds.

Builds the trainer core of RECIPE (with the JSON list of --set overrides; random weights) and runs mid-training's
own step (`trainer.midtrain.train_step`) on random samples of data.seq_length tokens. Per rank it reports the peak:
the resident set's high-water mark over steps 2-3 (the first step allocates the optimizer state, which stays)
above the process before its model was built (run it with MALLOC_MMAP_THRESHOLD_ fixed so freed tensors leave the
resident set), and what the rank holds, counted tensor by tensor: parameters (with deepseek_v3's expert-bias
buffers), DDP's gradient buffers and the optimizer's state. Usage: plan_memory_worker.py RECIPE OVERRIDES_JSON
OUT_JSON; rank 0 writes every rank's figures.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from composer.recipes.loader import load_recipe
from composer.runtime.processes import reset_peak_resident, resident_bytes
from composer.trainer.core import TrainerCore
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.midtrain import BatchPlacement, train_step


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def held_bytes(core: TrainerCore) -> dict[str, int]:
    model, ddp = core.model, core.ddp
    biases = [buffer for name, buffer in model.named_buffers() if name.endswith("expert_bias")]
    inner = getattr(core.optimizer.optimizer, "chained_optimizers", [core.optimizer.optimizer])
    state = [t for opt in inner for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {
        "parameters": tensor_bytes(list(model.parameters()) + biases),
        "gradients": tensor_bytes(buffer.grad_data for buffer in ddp.buffers + ddp.expert_parallel_buffers),
        "optimizer": tensor_bytes(state),
    }


def main() -> None:
    recipe_path, overrides, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    recipe = load_recipe(Path(recipe_path), overrides)
    # the baseline: the process with its process groups and libraries loaded, what every rank holds before a model
    init_distributed(recipe.parallelism, seed=recipe.train.seed)
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    before = resident_bytes()[0]
    core = TrainerCore(recipe.model, recipe.parallelism, recipe.optim, recipe.train, Path(tempfile.mkdtemp()) / "checkpoints")
    from megatron.core import parallel_state

    p, seq = recipe.parallelism, recipe.data.seq_length
    placement = None
    if p.pp == 1:  # the pipeline schedule takes the sample rows (as mid-training feeds it)
        placement = BatchPlacement(
            "causal", eod=0, cp_size=p.cp, cp_rank=parallel_state.get_context_parallel_rank(), multiple=p.tp if p.sequence_parallel else 1
        )
    micro = recipe.train.global_batch_size // (recipe.train.micro_batch_size * parallel_state.get_data_parallel_world_size())
    generator = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    for step in range(3):
        batches = []
        for _ in range(micro):
            tokens = torch.randint(1, recipe.model.vocab_size, (recipe.train.micro_batch_size, seq + 1), generator=generator)
            batch = {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "loss_mask": torch.ones(tokens.shape[0], seq),
                "position_ids": torch.arange(seq).expand(tokens.shape[0], seq),
            }
            batches.append(placement(batch) if placement else batch)
        if step == 1:
            reset_peak_resident()
        train_step(core.ddp, core.optimizer, batches, None)
    figures = {"peak": resident_bytes()[1] - before, "stage": parallel_state.get_pipeline_model_parallel_rank(), **held_bytes(core)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    shutdown_distributed()


if __name__ == "__main__":
    main()
