"""Process groups: torch.distributed (gloo on CPU, nccl on GPU) plus Megatron's parallel state.

Under torchrun the rank and world come from its environment; a plain `python` process becomes a world of
one; torchrun itself is started by the launchers (`cluster.launch`).
"""

from __future__ import annotations

import os

import torch

from composer.recipes.checks import world_problems
from composer.recipes.errors import UserError
from composer.recipes.schema import ParallelismSection
from composer.runtime.processes import free_port


def init_distributed(p: ParallelismSection, seed: int = 1234) -> None:
    """Join the process group (once per process) and (re)build Megatron's tp/pp/cp/ep/etp/dp groups for `p`.

    Calling it again with other sizes rebuilds the groups; models built under the old groups must not be used.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from composer.trainer.cpu_compat import apply_cpu_patches

    apply_cpu_patches()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    problems = world_problems(p, world, f"world size {world}")
    if problems:
        raise UserError("; ".join(map(str, problems)))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
