"""Checks across fields, run before anything launches.

Each problem names every YAML path involved and how to fix it; all problems are reported at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer.recipes.errors import UserError
from composer.recipes.schema import ModelSection, ParallelismSection, Recipe, RolloutSection
from composer.recipes.sizes import kv_bytes_per_token_per_device, sized_dtype


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def check_recipe(recipe: Recipe) -> list[Problem]:
    problems: list[Problem] = []
    problems += _check_model(recipe)
    problems += _check_parallelism(recipe)
    problems += _check_attention(recipe)
    problems += _check_batches(recipe)
    problems += _check_lengths(recipe)
    problems += _check_rl(recipe)
    problems += _check_optim(recipe)
    problems += _check_rollout_engines(recipe)
    return problems


def _check_model(r: Recipe) -> list[Problem]:
    return model_problems(r.model)


def model_problems(m: ModelSection) -> list[Problem]:
    """Whether the model section describes an architecture the families define."""
    out = []
    if m.num_attention_heads % m.num_kv_heads:
        out.append(Problem("model.num_kv_heads", f"{m.num_kv_heads} does not divide model.num_attention_heads={m.num_attention_heads}"))
    if m.is_moe:
        if not 0 < m.moe_top_k <= m.num_experts:
            out.append(Problem("model.moe_top_k", f"must be between 1 and model.num_experts={m.num_experts}, got {m.moe_top_k}"))
        if m.moe_ffn_hidden_size == 0:
            out.append(Problem("model.moe_ffn_hidden_size", "must be set for an MoE model (model.num_experts > 0)"))
    else:
        for key in ("moe_top_k", "moe_ffn_hidden_size", "num_shared_experts"):
            if getattr(m, key):
                out.append(Problem(f"model.{key}", "is set but model.num_experts is 0 (dense model); remove it or set num_experts"))
        if m.ffn_hidden_size == 0:
            out.append(Problem("model.ffn_hidden_size", "must be set for a dense model (model.num_experts is 0)"))
    if m.family == "llama" and m.is_moe:
        out.append(Problem("model.family", "`llama` is dense; use `qwen3_moe` for a model with experts"))
    return out + (_deepseek_v3_problems(m) if m.family == "deepseek_v3" else _no_deepseek_keys(m))


_DEEPSEEK_ONLY = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense",
    "moe_router_groups",
    "moe_router_group_top_k",
    "routed_scaling_factor",
    "moe_router_bias_update_rate",
    "yarn",
    "num_mtp_layers",
)


def _no_deepseek_keys(m: ModelSection) -> list[Problem]:
    defaults = ModelSection.model_fields
    return [
        Problem(f"model.{key}", f"is a deepseek_v3 setting; model.family is {m.family!r} (remove it)")
        for key in _DEEPSEEK_ONLY
        if getattr(m, key) != defaults[key].default
    ]


def _deepseek_v3_problems(m: ModelSection) -> list[Problem]:
    """The shapes HF DeepseekV3 and Megatron's MLA + sigmoid router compute alike."""
    out = []
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not getattr(m, key):
            out.append(Problem(f"model.{key}", "must be set for model.family deepseek_v3 (multi-head latent attention)"))
    if m.head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim:
        out.append(
            Problem(
                "model.head_dim",
                f"must be qk_nope_head_dim + qk_rope_head_dim = {m.qk_nope_head_dim + m.qk_rope_head_dim} for deepseek_v3, got {m.head_dim}",
            )
        )
    if m.qk_rope_head_dim % 2:
        out.append(Problem("model.qk_rope_head_dim", f"must be even (RoPE rotates channel pairs), got {m.qk_rope_head_dim}"))
    if m.num_kv_heads != m.num_attention_heads:
        out.append(
            Problem(
                "model.num_kv_heads", f"must equal model.num_attention_heads={m.num_attention_heads} for deepseek_v3 (MLA has no KV groups)"
            )
        )
    if not m.is_moe:
        out.append(Problem("model.num_experts", "deepseek_v3 is an MoE; set num_experts, moe_top_k, moe_ffn_hidden_size"))
        return out
    if m.num_shared_experts < 1:
        out.append(Problem("model.num_shared_experts", "deepseek_v3 layers always have shared experts; set it to at least 1"))
    if m.first_k_dense >= m.num_layers:
        out.append(Problem("model.first_k_dense", f"{m.first_k_dense} leaves no MoE layer in model.num_layers={m.num_layers}"))
    if m.first_k_dense and not m.ffn_hidden_size:
        out.append(Problem("model.ffn_hidden_size", "must be set: it is the width of the first_k_dense dense layers"))
    if not m.norm_topk_prob:
        out.append(Problem("model.norm_topk_prob", "must be true for deepseek_v3: Megatron's sigmoid router always renormalises the top-k"))
    groups, picked = m.moe_router_groups, m.moe_router_group_top_k
    if m.num_experts % groups:
        out.append(Problem("model.moe_router_groups", f"{groups} does not divide model.num_experts={m.num_experts}"))
    if picked > groups:
        out.append(Problem("model.moe_router_group_top_k", f"{picked} is more than model.moe_router_groups={groups}"))
    if groups > 1 and m.moe_top_k != 2 * picked:
        # HF scores a group by its 2 best experts; Megatron by its top_k / group_top_k best
        out.append(
            Problem(
                "model.moe_router_group_top_k",
                f"must be model.moe_top_k / 2 = {m.moe_top_k / 2:g} with group-limited routing (groups are scored by their two best experts), got {picked}",
            )
        )
    if groups > 1 and m.num_experts // groups < 2:
        out.append(Problem("model.moe_router_groups", f"each group needs at least 2 experts; {m.num_experts} experts in {groups} groups"))
    if m.num_mtp_layers and m.mtp == "carry" and not m.checkpoint:
        out.append(
            Problem(
                "model.mtp",
                "`carry` copies the multi-token-prediction layers from model.checkpoint, which is unset; "
                "set it, or mtp: drop (or num_mtp_layers: 0)",
            )
        )
    if m.yarn and m.yarn.mscale != 1 and not m.yarn.mscale_all_dim:
        out.append(
            Problem(
                "model.yarn.mscale", f"{m.yarn.mscale} acts only with model.yarn.mscale_all_dim (as in HF); set mscale: 1 or mscale_all_dim"
            )
        )
    return out


def _check_parallelism(r: Recipe) -> list[Problem]:
    world = r.cluster.world_size
    where = f"cluster: {len(r.cluster.hosts)} host(s) x procs_per_host={r.cluster.procs_per_host} = world size {world}"
    return world_problems(r.parallelism, world, where) + split_problems(r.model, r.parallelism)


def world_problems(p: ParallelismSection, world: int, where: str) -> list[Problem]:
    """Whether the parallel sizes fit a world of `world` processes (`where` says where that number comes from).

    The one check of sizes against the world: recipes are checked with it before launch, ranks again at start.
    """
    model_parallel = p.tp * p.pp * p.cp
    if world % model_parallel:
        return [Problem("parallelism", f"tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model_parallel} does not divide the {where}")]
    out, dp = [], world // model_parallel
    if p.dp is not None and p.dp != dp:
        out.append(
            Problem(
                "parallelism.dp", f"world size must equal tp*pp*cp*dp: {p.tp}*{p.pp}*{p.cp}*{p.dp} != {world} ({where}); dp would be {dp}"
            )
        )
    if (world // p.pp) % (p.ep * p.etp):
        out.append(Problem("parallelism.ep", f"ep*etp = {p.ep}*{p.etp} does not divide world_size/pp = {world // p.pp}"))
    return out


def split_problems(m: ModelSection, p: ParallelismSection) -> list[Problem]:
    """Whether the model can be split by these parallel sizes (whatever the world size)."""
    out = []
    if m.num_attention_heads % p.tp:
        out.append(Problem("parallelism.tp", f"{p.tp} does not divide model.num_attention_heads={m.num_attention_heads}"))
    if m.num_kv_heads % p.tp:
        out.append(
            Problem(
                "parallelism.tp",
                f"{p.tp} does not divide model.num_kv_heads={m.num_kv_heads} (each tensor-parallel rank needs whole KV heads)",
            )
        )
    if m.vocab_size % p.tp:
        out.append(Problem("parallelism.tp", f"{p.tp} does not divide model.vocab_size={m.vocab_size}"))
    if (not m.is_moe or m.first_k_dense) and m.ffn_hidden_size % p.tp:
        out.append(Problem("parallelism.tp", f"{p.tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}"))
    if m.num_shared_experts and (m.moe_ffn_hidden_size * m.num_shared_experts) % p.tp:
        out.append(
            Problem(
                "parallelism.tp",
                f"{p.tp} does not divide the shared experts' width model.moe_ffn_hidden_size * model.num_shared_experts = {m.moe_ffn_hidden_size * m.num_shared_experts}",
            )
        )
    if m.num_layers % p.pp:
        out.append(Problem("parallelism.pp", f"{p.pp} does not divide model.num_layers={m.num_layers}"))
    if p.sequence_parallel and p.tp == 1:
        out.append(Problem("parallelism.sequence_parallel", "needs tp > 1 (with tp=1 there is nothing to shard); set it to false"))
    if m.is_moe:
        if m.num_experts % p.ep:
            out.append(Problem("parallelism.ep", f"{p.ep} does not divide model.num_experts={m.num_experts}"))
        if m.moe_ffn_hidden_size % p.etp:
            out.append(Problem("parallelism.etp", f"{p.etp} does not divide model.moe_ffn_hidden_size={m.moe_ffn_hidden_size}"))
        if p.tp > 1 and not p.sequence_parallel:
            out.append(Problem("parallelism.sequence_parallel", f"must be true for an MoE model with tp={p.tp} (Megatron requires it)"))
    elif p.ep > 1 or p.etp > 1:
        out.append(Problem("parallelism.ep", "expert parallelism needs an MoE model (model.num_experts > 0)"))
    return out


def _check_attention(r: Recipe) -> list[Problem]:
    """Packed sequences and context parallelism run in composer's SDPA attention (trainer.kernels)."""
    p, out = r.parallelism, []
    uses = [
        what
        for what, used in (
            (f"parallelism.cp={p.cp}", p.cp > 1),
            ("data.attention=document", r.data is not None and r.data.attention == "document"),
            ("rl.pack_sequences", r.rl is not None and r.rl.pack_sequences),
            ("sft.pack", r.sft is not None and r.sft.pack),
        )
        if used
    ]
    if uses and r.model.kernels.attention == "local":
        out.append(
            Problem(
                "model.kernels.attention",
                f"{', '.join(uses)} need attention sdpa (or auto); Megatron's local attention "
                "computes neither packed sequences nor context parallelism",
            )
        )
    if p.pp > 1 and p.cp > 1:
        out.append(Problem("parallelism.cp", f"context parallelism with pipeline parallelism (pp={p.pp}) is not built; use cp=1 or pp=1"))
    if p.pp > 1 and r.data is not None and r.data.attention == "document":
        out.append(Problem("data.attention", f"document attention with pipeline parallelism (pp={p.pp}) is not built; use causal or pp=1"))
    if p.pp > 1 and r.sft is not None and r.sft.pack:
        out.append(
            Problem("sft.pack", f"packed conversations with pipeline parallelism (pp={p.pp}) are not built; set sft.pack: false or pp=1")
        )
    return out


def _check_batches(r: Recipe) -> list[Problem]:
    p, t = r.parallelism, r.train
    world = r.cluster.world_size
    model_parallel = p.tp * p.pp * p.cp
    if world % model_parallel:
        return []  # already reported; dp is undefined
    dp = world // model_parallel
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        return [
            Problem(
                "train.global_batch_size",
                f"{t.global_batch_size} is not a multiple of train.micro_batch_size x dp = {t.micro_batch_size} x {dp} = {per_step}",
            )
        ]
    return []


def _check_lengths(r: Recipe) -> list[Problem]:
    out, limit = [], r.model.max_position_embeddings
    if r.data and r.data.seq_length > limit:
        out.append(Problem("data.seq_length", f"{r.data.seq_length} exceeds model.max_position_embeddings={limit}"))
    if r.sft and r.sft.max_length > limit:
        out.append(Problem("sft.max_length", f"{r.sft.max_length} exceeds model.max_position_embeddings={limit}"))
    if r.sft and r.sft.max_observation_tokens is not None and not any(s.kind == "references" for s in r.sft.sources):
        out.append(Problem("sft.max_observation_tokens", "cuts the tool outputs of a `references` source; sft.sources has none"))
    if r.rollout and r.rollout.max_context > limit:
        out.append(Problem("rollout.max_context", f"{r.rollout.max_context} exceeds model.max_position_embeddings={limit}"))
    if r.rollout and r.rollout.sampling.max_tokens >= r.rollout.max_context:
        out.append(
            Problem(
                "rollout.sampling.max_tokens",
                f"{r.rollout.sampling.max_tokens} leaves no room for a prompt in rollout.max_context={r.rollout.max_context}",
            )
        )
    observed = r.rollout.max_observation_tokens if r.rollout else None  # unset: the reply's budget, checked above
    if r.rollout and observed and observed + r.rollout.sampling.max_tokens >= r.rollout.max_context:
        out.append(
            Problem(
                "rollout.max_observation_tokens",
                f"{observed} and a reply of rollout.sampling.max_tokens={r.rollout.sampling.max_tokens} "
                f"leave no room for a prompt in rollout.max_context={r.rollout.max_context}",
            )
        )
    if r.parallelism.cp > 1 and r.data and r.data.seq_length % (2 * r.parallelism.cp):
        out.append(
            Problem(
                "data.seq_length",
                f"{r.data.seq_length} is not a multiple of 2*cp = {2 * r.parallelism.cp}: context "
                f"parallelism splits each sample into 2*cp equal chunks",
            )
        )
    if r.parallelism.cp > 1 and r.sft and r.sft.max_length % (2 * r.parallelism.cp):
        out.append(
            Problem(
                "sft.max_length",
                f"{r.sft.max_length} is not a multiple of 2*cp = {2 * r.parallelism.cp}: context parallelism splits each sample into 2*cp equal chunks",
            )
        )
    if r.optim.min_lr > r.optim.lr:
        out.append(Problem("optim.min_lr", f"{r.optim.min_lr} is above optim.lr={r.optim.lr}"))
    if r.optim.warmup_steps > r.train.steps:
        out.append(Problem("optim.warmup_steps", f"{r.optim.warmup_steps} is more than train.steps={r.train.steps}"))
    return out


def _check_optim(r: Recipe) -> list[Problem]:
    out = []
    o, p = r.optim, r.parallelism
    if o.muon is not None and o.name != "muon":
        out.append(Problem("optim.muon", f"Muon settings, but optim.name is {o.name}; set optim.name: muon or remove optim.muon"))
    if o.name == "muon" and p.distributed_optimizer:
        out.append(
            Problem(
                "parallelism.distributed_optimizer",
                "Megatron-Core 0.16.1's Muon does not shard optimizer state "
                "(no distributed optimizer); set it to false with optim.name: muon",
            )
        )
    if o.qk_clip is not None and p.cp > 1:
        out.append(
            Problem(
                "optim.qk_clip",
                f"QK-clip with context parallelism (parallelism.cp={p.cp}) is not built: a rank sees "
                "only its share of each sequence's logits; remove optim.qk_clip or use cp=1",
            )
        )
    if o.qk_clip is not None and r.model.family == "qwen3_moe":
        out.append(
            Problem(
                "optim.qk_clip",
                "model.family qwen3_moe normalises queries and keys (QK-norm) after the projections that "
                "QK-clip scales, so clipping cannot lower its logits; remove optim.qk_clip",
            )
        )
    if o.qk_clip is not None and p.distributed_optimizer and r.model.dtype == "bfloat16":
        out.append(
            Problem(
                "optim.qk_clip",
                "with model.dtype bfloat16 the distributed optimizer holds the fp32 master weights in "
                "shards, which Megatron's QK-clip cannot scale; set parallelism.distributed_optimizer: false",
            )
        )
    return out


def _check_rl(r: Recipe) -> list[Problem]:
    out = []
    rl_parts = {"rollout": r.rollout, "env": r.env, "rl": r.rl}
    present = [k for k, v in rl_parts.items() if v is not None]
    # an SFT recipe may hold env alone: its references source renders the tasks env describes
    if r.sft is not None and present == ["env"]:
        if not any(s.kind == "references" for s in r.sft.sources):
            out.append(Problem("env", "an SFT recipe reads env only for a `references` source, and sft.sources has none; remove env"))
    elif present and len(present) < 3:
        missing = [k for k in rl_parts if k not in present]
        out.append(Problem(missing[0], f"an RL recipe needs rollout, env and rl together; missing: {', '.join(missing)}"))
    if r.rollout and r.rollout.engine == "embedded" and r.rollout.hosts != ["localhost"]:
        out.append(Problem("rollout.hosts", "engines on other hosts are vLLM servers; set rollout.engine: server (or hosts: [localhost])"))
    if r.rollout and r.rollout.engine == "embedded" and r.rollout.engines_per_host > 1:
        out.append(
            Problem(
                "rollout.engines_per_host", "more than one engine per host needs rollout.engine: server (one embedded engine per process)"
            )
        )
    if r.rl and r.rollout and (r.rollout.sampling.top_p < 1 or r.rollout.sampling.top_k > 0):
        # the engine would report logprobs renormalised over the kept tokens, which the learner does not reproduce
        out.append(
            Problem(
                "rollout.sampling",
                "RL samples from the full tempered distribution the learner scores; "
                "set top_p: 1 and top_k: -1 (use temperature to sharpen)",
            )
        )
    if r.rl and r.rl.router_replay == "r3" and not r.model.is_moe:
        out.append(Problem("rl.router_replay", "`r3` needs an MoE model (model.num_experts > 0); set it to `off`"))
    if r.rollout and r.rollout.harness == "tools" and r.rollout.max_turns == 1:
        out.append(Problem("rollout.harness", "tools act over several turns; set rollout.max_turns > 1"))
    if r.rollout and r.env and r.rollout.harness == "reply" and any(t.name == "repo" for t in r.env.tasks):
        out.append(Problem("rollout.harness", "repository tasks are worked on with tools; set rollout.harness: tools"))
    evaluated = r.rl.eval.tasks if r.rl and r.rl.eval else []
    if r.rollout and r.env and r.rollout.harness == "reply" and "recall" in [t.name for t in r.env.tasks] + evaluated:
        out.append(Problem("rollout.harness", "recall tasks are read from files with tools; set rollout.harness: tools"))
    function_workspaces = r.env and r.rollout and r.rollout.harness == "tools" and any(t.name != "repo" for t in r.env.tasks)
    if function_workspaces and "localhost" not in r.env.sandbox.hosts:
        out.append(
            Problem(
                "env.sandbox.hosts",
                "rollout.harness: tools keeps function tasks' workspaces (solution.py) on this machine; add localhost to env.sandbox.hosts",
            )
        )
    if r.rollout and r.rollout.summarize_at is not None and r.rollout.max_turns == 1:
        out.append(Problem("rollout.summarize_at", "self-summarization happens between turns; set rollout.max_turns > 1"))
    summarizes = r.rollout and r.rollout.summarize_at is not None and r.rollout.compaction == "summarize"
    if r.rl and r.rl.summary_reward > 0 and not summarizes:
        out.append(
            Problem(
                "rl.summary_reward",
                "rewards summaries: set rollout.summarize_at with rollout.compaction: summarize, or rl.summary_reward: 0 "
                "(e.g. to evaluate another compaction with `composer eval`)",
            )
        )
    if r.rl and r.rl.eval and r.env:
        out += _eval_split_problems(r.rl.eval.tasks, r.env.tasks)
    if r.env:
        out += _task_count_problems(r.env.tasks)
    return out


def _task_count_problems(task_sets: list) -> list[Problem]:
    """held_out against the set's size where the recipe alone says it: `limit`, and a repo set's `num_tasks` (the most
    tasks `composer env build` makes); held_out must leave some for training."""
    out = []
    for i, ts in enumerate(task_sets):
        known = {f"env.tasks.{i}.limit": ts.limit}
        if ts.repo is not None:
            known[f"env.tasks.{i}.repo.num_tasks"] = ts.repo.num_tasks
        if ts.repo is not None and ts.limit is not None and ts.limit > ts.repo.num_tasks:
            out.append(
                Problem(
                    f"env.tasks.{i}.limit",
                    f"{ts.limit} is more than repo.num_tasks={ts.repo.num_tasks}, the tasks "
                    "`composer env build` makes; lower it or raise num_tasks",
                )
            )
        sizes = {path: n for path, n in known.items() if n is not None}
        if ts.held_out and sizes:
            path, size = min(sizes.items(), key=lambda kv: kv[1])
            if ts.held_out >= size:
                out.append(
                    Problem(
                        f"env.tasks.{i}.held_out",
                        f"{ts.held_out} held out of the {size} tasks {ts.name} has ({path}={size}) "
                        "leaves none for training; hold out fewer",
                    )
                )
    return out


def _check_rollout_engines(r: Recipe) -> list[Problem]:
    # Whether the engines fit the hosts' devices (rollout.devices) is the cluster's to say: cluster.engine_fit.
    return [] if r.rollout is None else engine_split_problems(r.model, r.rollout)


def engine_split_problems(m: ModelSection, rollout: RolloutSection) -> list[Problem]:
    """Whether vLLM can split the model as rollout.parallelism asks, and its KV cache hold one whole context."""
    p, out = rollout.parallelism, []
    if m.num_attention_heads % p.tp:
        out.append(Problem("rollout.parallelism.tp", f"{p.tp} does not divide model.num_attention_heads={m.num_attention_heads}"))
    if (m.num_kv_heads % p.tp) if p.tp <= m.num_kv_heads else (p.tp % m.num_kv_heads):
        out.append(
            Problem(
                "rollout.parallelism.tp",
                f"{p.tp} and model.num_kv_heads={m.num_kv_heads}: one must divide the other "
                "(vLLM splits the KV heads, or replicates them when tp exceeds them)",
            )
        )
    if p.pp > m.num_layers:
        out.append(Problem("rollout.parallelism.pp", f"{p.pp} stages for model.num_layers={m.num_layers}"))
    if p.enable_expert_parallel and not m.is_moe:
        out.append(Problem("rollout.parallelism.enable_expert_parallel", "needs an MoE model (model.num_experts > 0); set it to false"))
    elif p.enable_expert_parallel and m.num_experts % p.ep:
        out.append(
            Problem(
                "rollout.parallelism",
                f"model.num_experts={m.num_experts} is not divisible by the expert-parallel size "
                f"tp x dp = {p.tp} x {p.dp} = {p.ep} (enable_expert_parallel gives each device whole experts)",
            )
        )
    elif m.is_moe and m.moe_ffn_hidden_size % p.tp:
        out.append(
            Problem(
                "rollout.parallelism.tp",
                f"{p.tp} does not divide model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} "
                "(or shard whole experts: enable_expert_parallel)",
            )
        )
    if (not m.is_moe or m.first_k_dense) and m.ffn_hidden_size % p.tp:
        out.append(Problem("rollout.parallelism.tp", f"{p.tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}"))
    dtype = sized_dtype(rollout.dtype, rollout.devices.kind if rollout.devices else None)
    one_context = kv_bytes_per_token_per_device(m, p, dtype) * rollout.max_context
    if one_context > rollout.kv_cache_gib * 2**30:
        # vLLM refuses to start an engine whose KV cache cannot hold one request of max_model_len tokens
        out.append(
            Problem(
                "rollout.kv_cache_gib",
                f"{rollout.kv_cache_gib:g} GiB per device cannot hold one rollout.max_context="
                f"{rollout.max_context} tokens of KV cache ({one_context / 2**30:.2f} GiB at "
                f"{dtype} with rollout.parallelism tp={p.tp} pp={p.pp}); raise it or lower max_context",
            )
        )
    if rollout.engine == "embedded" and p.dp > 1:
        out.append(
            Problem("rollout.parallelism.dp", "data parallelism needs rollout.engine: server (vLLM's offline engine serves one replica)")
        )
    return out


def _eval_split_problems(eval_sets: list[str], train_sets: list) -> list[Problem]:
    """Held-out evaluation must never see a training task: a set that is trained on is evaluated only on its split."""
    out = []
    for name in dict.fromkeys(eval_sets):
        trained = [j for j, ts in enumerate(train_sets) if ts.name == name]
        if len(trained) > 1:
            out.append(Problem(f"env.tasks.{trained[1]}", f"{name} is listed more than once; rl.eval needs one held-out split per set"))
        elif trained and train_sets[trained[0]].held_out == 0:
            out.append(
                Problem(
                    f"env.tasks.{trained[0]}.held_out",
                    f"rl.eval evaluates {name}, which is trained on: hold out some of its tasks (held_out: N)",
                )
            )
    return out


def refuse_unhonoured(recipe: Recipe, command: str, unhonoured: dict[str, str]) -> None:
    """Refuse recipe keys that `command` does not honour yet, when set to anything but their default.

    `unhonoured` maps a dotted path (`parallelism.pp`) to the reason; every offending key is named at once.
    """
    problems = []
    for path, reason in unhonoured.items():
        value, default = _value_and_default(recipe, path)
        if value != default:
            problems.append(f"  {path}: {command} does not support {value!r} here ({reason}); leave it at {default!r}")
    if problems:
        raise UserError(f"{command}: the recipe sets keys this command cannot honour:\n" + "\n".join(problems))


def refuse_resume_changes(saved: Recipe, new: Recipe, paths: list[str], saved_from: str, depends: str, flag: str = "--resume") -> None:
    """--resume (or `flag`): refuse a recipe that changes any of `paths` (what the run's saved state `depends` on)."""
    changed = []
    for path in paths:
        before, after = _value_at(saved, path), _value_at(new, path)
        if before != after:
            changed.append(f"{path} changed" if isinstance(before, list) else f"{path}: {before!r} -> {after!r}")
    if changed:
        raise UserError(
            f"{flag}: the recipe changes what {depends} depend on ({'; '.join(changed)}) compared to {saved_from}; "
            f"use the run's values, or start a new run"
        )


def _value_at(recipe: Recipe, path: str) -> object:
    node: object = recipe
    for part in path.split("."):
        node = getattr(node, part) if node is not None else None
    return node


def _value_and_default(recipe: Recipe, path: str) -> tuple[object, object]:
    section, _, key = path.rpartition(".")
    node = _value_at(recipe, section) if section else recipe
    if node is None:
        return None, None  # the section is absent, so the key is not set
    field = type(node).model_fields[key]
    default = field.default_factory() if field.default_factory else field.default
    return getattr(node, key), default
