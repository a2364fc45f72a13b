"""Megatron's data-parallel wrapper, optimizer (distributed where asked) and learning-rate schedule.

Shared by mid-training and the RL learner. On CPU the Megatron calls run under `cuda_calls_on_cpu`.
"""

from __future__ import annotations

import torch

from composer.recipes.errors import UserError
from composer.recipes.schema import MuonSection, OptimSection, ParallelismSection
from composer.trainer.cpu_compat import cuda_calls_on_cpu, fit_emerging_optimizers_to_megatron
from composer.trainer.qk_clip import clip_attention_logits

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
    """The recipe's optimizer (optim.name: AdamW, or Muon for the weight matrices chained with AdamW for the rest)
    with gradient clipping, the schedule (warmup, then cosine / WSD / constant) and QK-clip (optim.qk_clip)."""

    def __init__(self, ddp_model, optim: OptimSection, parallelism: ParallelismSection, total_steps: int, dtype: torch.dtype):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.model = ddp_model
        self.name = optim.name
        self.clips_qk = optim.qk_clip is not None
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
            **(_muon_config(optim.muon) if optim.name == "muon" else {}),
        )
        with cuda_calls_on_cpu():
            if optim.name == "muon":
                self.optimizer = _build_muon(config, ddp_model, optim.muon)
            else:
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
        """Finish the gradients, clip, update, advance the schedule, QK-clip; returns lr, the pre-clip grad norm and
        (QK-clip) the step's largest attention logit.

        Megatron's finalize_model_grads reduces the gradients over data (and context) parallelism, sums over tensor
        parallelism the gradients of the weights every tensor-parallel rank holds whole but feeds only its sequence
        shard (norms under sequence parallelism, routers, QK norms, MLA's down-projections), and moves each expert
        bias (sigmoid routers: aux-loss-free balancing) by moe_router_bias_update_rate towards balance from this
        step's expert loads (the loads then restart)."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        finalize_model_grads([self.model])
        lr = self.optimizer.param_groups[0]["lr"]
        with cuda_calls_on_cpu():
            updated, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = {"lr": lr, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "skipped": float(not updated)}
        if self.clips_qk:
            metrics["max_attention_logit"] = clip_attention_logits(self.model.module)
        return metrics

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
            for state in inner.optimizer.state.values():
                if "exp_avg" in state:  # Adam's (Muon keeps a momentum buffer only)
                    state.setdefault("step", torch.tensor(0.0))

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
                if "exp_avg" in state:
                    state["step"] = torch.tensor(float(adam_steps))
        self.scheduler.load_state_dict(scheduler_state)


def _muon_config(muon: MuonSection) -> dict:
    return dict(
        muon_momentum=muon.momentum,
        muon_use_nesterov=muon.nesterov,
        muon_num_ns_steps=muon.ns_steps,
        muon_scale_mode=muon.scale,
        muon_extra_scale_factor=muon.scale_factor,
        muon_fp32_matmul_prec=muon.matmul_precision,
        muon_split_qkv=True,  # the fused QKV weight orthogonalized as its query, key and value matrices
        # each tensor-parallel shard gathered and orthogonalized whole: the update of the unsharded matrix
        # (Megatron's default `blockwise` orthogonalizes each shard on its own, which depends on tp)
        muon_tp_mode="duplicated",
    )


def _build_muon(config, ddp_model, muon: MuonSection):
    """Megatron's chained optimizer: TensorParallelMuon for the 2-D weights but embedding and output layer (and the
    routers with muon.router: adam), Adam for the rest."""
    try:
        megatron_muon = fit_emerging_optimizers_to_megatron()
    except ImportError as e:
        raise UserError(f"optim.name: muon needs the emerging-optimizers package ({e}); scripts/setup.sh installs it") from None
    named = list(ddp_model.named_parameters())
    routers = [param for name, param in named if name.endswith(".router.weight")] if muon.router == "adam" else []
    for param in routers:
        param.is_embedding_or_output_parameter = True  # the mark Megatron's Muon leaves to Adam
    try:
        optimizer = megatron_muon.get_megatron_muon_optimizer(config, [ddp_model])
    finally:
        for param in routers:
            del param.is_embedding_or_output_parameter
    for _, param in named:
        master = getattr(param, "main_param", None)
        for mark in ("is_qkv", "expert_tp"):
            if master is not None and hasattr(param, mark):
                # Megatron marks the model's bf16 weights, but Muon updates their fp32 master copies: unmarked, it
                # would orthogonalize the fused QKV as one matrix and gather expert shards over the dense tp group
                setattr(master, mark, getattr(param, mark))
    return optimizer
