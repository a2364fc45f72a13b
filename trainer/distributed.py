"""Process groups: torch.distributed (gloo on CPU, nccl on GPU) plus Megatron's parallel state.

Under torchrun the rank and world come from its environment; a plain `python` process becomes a world of
one. `run_torchrun` starts any `-m module` under torchrun on this host (tests, midtrain, the RL learner).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from recipes.errors import UserError
from recipes.checks import world_problems
from recipes.processes import free_port
from recipes.schema import ParallelismSection


def init_distributed(p: ParallelismSection, seed: int = 1234) -> None:
    """Join the process group (once per process) and (re)build Megatron's tp/pp/cp/ep/etp/dp groups for `p`.

    Calling it again with other sizes rebuilds the groups; models built under the old groups must not be used.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from trainer.cpu_compat import apply_cpu_patches

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


def run_torchrun(nproc: int, args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run `nproc` local processes under torchrun; `args` is `["-m", module, ...]` or `[script.py, ...]`.

    Output is captured; OMP_NUM_THREADS defaults to 1 (faster than sharing cores between ranks).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        *args,
    ]
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
    return subprocess.run(cmd, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
