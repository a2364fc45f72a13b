"""Megatron's data-parallel wrapper, optimizer (distributed where asked) and learning-rate schedule.

Shared by mid-training and the RL learner. On CPU the Megatron calls run under `cuda_calls_on_cpu`.
"""

from __future__ import annotations

import torch

from recipes.schema import OptimSection, ParallelismSection
from trainer.cpu_compat import cuda_calls_on_cpu

_DECAY_STYLE = {"cosine": "cosine", "wsd": "WSD", "constant": "constant"}


def wrap_data_parallel(model, parallelism: ParallelismSection):
    """Megatron's DDP: gradient buffers reduced over data-parallel (and expert-data-parallel) groups."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,  # overlap needs CUDA streams; on GPUs it is a later optimisation
        use_distributed_optimizer=parallelism.distributed_optimizer,
    )
    return DistributedDataParallel(model.config, config, model)


class TrainOptimizer:
    """AdamW with gradient clipping and the recipe's schedule (warmup, then cosine / WSD / constant)."""

    def __init__(self, ddp_model, optim: OptimSection, parallelism: ParallelismSection, total_steps: int, dtype: torch.dtype):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.model = ddp_model
        config = OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.beta1,
            adam_beta2=optim.beta2,
            adam_eps=optim.eps,
            clip_grad=optim.clip_grad,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=parallelism.distributed_optimizer,
        )
        with cuda_calls_on_cpu():
            self.optimizer = get_megatron_optimizer(config, [ddp_model])
        decay_steps = max(total_steps, optim.warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if optim.warmup_steps else optim.lr,
            max_lr=optim.lr,
            min_lr=optim.min_lr,
            lr_warmup_steps=optim.warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=_DECAY_STYLE[optim.schedule],
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
            wsd_decay_steps=max(1, round(optim.wsd_decay_fraction * decay_steps)) if optim.schedule == "wsd" else None,
            lr_wsd_decay_style="cosine" if optim.schedule == "wsd" else None,
        )

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> dict[str, float]:
        """Reduce gradients, clip, update, advance the schedule, move the routers' expert bias (sigmoid routers);
        returns lr and the pre-clip grad norm.

        Megatron's finalize_model_grads reduces over data (and context) parallelism, sums over tensor parallelism the
        gradients of the weights every tensor-parallel rank holds whole but feeds only its sequence shard (norms
        under sequence parallelism, QK norms, MLA's down-projections), and moves each expert bias by
        moe_router_bias_update_rate towards balance from this step's expert loads (the loads then restart)."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        finalize_model_grads([self.model])
        lr = self.optimizer.param_groups[0]["lr"]
        with cuda_calls_on_cpu():
            updated, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        return {"lr": lr, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "skipped": float(not updated)}

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        # dp_reshardable: fully parallel save/load; resharding is possible across data parallelism only.
        with cuda_calls_on_cpu():
            if is_loading:
                self._init_state()
            return self.optimizer.sharded_state_dict(
                model_sharded_state_dict, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
            )

    def _init_state(self) -> None:
        """A fresh optimizer has no state to load into. Megatron's init omits Adam's `step` for torch's Adam
        (used when neither Apex nor Transformer Engine is installed), so it is added here."""
        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner.init_state_fn(inner.optimizer, inner.config)
            for group in inner.optimizer.param_groups:
                for param in group["params"]:
                    inner.optimizer.state[param].setdefault("step", torch.tensor(0.0))


    def _inner_optimizers(self) -> list:
        return [inner.optimizer for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def adam_steps(self) -> int:
        steps = {float(state["step"]) for opt in self._inner_optimizers() for state in opt.state.values() if "step" in state}
        return int(max(steps, default=0))

    def load_state_dict(self, optimizer_state: dict, scheduler_state: dict, adam_steps: int) -> None:
        with cuda_calls_on_cpu(), torch.no_grad():
            self.optimizer.load_state_dict(optimizer_state)
        # Megatron's dp_reshardable load leaves torch Adam's per-parameter `step` (bias correction) at its
        # initial value without Apex/TE; the count saved with the checkpoint restores it.
        for opt in self._inner_optimizers():
            for state in opt.state.values():
                state["step"] = torch.tensor(float(adam_steps))
        self.scheduler.load_state_dict(scheduler_state)
