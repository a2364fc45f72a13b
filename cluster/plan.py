"""The memory and step-time plan of a recipe's layout, before anything launches (`composer plan`).

Per rank of the learner (the most loaded pipeline stage): parameters, gradients, optimizer state and activations,
counted the way composer's trainer holds them: recipes.sizes' parts of the model split over tp / pp / ep as
Megatron splits them; Megatron's DDP keeps fp32 gradient buffers; Adam two fp32 moments per parameter, Muon
(optim.name muon) one fp32 momentum per weight matrix and Adam's for the rest, plus fp32 master weights for bf16
models, sharded over data parallelism with the distributed optimizer (Adam only); activations are the tensors
autograd keeps for backward in composer's layer implementation, counted with saved-tensor hooks, plus the largest
transient of backward. Per device of a rollout engine: its weights and the KV cache of one `max_context` sequence
(recipes.sizes). FLOPs per step, the step time at a given MFU (or a run's measured times), for RL the step time of
synchronous and asynchronous RL, and the layouts of the same world size that fit, best first.

Pure arithmetic on the recipe (no torch). Checked against real training steps on CPU (tests/test_cluster_plan.py:
what each rank holds, tensor by tensor, and its peak memory); on GPUs add what CUDA itself holds (RESERVE_GIB,
FRAGMENTATION).
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path

from composer.cluster.engine_fit import declared_engine_problems
from composer.recipes.checks import Problem, check_recipe
from composer.recipes.errors import UserError
from composer.recipes.schema import ModelSection, ParallelismSection, Recipe
from composer.recipes.sizes import (
    engine_weight_bytes_per_device,
    kv_bytes_per_token_per_device,
    parameter_breakdown,
    parameter_counts,
    sized_dtype,
)

GIB = 2**30
RESERVE_GIB = 2.0
"""Device memory the plan leaves to the CUDA context, NCCL's buffers and Megatron's own (an assumption)."""
FRAGMENTATION = 0.05
"""Share of device memory the caching allocator loses to fragmentation (an assumption)."""
LINK_GBPS = {"host": 400.0, "network": 50.0}
"""Assumed bandwidth (GB/s per rank) of collectives within a host and between hosts, for ranking layouts."""


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2}[dtype]


# --- parameters ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    """Parameters of one rank: `dense` ones are reduced over data (x context) parallelism, `expert` ones over
    expert data parallelism. Of the dense ones, `embeddings_and_norms` and `routers` are those Megatron's Muon
    leaves to Adam (the routers with optim.muon.router adam)."""

    dense: int
    expert: int
    embeddings_and_norms: int
    routers: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_layers(m: ModelSection, pp: int, stage: int) -> list[int]:
    per = m.num_layers // pp
    return list(range(stage * per, (stage + 1) * per))


def rank_params(m: ModelSection, p: ParallelismSection, stage: int = 0) -> Params:
    """Parameters one rank of pipeline stage `stage` holds (embedding on the first stage, output layer and final norm
    on the last): recipes.sizes' parts of the model, split the way Megatron splits them. deepseek_v3's expert biases
    count as parameters (Megatron keeps them as buffers without gradients: a few hundred values a layer)."""
    b, tp = parameter_breakdown(m), p.tp
    norms = routers = dense = expert = 0
    for layer in stage_layers(m, p.pp, stage):
        norms += b.attention_norms + b.layer_norms
        dense += b.attention_split // tp + b.attention_whole
        if layer in m.moe_layers:
            routers += b.router
            dense += b.expert_bias + b.shared_experts // tp
            expert += (m.num_experts // p.ep) * b.routed_expert // p.etp
        else:
            dense += b.dense_mlp // tp
    if stage == 0:
        norms += b.embedding // tp
    if stage == p.pp - 1:
        norms += b.final_norm + b.output // tp  # tied: the embedding itself (trainer.model refuses tied with pp > 1)
    return Params(dense + norms + routers, expert, norms, routers)


# --- activations ---------------------------------------------------------------------------------


def layer_activation_bytes(m: ModelSection, p: ParallelismSection, tokens: int, moe: bool) -> int:
    """What autograd keeps for backward from one layer's forward over `tokens` tokens of this rank (after the
    context-parallel split), as composer's layer spec computes it (SDPA attention, grouped experts)."""
    b, tp = dtype_bytes(m.dtype), p.tp
    sp = tokens // tp if p.sequence_parallel else tokens  # the tokens norms, routers and residuals see
    h = m.hidden_size
    heads = m.num_attention_heads // tp
    norm = sp * h * (4 + b)  # the fp32 statistics' input and the normalised output
    out = 2 * norm
    if m.family == "deepseek_v3":
        q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        latent = m.kv_lora_rank + m.qk_rope_head_dim
        out += sp * h * b + sp * latent * b + sp * m.kv_lora_rank * (4 + b) + sp * m.kv_lora_rank * b
        if m.q_lora_rank:
            out += sp * m.q_lora_rank * (4 + b) + sp * m.q_lora_rank * b
        out += 4 * tokens * m.qk_rope_head_dim * b  # RoPE cos / sin of queries and keys
        # q, k, v and output (v and output padded to the key width for fused SDPA; as they are in the ring), lse
        value = m.v_head_dim if p.cp > 1 else q_head
        out += 2 * tokens * heads * (q_head + value) * b + tokens * heads * 4
        out += tokens * heads * m.v_head_dim * b  # output projection input
    else:
        kv = m.num_kv_heads // tp
        d = m.head_dim
        out += sp * h * b + 4 * tokens * d * b  # QKV input; RoPE cos / sin
        out += 4 * tokens * heads * d * b + tokens * heads * 4  # q, k and v expanded to the query heads, output, lse
        out += tokens * heads * d * b  # output projection input
        if m.family == "qwen3_moe":
            out += tokens * (heads + kv) * d * (4 + b)  # QK norms
            if b == 4:
                out += tokens * (heads + 2 * kv) * d * b  # the fused QKV output, kept alive by the key norm's view
    if moe:
        f, k = m.moe_ffn_hidden_size, m.moe_top_k
        local = m.num_experts // p.ep
        out += sp * h * b + sp * m.num_experts * 4 * 3  # router input; logits, scores and routing map
        out += sp * k * (h + 5 * f) * b // p.etp + sp * k * 4  # each routed copy: input, fc1 out, activation, probs
        out += local * 3 * h * f * b // p.etp  # grouped GEMMs keep their stacked expert weights for backward
        if m.num_shared_experts:
            out += sp * h * b + tokens * 5 * f * m.num_shared_experts // tp * b
    else:
        out += sp * h * b + tokens * 5 * m.ffn_hidden_size // tp * b
    return out


def output_activation_bytes(m: ModelSection, p: ParallelismSection, tokens: int) -> int:
    """The final norm, the output layer's input and the cross entropy's softmax over this rank's vocabulary, in fp32
    whatever the dtype: Megatron's `calculate_logits_max` takes an fp32 copy of the logits, exponentiates it in
    place and keeps it for backward."""
    b = dtype_bytes(m.dtype)
    sp = tokens // p.tp if p.sequence_parallel else tokens
    return sp * m.hidden_size * (4 + b) + sp * m.hidden_size * b + tokens * (m.vocab_size // p.tp) * 4


def output_transient_bytes(m: ModelSection, p: ParallelismSection, tokens: int) -> int:
    """Beside the loss's fp32 softmax, for a moment: the output layer's weight gradient and, below fp32, the logits
    in their own dtype (forward: the tensor the fp32 copy is made from; backward: the gradient cast back to it)."""
    b = dtype_bytes(m.dtype)
    vocab = m.vocab_size // p.tp
    return vocab * m.hidden_size * b + (tokens * vocab * b if b < 4 else 0)


def activation_bytes(m: ModelSection, p: ParallelismSection, tokens: int, recompute: bool, micro_batches: int, stage: int = 0) -> int:
    """Peak activation memory of pipeline stage `stage` for micro-batches of `tokens` tokens per rank.

    Under 1F1B stage s holds up to pp - s micro-batches; the last stage also computes the output layer and the loss.
    Backward first frees the output layer's tensors (adding its weight gradient), then runs each layer, whose
    activation gradients come to about what it saved. With recompute each layer keeps only its input, and backward
    rebuilds one layer at a time (its saved tensors and their gradients)."""
    layers = stage_layers(m, p.pp, stage)
    per_layer = [layer_activation_bytes(m, p, tokens, layer in m.moe_layers) for layer in layers]
    b = dtype_bytes(m.dtype)
    sp = tokens // p.tp if p.sequence_parallel else tokens
    last = stage == p.pp - 1
    output = output_activation_bytes(m, p, tokens) if last else 0
    output_transient = output_transient_bytes(m, p, tokens) if last else 0
    in_flight = min(p.pp - stage, micro_batches)
    if recompute:
        inputs = len(layers) * sp * m.hidden_size * b
        return in_flight * inputs + max(output + output_transient, 2 * max(per_layer))
    return in_flight * sum(per_layer) + max(output + output_transient, max(per_layer))


# --- a rank, engines, time -----------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    """Peak activations as the recipe recomputes (train.recompute_activations) ..."""
    activations_other: int
    """... and with recompute the other way."""
    reference: int = 0
    """The RL learner's frozen reference policy (rl.kl_coeff > 0)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.reference


@dataclass(frozen=True)
class EngineMemory:
    """One device of a rollout engine."""

    weights: int
    kv_per_sequence: int
    """The KV cache of one rollout.max_context sequence."""
    kv_cache: int
    """rollout.kv_cache_gib."""

    @property
    def sequences(self) -> int:
        return self.kv_cache // max(self.kv_per_sequence, 1)


@dataclass(frozen=True)
class Rates:
    """What sets RL's step time; each None unless given or measured."""

    generated_tokens_per_s: float | None = None
    """Per engine, a whole group being generated at once."""
    grade_seconds: float | None = None
    """Per episode (a group's episodes are graded at once)."""
    generated_tokens: float | None = None
    """Per episode; rollout.sampling.max_tokens x rollout.max_turns (capped at max_context) when None."""
    episode_tokens: float | None = None
    """Per episode, trained (prompt, tool outputs and generated tokens); rollout.max_context (the bound) when None."""
    group_seconds: float | None = None
    """Measured: one group, generated and graded, on one engine."""
    learner_seconds: float | None = None
    """Measured: one learner step (training and publishing the policy)."""
    step_seconds: float | None = None
    """Measured: one mid-training step."""


@dataclass(frozen=True)
class RLTiming:
    rollout_seconds: float
    train_seconds: float

    @property
    def sync_seconds(self) -> float:
        return self.rollout_seconds + self.train_seconds

    @property
    def async_seconds(self) -> float:
        return max(self.rollout_seconds, self.train_seconds)


@dataclass(frozen=True)
class Plan:
    recipe: Recipe
    layout: ParallelismSection
    rank: RankMemory
    engine: EngineMemory | None
    tokens_per_micro_batch: int
    tokens_per_step: int
    flops_per_step: float
    step_seconds: float | None
    rl: RLTiming | None

    @property
    def device_bytes(self) -> float | None:
        gib = self.recipe.cluster.device_memory_gib
        return None if gib is None else (gib - RESERVE_GIB) * (1 - FRAGMENTATION) * GIB

    @property
    def fits(self) -> bool | None:
        usable = self.device_bytes
        return None if usable is None else self.rank.total <= usable


def _dp(recipe: Recipe, p: ParallelismSection) -> int:
    return recipe.cluster.world_size // (p.tp * p.pp * p.cp)


def _micro_batches(recipe: Recipe, p: ParallelismSection) -> int:
    return max(1, recipe.train.global_batch_size // (recipe.train.micro_batch_size * _dp(recipe, p)))


def _sequence_tokens(recipe: Recipe) -> int:
    """Tokens of one training sequence: a mid-training or SFT sample, or (RL) the longest episode segment."""
    if recipe.sft:
        return recipe.sft.max_length
    return recipe.data.seq_length if recipe.data else recipe.rollout.max_context


def optimizer_bytes(recipe: Recipe, p: ParallelismSection, params: Params) -> int:
    """Optimizer state of one rank: Adam's two fp32 moments per parameter, or with optim.name muon one fp32 momentum
    per weight matrix (Adam's moments for the rest); plus fp32 master weights of a bf16 model. The distributed
    optimizer shards it all over data (x context) parallelism, expert parameters' over expert data parallelism."""
    o = recipe.optim
    master = 4 if recipe.model.dtype == "bfloat16" else 0
    if o.name == "muon":  # Megatron-Core's Muon shards nothing (recipes.checks refuses the distributed optimizer)
        on_adam = params.embeddings_and_norms + (params.routers if o.muon.router == "adam" else 0)
        return (8 + master) * on_adam + (4 + master) * (params.total - on_adam)
    if not p.distributed_optimizer:
        return (8 + master) * params.total
    data_shards = recipe.cluster.world_size // (p.tp * p.pp)
    expert_shards = recipe.cluster.world_size // (p.etp * p.ep * p.pp)
    return (8 + master) * (params.dense // data_shards + params.expert // expert_shards)


def stage_memory(recipe: Recipe, p: ParallelismSection, stage: int, recompute: bool | None = None) -> RankMemory:
    """A rank of pipeline stage `stage` (every rank of a stage holds the same)."""
    m, train = recipe.model, recipe.train
    recompute = train.recompute_activations if recompute is None else recompute
    params = rank_params(m, p, stage)
    tokens = train.micro_batch_size * -(-_sequence_tokens(recipe) // p.cp)
    micro = _micro_batches(recipe, p)
    b = dtype_bytes(m.dtype)
    reference = params.total * b if recipe.rl is not None and recipe.rl.kl_coeff > 0 else 0
    return RankMemory(
        params.total * b,
        params.total * 4,
        optimizer_bytes(recipe, p, params),
        activation_bytes(m, p, tokens, recompute, micro, stage),
        activation_bytes(m, p, tokens, not recompute, micro, stage),
        reference,
    )


def rank_memory(recipe: Recipe, p: ParallelismSection, recompute: bool | None = None) -> RankMemory:
    """The most loaded rank."""
    return max((stage_memory(recipe, p, stage, recompute) for stage in range(p.pp)), key=lambda memory: memory.total)


def engine_memory(recipe: Recipe) -> EngineMemory | None:
    """One device of a rollout engine (recipes.sizes, the numbers recipes.checks fits to rollout.devices)."""
    r = recipe.rollout
    if r is None:
        return None
    m, p = recipe.model, r.parallelism
    dtype = sized_dtype(r.dtype, r.devices.kind if r.devices else None)
    return EngineMemory(
        engine_weight_bytes_per_device(m, p, dtype), kv_bytes_per_token_per_device(m, p, dtype) * r.max_context, int(r.kv_cache_gib * GIB)
    )


def flops_per_token(m: ModelSection, context: float) -> float:
    """Model FLOPs of a training step per token (forward and backward, 3x the forward's matmuls) at an average
    causal context of `context` tokens."""
    _, active = parameter_counts(m)
    lookup = parameter_breakdown(m).embedding  # the embedding is a lookup, not a matmul
    if m.family == "deepseek_v3":
        width = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
    else:
        width = 2 * m.head_dim
    attention = m.num_layers * 2 * m.num_attention_heads * width * context
    return 3 * (2 * (active - lookup) + attention)


def _generated_per_episode(recipe: Recipe, rates: Rates) -> float:
    r = recipe.rollout
    return rates.generated_tokens or min(r.sampling.max_tokens * r.max_turns, r.max_context)


def make_plan(recipe: Recipe, layout: ParallelismSection | None = None, mfu: float = 0.35, rates: Rates = Rates()) -> Plan:
    p = layout or recipe.parallelism
    m, train = recipe.model, recipe.train
    world = recipe.cluster.world_size
    if recipe.rl is not None:
        episode = min(recipe.rollout.max_context, rates.episode_tokens or recipe.rollout.max_context)
        tokens_per_step = int(recipe.rl.prompts_per_step * recipe.rl.group_size * episode)
        context = episode / 2
    else:
        tokens_per_step = train.global_batch_size * _sequence_tokens(recipe)
        context = _sequence_tokens(recipe) / 2
    flops = flops_per_token(m, context) * tokens_per_step
    if recipe.rl is not None and recipe.rl.kl_coeff > 0:
        flops *= 4 / 3  # the reference policy's forward
    tflops = recipe.cluster.device_tflops
    step_seconds = rates.step_seconds
    if step_seconds is None and tflops:
        step_seconds = flops / (world * tflops * 1e12 * mfu) * (1 + _bubble(recipe, p))
    rl = _rl_timing(recipe, rates, step_seconds) if recipe.rl is not None else None
    tokens = train.micro_batch_size * -(-_sequence_tokens(recipe) // p.cp)
    return Plan(recipe, p, rank_memory(recipe, p), engine_memory(recipe), tokens, tokens_per_step, flops, step_seconds, rl)


def _bubble(recipe: Recipe, p: ParallelismSection) -> float:
    micro = _micro_batches(recipe, p)
    return (p.pp - 1) / (micro + p.pp - 1) if p.pp > 1 else 0.0


def _rl_timing(recipe: Recipe, rates: Rates, train_seconds: float | None) -> RLTiming | None:
    r, rl = recipe.rollout, recipe.rl
    engines = len(r.hosts) * r.engines_per_host
    group = rates.group_seconds
    if group is None and rates.generated_tokens_per_s and rates.grade_seconds is not None:
        group = rl.group_size * _generated_per_episode(recipe, rates) / rates.generated_tokens_per_s + rates.grade_seconds
    train = rates.learner_seconds or train_seconds
    if group is None or train is None:
        return None
    return RLTiming(rl.prompts_per_step * group / engines, train)


def measured_rates(run_dir: Path) -> Rates:
    """A finished or running run's times (medians): mid-training step seconds, or RL learner seconds per step
    (training and publishing) and per-group rollout seconds and generated tokens."""
    from composer.runtime.run_dir import read_metrics

    def median(path: Path, key: str) -> float | None:
        values = [r[key] for r in read_metrics(path) if key in r and r.get("step", 1) > 0] if path.is_file() else []
        return statistics.median(values) if values else None

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (not a composer run, or it has not trained a step yet)")
    learner = median(metrics, "learner_seconds")
    if learner is None:
        return Rates(step_seconds=median(metrics, "step_seconds"))
    rollouts = run_dir / "rollout_metrics.jsonl"
    return Rates(
        learner_seconds=learner + (median(metrics, "sync_seconds") or 0.0),
        group_seconds=median(rollouts, "group_seconds"),
        generated_tokens_per_s=median(rollouts, "generated_tokens_per_s"),
    )


# --- layouts -------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(recipe: Recipe) -> list[ParallelismSection]:
    """Layouts of the recipe's world size that its checks (recipes.checks) accept and the trainers build: tp within
    a host, cp a power of two, etp 1, sequence parallelism with tp > 1, the recipe's distributed optimizer; pp for
    mid-training only (the RL learner does not pipeline) and not with tied embeddings (trainer.model refuses it)."""
    m, world = recipe.model, recipe.cluster.world_size
    pps = [1] if recipe.rl is not None or m.tie_word_embeddings else _divisors(m.num_layers)
    cps = [c for c in _divisors(world) if c & (c - 1) == 0]
    eps = _divisors(m.num_experts) if m.is_moe else [1]
    out = []
    for tp, pp, cp, ep in itertools.product(_divisors(recipe.cluster.procs_per_host), pps, cps, eps):
        p = recipe.parallelism.model_copy(update=dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=1, dp=None, sequence_parallel=tp > 1))
        if not check_recipe(recipe.model_copy(update={"parallelism": p})):
            out.append(p)
    return out


def communication_seconds(recipe: Recipe, p: ParallelismSection) -> float:
    """Exposed communication of one step per rank under the assumed links (LINK_GBPS), to rank layouts: tensor
    parallelism's gathers and reductions, expert dispatch, the gradient reduction, and context parallelism's ring
    when it leaves the host (within one, it hides behind attention); pipeline parallelism pays its bubble instead."""
    m, per_host = recipe.model, recipe.cluster.procs_per_host
    b = dtype_bytes(m.dtype)
    tokens = recipe.train.micro_batch_size * -(-_sequence_tokens(recipe) // p.cp)
    micro = _micro_batches(recipe, p)
    layers = m.num_layers // p.pp

    def link(span: int) -> float:
        return LINK_GBPS["host" if span <= per_host else "network"] * 1e9

    seconds = 0.0
    if p.tp > 1:  # 4 all-gathers / reduce-scatters per layer forward, as many backward
        seconds += micro * layers * 8 * tokens * m.hidden_size * b * (p.tp - 1) / p.tp / link(p.tp)
    if m.is_moe and p.ep > 1:
        sp = tokens // p.tp
        seconds += micro * len(m.moe_layers) // p.pp * 4 * sp * m.moe_top_k * m.hidden_size * b * (p.ep - 1) / p.ep / link(p.ep * p.etp)
    if p.cp > 1 and p.tp * p.cp > per_host:  # keys and values once round the ring forward, with their gradients backward
        if m.family == "deepseek_v3":
            width = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
            heads = m.num_attention_heads // p.tp
        else:
            width, heads = 2 * m.head_dim, max(1, m.num_kv_heads // p.tp)
        seconds += micro * layers * 3 * (p.cp - 1) * tokens * heads * width * b / link(p.tp * p.cp)
    params, world = rank_params(m, p), recipe.cluster.world_size
    # the fp32 gradients: dense ones reduced over data x context parallelism, expert ones over expert data parallelism
    for count, group in ((params.dense, world // (p.tp * p.pp)), (params.expert, world // (p.etp * p.ep * p.pp))):
        if group > 1:
            seconds += 2 * count * 4 * (group - 1) / group / link(world)
    return seconds


def layouts_that_fit(recipe: Recipe, mfu: float = 0.35) -> list[tuple[Plan, float]]:
    """(plan, relative step time) of each candidate layout that fits the device memory, best first. Without
    cluster.device_memory_gib every candidate counts as fitting."""
    out = []
    for p in candidate_layouts(recipe):
        plan = make_plan(recipe, p, mfu)
        if plan.fits is False:
            continue
        compute = plan.flops_per_step / (recipe.cluster.world_size * (recipe.cluster.device_tflops or 100.0) * 1e12 * mfu)
        out.append((plan, compute * (1 + _bubble(recipe, p)) + communication_seconds(recipe, p)))
    return sorted(out, key=lambda item: (item[1], item[0].rank.total))


# --- refusals ------------------------------------------------------------------------------------


def fit_problems(recipe: Recipe) -> list[Problem]:
    """Whether the recipe's layout fits cluster.device_memory_gib, its engines fit the hosts rollout.devices declares and
    hold one max_context sequence; each problem names the key to change."""
    problems = declared_engine_problems(recipe)
    plan = make_plan(recipe)
    if plan.engine is not None and plan.engine.sequences < 1:
        problems.append(
            Problem(
                "rollout.kv_cache_gib",
                f"{recipe.rollout.kv_cache_gib} GiB holds no sequence of rollout.max_context="
                f"{recipe.rollout.max_context} ({plan.engine.kv_per_sequence / GIB:.2f} GiB of KV cache each)",
            )
        )
    if plan.fits is False:
        problems.append(Problem(*_suggestion(recipe, plan)))
    return problems


def check_fits(recipe: Recipe) -> None:
    """Refuse (one message) a recipe the plan says cannot run: before --dry-run prints and before a launch."""
    problems = fit_problems(recipe)
    if problems:
        raise UserError("the plan says this recipe cannot run (composer plan RECIPE shows why):\n" + "\n".join(f"  {p}" for p in problems))


def _suggestion(recipe: Recipe, plan: Plan) -> tuple[str, str]:
    """(key to change, message): the first change that fits, of recompute, distributed optimizer, layout, batch."""
    have = (
        f"{plan.rank.total / GIB:.1f} GiB per rank (parameters {plan.rank.parameters / GIB:.1f}, gradients "
        f"{plan.rank.gradients / GIB:.1f}, optimizer {plan.rank.optimizer / GIB:.1f}, activations {plan.rank.activations / GIB:.1f}) "
        f"exceeds the {plan.device_bytes / GIB:.1f} GiB usable of cluster.device_memory_gib={recipe.cluster.device_memory_gib}"
    )
    t, p = recipe.train, recipe.parallelism
    tries = []
    if not t.recompute_activations:
        tries.append(
            (
                "train.recompute_activations",
                "true",
                recipe.model_copy(update={"train": t.model_copy(update={"recompute_activations": True})}),
            )
        )
    if not p.distributed_optimizer:
        tries.append(
            (
                "parallelism.distributed_optimizer",
                "true",
                recipe.model_copy(update={"parallelism": p.model_copy(update={"distributed_optimizer": True})}),
            )
        )
    for key, value, changed in tries:
        fixed = make_plan(changed)
        if fixed.fits and not check_recipe(changed):  # e.g. Muon and QK-clip with bf16 refuse the distributed optimizer
            return key, f"{have}; set {key}: {value} ({fixed.rank.total / GIB:.1f} GiB)"

    def changes(layout: ParallelismSection) -> list[str]:
        return [
            f"parallelism.{k}={getattr(layout, k)}"
            for k in ("tp", "pp", "cp", "ep", "etp", "sequence_parallel")
            if getattr(layout, k) != getattr(p, k)
        ]

    fitting = layouts_that_fit(recipe)
    if fitting:
        closest, _ = min(fitting, key=lambda item: len(changes(item[0].layout)))  # the fewest keys, then the fastest
        return "parallelism", (
            f"{have}; the closest layout that fits: {' '.join(changes(closest.layout))} "
            f"({closest.rank.total / GIB:.1f} GiB; `composer plan` lists every layout that fits)"
        )
    if t.micro_batch_size > 1:
        return "train.micro_batch_size", f"{have}; no layout of world size {recipe.cluster.world_size} fits: lower train.micro_batch_size"
    return "cluster.hosts", f"{have}; no layout of world size {recipe.cluster.world_size} fits: add hosts"
