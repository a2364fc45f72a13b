"""Make Megatron-Core 0.16.1 run on CPU with gloo.

Megatron assumes CUDA in a few well-isolated places (measured list: notes/megatron-on-cpu.md).
`apply_cpu_patches()` swaps exactly those for CPU equivalents; none changes the maths. It is a
no-op when CUDA is available and idempotent otherwise. Three fixes are needed on GPUs too:
`define_missing_transformer_engine_names()` (no Transformer Engine), `fix_expert_bias_padding()` and
`fit_emerging_optimizers_to_megatron()` (Muon). The patches reach into internals, which is why megatron-core and
emerging-optimizers are pinned.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def apply_cpu_patches() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _patch_current_device()
    _patch_rng_tracker()
    _patch_alltoall_dispatcher()
    _patch_synchronize()
    _patch_context_parallel_rope()
    _applied = True


def _patch_synchronize() -> None:
    # replaces torch.cuda.synchronize(): distributed checkpointing waits for device copies before writing.
    torch.cuda.synchronize = lambda *args, **kwargs: None


class _CudaCallsOnCpu(TorchFunctionMode):
    """Megatron's optimizer, grad clipping and checkpoint paths create `device="cuda"` tensors, call
    `Tensor.cuda()` and check `param.type() == "torch.cuda.FloatTensor"`; this mode answers all three on CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cuda_calls_on_cpu() -> contextlib.AbstractContextManager:
    """Scope for Megatron optimizer and checkpoint calls: maps their CUDA calls to CPU (a no-op on GPUs).

    Scoped rather than global because a TorchFunctionMode adds Python overhead to every torch call.
    """
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaCallsOnCpu()


def _patch_current_device() -> None:
    # replaces torch.cuda.current_device(): Megatron allocates attention buffers, TP-mapping outputs
    # and DDP grad buffers on `device=torch.cuda.current_device()`; on CPU that device is "cpu".
    torch.cuda.current_device = lambda: "cpu"


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker on the CPU default generator (dropout, init, recompute)."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

    # replaces CudaRNGStatesTracker: initialize_rng_tracker() instantiates this module global.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    # replaces _get_cuda_rng_state/_set_cuda_rng_state (tracker fork, activation recompute): CPU generator state.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _patch_alltoall_dispatcher() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def splits_to_numpy(self, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    # replaces _maybe_dtoh_and_synchronize (CUDA side stream + event): on CPU nothing to copy, but gloo's
    # all_to_all_single wants the split sizes as plain numbers, which Megatron converts only for CUDA tensors.
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = splits_to_numpy
    # replaces the torch.cuda.Stream() that __init__ creates once per class: the CPU method above never uses it.
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "unused on CPU"


def _patch_context_parallel_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
        size, rank = cp_group.size(), cp_group.rank()
        chunks = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1 :])
        pos_emb = pos_emb.index_select(seq_dim, chunks)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])

    # replaces get_pos_emb_on_this_cp_rank (RoPE positions of this rank's zigzag chunks under context parallelism):
    # it stages the chunk indices in pinned memory, which needs CUDA; the same selection from an ordinary tensor.
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank


def define_missing_transformer_engine_names() -> None:
    """Idempotent; a no-op when Transformer Engine is installed."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    # replaces the te_general_gemm name that 0.16.1 leaves undefined without Transformer Engine (router GEMM).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # replaces HAVE_TE in MLA: without Transformer Engine its TELinear is a MagicMock placeholder, and MLA's
    # `isinstance(self.linear_proj, TELinear)` (an fp8 check) raises TypeError.
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def fit_emerging_optimizers_to_megatron():
    """Megatron's Muon module, usable with the emerging-optimizers release that PyPI serves. Idempotent.

    Megatron-Core 0.16.1's Muon was written against emerging-optimizers 0.1.0, a git tag never published on PyPI;
    PyPI has 0.3.0 only, which declares Python >= 3.12 and renamed two keywords. The update rule is the same.
    """
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        # replaces typing.override (Python 3.12), which emerging-optimizers imports: a marker for type checkers only.
        typing.override = typing_extensions.override
    from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer, muon_utils
    from megatron.core.optimizer import muon

    if not getattr(OrthogonalizedOptimizer.__init__, "takes_use_nesterov", False):
        init = OrthogonalizedOptimizer.__init__

        def init_taking_use_nesterov(self, *args, use_nesterov: bool, **kwargs):
            init(self, *args, nesterov=use_nesterov, **kwargs)

        # replaces OrthogonalizedOptimizer.__init__, which TensorParallelMuon calls with 0.1.0's `use_nesterov`
        # keyword (0.3.0: `nesterov`).
        init_taking_use_nesterov.takes_use_nesterov = True
        OrthogonalizedOptimizer.__init__ = init_taking_use_nesterov

    def newton_schulz_tp(x, steps, coefficient_type, tp_group, partition_dim=None, mode="duplicated"):
        return muon_utils.newton_schulz_tp(x, steps, coefficient_type, tp_group, partition_dim, tp_mode=mode)

    # replaces newton_schulz_tp in Megatron's muon module, which passes 0.1.0's `mode` keyword (0.3.0: `tp_mode`).
    muon.newton_schulz_tp = newton_schulz_tp
    return muon


def fix_expert_bias_padding() -> None:
    """Idempotent. Replaces TopKRouter._apply_expert_bias: with a padding mask (padding out of the expert loads that
    move the expert bias), 0.16.1 masks the [tokens, experts] routing map with the [tokens] mask, which does not
    broadcast; the same count with the mask on the token axis."""
    from megatron.core.transformer.moe.router import TopKRouter

    def apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = apply_expert_bias
