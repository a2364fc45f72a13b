"""torchrun worker for tests/test_plan.py: peak memory per rank of real mid-training steps.

Builds the trainer core of RECIPE (with the JSON list of --set overrides; random weights) and runs mid-training's
own step (`trainer.midtrain.train_step`) on random samples of data.seq_length tokens. The peak is the resident
set's high-water mark over steps 2-3 (the first step allocates the optimizer state, which stays) above the
process before its model was built; run it with MALLOC_MMAP_THRESHOLD_ fixed so freed tensors leave the resident
set. Usage: plan_memory_worker.py RECIPE OVERRIDES_JSON OUT_JSON; rank 0 writes every rank's peak.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from recipes.loader import load_recipe
from runtime.processes import reset_peak_resident, resident_bytes
from trainer.core import TrainerCore
from trainer.distributed import init_distributed, shutdown_distributed
from trainer.midtrain import BatchPlacement, train_step


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
    placement = BatchPlacement("causal", eod=0, cp_size=p.cp, cp_rank=parallel_state.get_context_parallel_rank(),
                               multiple=p.tp if p.sequence_parallel else 1)
    micro = recipe.train.global_batch_size // (recipe.train.micro_batch_size * parallel_state.get_data_parallel_world_size())
    generator = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    for step in range(3):
        batches = []
        for _ in range(micro):
            tokens = torch.randint(1, recipe.model.vocab_size, (recipe.train.micro_batch_size, seq + 1), generator=generator)
            batches.append(placement({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(tokens.shape[0], seq),
                                      "position_ids": torch.arange(seq).expand(tokens.shape[0], seq)}))
        if step == 1:
            reset_peak_resident()
        train_step(core.ddp, core.optimizer, batches, None)
    peak = torch.tensor([resident_bytes()[1] - before], dtype=torch.float64)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps([float(x) for x in peaks]))
    shutdown_distributed()


if __name__ == "__main__":
    main()
