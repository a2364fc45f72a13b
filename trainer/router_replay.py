"""Router replay (R3): the learner's MoE routers choose the experts the rollout engine chose.

Megatron-Core gives each router a `RouterReplay` object (megatron.core.transformer.moe.router_replay) steered by an
action (RECORD, REPLAY_FORWARD, REPLAY_BACKWARD) and per-router tensors, none of it validated. Replay forces only the
expert selection: the gate probabilities of the forced experts come from the live router logits, so the router
still learns. This module is the only place that drives those objects:

    with routing(model, replay=per_layer_tensors) as used:   # or replay=None: free routing, recorded
        logprobs = token_logprobs(model, tokens)
        loss.backward()                                        # inside the block (activation recompute)
    used.routes()                                              # [B, S, local MoE layers, top_k] experts used

It drives the routers of `model` only (never Megatron's process-wide instance list), for one forward pass and its
backward, and leaves every router with no action and no tensors when the block ends, also on error. With activation
recompute (train.recompute_activations) the routers run again during backward: they then replay the routes of the
forward pass (REPLAY_BACKWARD), whether those were replayed or freely chosen.

One block per micro-batch, forward and backward inside it: a pipeline schedule with several micro-batches in flight
would need one replay queue per micro-batch (pipeline parallelism is refused by trainer.model anyway). Megatron's
load-balancing loss keeps using the router's own top-k, which is what it should balance.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from composer.recipes.errors import UserError
from composer.trainer.packing import SequenceLayout
from composer.trainer.replay_layout import ReplayLayoutError, replay_tensors

BALANCING_THAT_KEEPS_REPLAY = {"aux_loss", "seq_aux_loss", "global_aux_loss", "none"}
"""Load-balancing types that leave the top-k selection to RouterReplay (sinkhorn computes its own)."""


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def moe_routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(global 0-based layer index, router) for each MoE layer this rank holds, in layer order."""
    return [(layer.layer_number - 1, layer.mlp.router) for layer in unwrap(model).decoder.layers if hasattr(layer.mlp, "router")]


def check_replay_supported(config) -> None:
    """Refuse router settings under which Megatron would skip or undo the replayed selection without a word."""
    problems = []
    if not config.moe_enable_routing_replay:
        problems.append("the model was built without moe_enable_routing_replay")
    if config.moe_router_fusion:
        problems.append("moe_router_fusion=True uses a fused top-k kernel that never consults RouterReplay")
    types = config.moe_router_load_balancing_type
    for kind in [types] if isinstance(types, str) else types:
        if kind not in BALANCING_THAT_KEEPS_REPLAY:
            problems.append(f"moe_router_load_balancing_type={kind!r} selects experts itself, bypassing replay")
    if config.moe_expert_capacity_factor is not None:
        problems.append("moe_expert_capacity_factor drops tokens after the replayed selection (the engine drops none)")
    if problems:
        raise UserError("router replay cannot be used with this model: " + "; ".join(problems))


def check_replay_tensors(tensors: list[torch.Tensor], num_layers: int, top_k: int, num_experts: int) -> None:
    """Per local MoE layer one int64 [tokens, top_k] tensor of distinct expert ids in [0, num_experts)."""
    if len(tensors) != num_layers:
        raise ReplayLayoutError(f"{len(tensors)} replay tensors for {num_layers} local MoE layers")
    for i, t in enumerate(tensors):
        if t.dtype != torch.int64 or t.ndim != 2 or t.shape[1] != top_k:
            raise ReplayLayoutError(f"replay tensor {i}: {t.dtype} {tuple(t.shape)}, expected torch.int64 (tokens, {top_k})")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_experts):
            raise ReplayLayoutError(f"replay tensor {i}: expert ids outside [0, {num_experts})")
        ordered = t.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            # a repeated id would route the token to fewer than top_k experts
            raise ReplayLayoutError(f"replay tensor {i}: a token names the same expert twice")


class UsedRoutes:
    """The experts each router used in the forward pass of a `routing` block, and the ones it would have chosen.

    Under replay the two differ where the learner disagrees with the engine given the same layer input, which
    measures the train/inference routing mismatch during training at no extra forward pass.
    """

    def __init__(self, layers: list[int], sequence_parallel: bool):
        self.layers = layers
        """Global indices of the MoE layers this rank holds, the third axis of `routes()`."""
        self._sequence_parallel = sequence_parallel
        self._used: dict[int, torch.Tensor] = {}
        self._preferred: dict[int, torch.Tensor] = {}
        self._batch_size: int | None = None

    def begin(self, batch_size: int) -> None:
        self._batch_size = batch_size

    def add(self, layer: int, used: torch.Tensor, preferred: torch.Tensor) -> None:
        """One router's [S_local*B, top_k] expert ids, in Megatron's sequence-major row order."""
        self._used[layer] = used
        self._preferred[layer] = preferred

    def routes(self) -> torch.Tensor:
        """int64 [B, S, len(layers), top_k] experts used for the model's input rows, sorted within each row; whole
        rows under sequence parallelism (a collective over the tensor-parallel group: call it on every rank)."""
        return self._engine_layout(self._used)

    def preferred(self) -> torch.Tensor:
        """Like `routes()`: the experts each router's own top-k picked from the same layer input."""
        return self._engine_layout(self._preferred)

    def _engine_layout(self, by_layer: dict[int, torch.Tensor]) -> torch.Tensor:
        if self._batch_size is None:
            raise RuntimeError("no forward pass ran inside the routing block")
        per_layer = torch.stack([by_layer[layer] for layer in self.layers], dim=1)  # [S_local*B, L, K]
        if self._sequence_parallel:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
            shards = [torch.empty_like(per_layer) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(shards, per_layer.contiguous(), group=group)
            per_layer = torch.cat(shards)  # sequence shards are contiguous blocks of rows
        b = self._batch_size
        return per_layer.view(-1, b, *per_layer.shape[1:]).transpose(0, 1)


@contextmanager
def routing(model, replay: list[torch.Tensor] | None = None) -> Iterator[UsedRoutes]:
    """Route one forward pass (and its backward) of `model`: replay `replay` (one int64 [S_local*B, top_k] tensor
    per local MoE layer, layout of trainer.replay_layout) or, when None, route freely; yields what was used."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    gpt = unwrap(model)
    config = gpt.config
    check_replay_supported(config)
    routers = moe_routers(gpt)
    if not routers:
        raise UserError("router replay needs an MoE model; this one has no MoE layers")
    top_k = config.moe_router_topk
    if replay is not None:
        check_replay_tensors(replay, len(routers), top_k, config.num_moe_experts)
    used = UsedRoutes([layer for layer, _ in routers], config.sequence_parallel)
    state = {"forwards": 0, "capturing": False}

    def before_forward(_module, args, kwargs):
        if state["forwards"]:
            raise RuntimeError("one forward pass per routing block (each micro-batch gets its own block)")
        state["forwards"] += 1
        tokens = args[0] if args else kwargs["input_ids"]
        batch, seq = tokens.shape
        used.begin(batch)
        if replay is not None:
            # each rank's routers see its sequence shard under sequence parallelism
            rows = batch * seq // (config.tensor_model_parallel_size if config.sequence_parallel else 1)
            if any(t.shape[0] != rows for t in replay):
                raise ReplayLayoutError(
                    f"replay tensors of {[t.shape[0] for t in replay]} rows for a micro-batch of {rows} router tokens ({batch} x {seq})"
                )
        for i, (_, router) in enumerate(routers):
            if replay is None:
                router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                router.router_replay.set_target_indices(replay[i])
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        state["capturing"] = True

    def after_forward(_module, _args, _output):
        state["capturing"] = False
        for _, router in routers:
            if replay is None:
                # queue the freely chosen routes for the recompute in backward
                router.router_replay.set_target_indices(router.router_replay.get_recorded_indices())
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def capture(layer: int):
        def hook(router, args, output):
            if not state["capturing"]:
                return  # the recompute in backward replays what was captured
            chosen = experts_of(output[1], top_k, layer)
            if replay is None:
                used.add(layer, chosen, chosen)
            else:
                with torch.no_grad():
                    used.add(layer, chosen, experts_of(free_routing_map(router, args[0]), top_k, layer))

        return hook

    handles = [gpt.register_forward_pre_hook(before_forward, with_kwargs=True), gpt.register_forward_hook(after_forward)]
    handles += [router.register_forward_hook(capture(layer)) for layer, router in routers]
    try:
        yield used
    finally:
        for handle in handles:
            handle.remove()
        for _, router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def experts_of(routing_map: torch.Tensor, top_k: int, layer: int) -> torch.Tensor:
    """[tokens, experts] bool -> int64 [tokens, top_k] expert ids in ascending order (as nonzero() lists them)."""
    chosen = routing_map.nonzero()[:, 1]
    if chosen.numel() != routing_map.shape[0] * top_k:
        raise RuntimeError(f"layer {layer}: the router chose other than {top_k} experts per token")
    return chosen.view(-1, top_k)


def free_routing_map(router, hidden: torch.Tensor) -> torch.Tensor:
    """The routing map `router` computes for `hidden` on its own: Megatron's top-k without the replay hook."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    config = router.config
    logits = router.gating(hidden).view(-1, config.num_moe_experts)
    _, routing_map = topk_routing_with_score_function(
        logits,
        config.moe_router_topk,
        use_pre_softmax=config.moe_router_pre_softmax,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        scaling_factor=config.moe_router_topk_scaling_factor,
        score_function=config.moe_router_score_function,
        expert_bias=router.expert_bias,
    )
    return routing_map


def replay_for_micro_batch(model, mode: str, routes: list[np.ndarray] | None, layout: SequenceLayout) -> list[torch.Tensor] | None:
    """What `routing(model, replay=...)` gets for a micro-batch placed by `layout` under `rl.router_replay` (`r3`
    or `off`).

    routes: the engine's experts per sequence ([lengths[b]-1, layers, top_k]); required under `r3`.
    """
    if mode == "off":
        return None
    if mode != "r3":
        raise UserError(f"rl.router_replay={mode!r}: expected `r3` or `off`")
    if routes is None or any(r is None for r in routes):
        raise UserError(
            "rl.router_replay=r3 but the trajectories carry no routed experts; enable them on the rollout engine or set rl.router_replay: off"
        )
    from megatron.core import parallel_state

    config = unwrap(model).config
    layers = [layer for layer, _ in moe_routers(model)]
    if not layers:
        raise UserError("rl.router_replay=r3 needs an MoE model; this one has no MoE layers (set rl.router_replay: off)")
    return replay_tensors(
        routes,
        list(layout.lengths),
        layout,
        config.num_moe_experts,
        layers,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=config.tensor_model_parallel_size,
        sequence_parallel=config.sequence_parallel,
    )


def routing_disagreement(used: torch.Tensor, layers: list[int], routes: list[np.ndarray], layout: SequenceLayout) -> dict[int, float]:
    """Per layer, the fraction of routed tokens whose expert set differs between `used` (this rank's
    [rows, columns, len(layers), K] from UsedRoutes.routes, placed by `layout`) and the engine's `routes` (per
    sequence [lengths[b]-1, all layers, K]). A collective over the context-parallel group when cp > 1."""
    used = layout.padded(layout.stream(used))
    differ = np.zeros(len(layers))
    tokens = 0
    for b, (r, n) in enumerate(zip(routes, layout.lengths)):
        engine = np.sort(np.asarray(r)[:, layers].astype(np.int64), axis=-1)  # [n-1, L, K]
        learner = used[b, : n - 1].numpy()
        differ += (engine != learner).any(-1).sum(0)
        tokens += n - 1
    return {layer: float(d) / max(tokens, 1) for layer, d in zip(layers, differ)}


def replay_metrics(
    model, batch, routes: list[np.ndarray], engine_logprobs: list[np.ndarray], loss_masks: list[np.ndarray]
) -> dict[str, float]:
    """Train/inference mismatch on one micro-batch (`trainer.logprobs.MicroBatch`), with and without replay.

    Two no-grad forwards: free routing and replay of the engine's `routes`. Gives, per local MoE layer, the
    fraction of tokens whose experts differ from the engine's: `free` (differences compound over layers),
    `own` (the router's own top-k on the replayed pass's layer input, what training logs for free) and `replay`
    (0 unless replay is broken); and mean/max |learner - engine| logprob of the generated tokens both ways.
    """
    from composer.trainer.logprobs import logprob_mismatch, token_logprobs

    metrics: dict[str, float] = {}
    replay = replay_for_micro_batch(model, "r3", routes, batch.layout)
    for name, tensors in (("free", None), ("replay", replay)):
        with routing(model, tensors) as used:
            learner = token_logprobs(model, batch.tokens, with_grad=False)
        for layer, rate in routing_disagreement(used.routes(), used.layers, routes, batch.layout).items():
            metrics[f"routing_disagreement_{name}/layer{layer}"] = rate
        if name == "replay":
            for layer, rate in routing_disagreement(used.preferred(), used.layers, routes, batch.layout).items():
                metrics[f"routing_disagreement_own/layer{layer}"] = rate
        mismatch = logprob_mismatch(learner, batch, engine_logprobs, loss_masks)
        metrics[f"logprob_abs_diff_{name}"] = mismatch["mean"]
        metrics[f"logprob_abs_diff_{name}_max"] = mismatch["max"]
    return metrics
