"""Rollout engines at the size of the model, before anything starts: rollout.parallelism checked against the model
and the hosts' devices and memory, the devices each engine rank and learner rank gets, the vLLM options per
device kind, and the plan `--dry-run` prints (multi-node engines included)."""

import os
import shlex
import subprocess
import sys

import pytest

from composer.cluster.placement import RANK_CORES_ENV, HostDevices, place_host
from composer.recipes.errors import UserError
from composer.recipes.loader import RecipeError, load_recipe
from tests.conftest import RECIPES, REPO, run_composer
from tests.integration.test_cluster_plan import flat
from tests.unit.test_recipes import MINIMAL

RL = "env: {tasks: [{name: smoke}]}\nrl: {group_size: 4}\n"


def problems_of(path, overrides=()) -> dict[str, str]:
    """Each YAML path's problems, joined."""
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    problems: dict[str, str] = {}
    for p in info.value.problems:
        problems[p.path] = problems.get(p.path, "") + p.message + "\n"
    return problems


def fit_problems_of(path, overrides=()) -> dict[str, str]:
    """Each YAML path's problems: the recipe's own checks and the engines' fit to the declared hosts (as `composer
    plan`, `recipe validate` and `--dry-run` report a layout that cannot run)."""
    from composer.cluster.plan import fit_problems
    from composer.recipes.checks import check_recipe
    from composer.recipes.loader import apply_overrides, resolve_extends
    from composer.recipes.schema import Recipe

    recipe = Recipe.model_validate(apply_overrides(resolve_extends(path), overrides))
    problems: dict[str, str] = {}
    for p in check_recipe(recipe) + fit_problems(recipe):
        problems[p.path] = problems.get(p.path, "") + p.message + "\n"
    return problems


def rollout(text: str) -> str:
    return MINIMAL + RL + f"rollout: {{max_context: 200, sampling: {{max_tokens: 64}}, {text}}}\n"


@pytest.mark.parametrize(
    "text, path, fragment",
    [
        ("parallelism: {tp: 3}", "rollout.parallelism.tp", "3 does not divide model.num_attention_heads=4"),
        (
            "engine: server, parallelism: {dp: 3, enable_expert_parallel: true}",
            "rollout.parallelism",
            "model.num_experts=4 is not divisible by the expert-parallel size tp x dp = 1 x 3 = 3",
        ),
        ("parallelism: {dp: 2}", "rollout.parallelism.dp", "needs rollout.engine: server"),
        ("kv_cache_gib: 0.00001", "rollout.kv_cache_gib", "cannot hold one rollout.max_context=200 tokens"),
    ],
)
def test_engine_splits_vllm_cannot_make_are_named(write_recipe, text, path, fragment):
    problems = problems_of(write_recipe(rollout(text)))
    assert fragment in problems[path], problems


GPUS = "engine: server, devices: {kind: gpu, per_host: 8, memory_gib: 80}"


@pytest.mark.parametrize(
    "text, overrides, path, fragment",
    [
        (
            GPUS + ", parallelism: {tp: 4}, engines_per_host: 3, hosts: [infer-0]",
            [],
            "rollout.parallelism",
            "= 4 devices per engine x rollout.engines_per_host=3 = 12, but each rollout host (rollout.devices.per_host=8) has 8 GPUs",
        ),
        (
            GPUS + ", parallelism: {tp: 4}, engines_per_host: 2",
            [],
            "rollout.parallelism",
            "+ 2 for the learner's ranks (cluster.procs_per_host; rollout.share_learner_devices is off) = 10",
        ),
        (
            GPUS + ", parallelism: {tp: 4}, hosts: [a, b, c]",
            ["rollout.parallelism.pp=4"],
            "rollout.hosts",
            "3 hosts do not split into engines of 2 hosts each",
        ),
        (
            GPUS + ", parallelism: {tp: 8, pp: 2}, hosts: [localhost, b]",
            [],
            "rollout.hosts",
            "an engine over several hosts runs on hosts reached over SSH, whose ranks meet the first at its name",
        ),
        (
            "engine: server, devices: {kind: cpu, per_host: 4, memory_gib: 16}, parallelism: {tp: 2, enable_expert_parallel: true}, hosts: [c]",
            [],
            "rollout.parallelism.enable_expert_parallel",
            "its CPU fused-MoE kernel crashes (SIGSEGV)",
        ),
        (
            "engine: server, devices: {kind: cpu, per_host: 4, memory_gib: 16}, parallelism: {dp: 2}, hosts: [c]",
            [],
            "rollout.parallelism.dp",
            "its CPU communicator has no all_gatherv",
        ),
        (
            "engine: server, devices: {kind: cpu, per_host: 4, memory_gib: 16}, enforce_eager: false, hosts: [c]",
            [],
            "rollout.enforce_eager",
            "asks for CUDA graphs, which CPU hosts do not have",
        ),
        (
            "engine: server, devices: {kind: cpu, per_host: 4, memory_gib: 0.5}, engines_per_host: 4, kv_cache_gib: 0.25, hosts: [c]",
            [],
            "rollout",
            "4 engine rank(s) on each rollout host (rollout.devices.per_host=4) x (0.00 GiB of weights + rollout.kv_cache_gib=0.25)",
        ),
    ],
)
def test_engines_that_do_not_fit_the_declared_hosts_are_named(write_recipe, text, overrides, path, fragment):
    problems = fit_problems_of(write_recipe(rollout(text)), overrides)
    assert fragment in problems[path], problems


def test_a_model_that_cannot_fit_names_the_keys_to_change():
    problems = fit_problems_of(
        RECIPES / "kimi-k2-rl.yaml",
        ["rollout.dtype=bfloat16", "rollout.parallelism.dp=1", "rollout.parallelism.enable_expert_parallel=false"],
    )
    message = problems["rollout"]
    assert "the model does not fit: 239.0 GiB of weights per GPU" in message
    for key in ("rollout.dtype=bfloat16", "rollout.kv_cache_gib=100", "rollout.devices.memory_gib=140", "raise rollout.parallelism"):
        assert key in message


def recipe_with(*overrides: str):
    return load_recipe(RECIPES / "smoke-rl.yaml", ["model.checkpoint=unused", "rollout.engine=server", *overrides])


def test_gpu_host_engines_get_their_own_gpus_after_the_learners():
    recipe = recipe_with("rollout.parallelism.tp=2", "rollout.engines_per_host=3", "rollout.share_learner_devices=false")
    placement = place_host("localhost", HostDevices("gpu", tuple(range(8)), 80.0), recipe)
    assert placement.learner == ((0,), (1,)) and not placement.learner_shares
    assert [e.env() for e in placement.engines] == [
        {"CUDA_VISIBLE_DEVICES": "2,3"},
        {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    assert placement.learner_env() == {}  # rank i computes on cuda:i already


def test_cpu_host_engine_ranks_get_their_own_cores_and_the_learner_is_bound_off_them():
    recipe = recipe_with("rollout.parallelism.tp=2", "rollout.engines_per_host=2", "rollout.share_learner_devices=false")
    placement = place_host("localhost", HostDevices("cpu", tuple(range(16)), 64.0), recipe)
    assert placement.learner == ((0,), (1,))
    # 14 cores for 4 engine ranks: 3 each, one left to the front ends (as vLLM's own binding reserves one)
    assert [e.env() for e in placement.engines] == [{"VLLM_CPU_OMP_THREADS_BIND": "2-4|5-7"}, {"VLLM_CPU_OMP_THREADS_BIND": "8-10|11-13"}]
    assert placement.front_end == (15,)
    assert placement.learner_env() == {RANK_CORES_ENV: "0|1"}
    shared = place_host("localhost", HostDevices("cpu", (0, 1), 8.0), recipe_with("rollout.parallelism.tp=2"))
    assert shared.learner_shares and shared.learner_env() == {} and shared.engines[0].env() == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_cpu_workarounds_are_forced_on_cpus_only():
    from composer.rollout.engines.vllm_engine import engine_options

    section = recipe_with("rollout.parallelism.tp=2").rollout
    section = section.model_copy(update={"dtype": "float32"})
    cpu = engine_options("/m", MLA_CONFIG, section, "cpu", seed=0, routed_experts=True, tokenizer=True)
    assert cpu["enforce_eager"] is True and cpu["enable_chunked_prefill"] is False and cpu["attention_backend"] == "CPU_MLA"
    gpu = engine_options("/m", MLA_CONFIG, section, "gpu", seed=0, routed_experts=True, tokenizer=True)
    assert not {"enforce_eager", "enable_chunked_prefill", "attention_backend"} & set(gpu)  # vLLM's defaults
    assert gpu["tensor_parallel_size"] == 2 and gpu["distributed_executor_backend"] == "mp"
    eager = section.model_copy(update={"enforce_eager": True})
    assert engine_options("/m", {}, eager, "gpu", seed=0, routed_experts=True, tokenizer=True)["enforce_eager"] is True
    bf16 = section.model_copy(update={"dtype": "bfloat16"})
    assert "attention_backend" not in engine_options("/m", MLA_CONFIG, bf16, "cpu", seed=0, routed_experts=True, tokenizer=True)


MLA_CONFIG = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64}
"""The config.json keys that decide a CPU engine's attention backend (an MLA model vLLM's CPU kernels serve)."""


def test_a_remote_engine_gets_every_cpu_setting_a_local_one_gets():
    """A remote host's server command (one of an engine over two hosts, fp32 MLA) carries what a local server gets."""
    from composer.rl.rollout_hosts import engine_command
    from composer.rollout.engines.vllm_engine import engine_options, server_args, server_env

    recipe = recipe_with("rollout.engine=server", "rollout.dtype=float32", "rollout.parallelism.tp=2", "rollout.hosts=[h1, h2]")
    placement = place_host("h2", HostDevices("cpu", (0,), 8.0), recipe, node_rank=1)
    [engine] = placement.engines
    command = engine_command(
        recipe.rollout,
        placement,
        engine,
        python="/py",
        weights="/w",
        config=MLA_CONFIG,
        seed=0,
        routed_experts=False,
        tokenizer=True,
        port=None,
        head="h1",
        head_port=9,
    )
    assert "--attention-backend CPU_MLA" in command and "--enforce-eager" in command and "--no-enable-chunked-prefill" in command
    assert command.startswith("env VLLM_SERVER_DEV_MODE=1 VLLM_CPU_OMP_THREADS_BIND=0 ")
    local = engine_options("/w", MLA_CONFIG, recipe.rollout, "cpu", seed=0, routed_experts=False, tokenizer=True)
    assert shlex.join(server_args(local, None)) in command  # the same flags as a server started here
    assert all(f"{key}={value}" in command for key, value in server_env(engine).items())
    with pytest.raises(UserError, match="vLLM cannot serve /w on CPU: .*kv_lora_rank=256 \\(needs 512\\)"):
        engine_command(
            recipe.rollout,
            placement,
            engine,
            python="/py",
            weights="/w",
            config={**MLA_CONFIG, "kv_lora_rank": 256},
            seed=0,
            routed_experts=False,
            tokenizer=True,
            port=None,
        )


def test_a_learner_rank_binds_itself_to_its_planned_cores():
    code = "from composer.cluster.placement import bind_this_rank; import os; bind_this_rank(); print(sorted(os.sched_getaffinity(0)))"
    env = {**os.environ, RANK_CORES_ENV: "1|0", "LOCAL_RANK": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[0]"


def test_dry_run_prints_each_hosts_learner_and_engine_devices(tmp_path):
    result = run_composer(
        "train",
        "rl",
        str(RECIPES / "smoke-rl.yaml"),
        "--dry-run",
        "--set",
        f"run.dir={tmp_path}",
        "--set",
        "model.checkpoint=unused",
        "--set",
        "rollout.engine=server",
        "--set",
        "cluster.procs_per_host=1",
        "--set",
        "rollout.share_learner_devices=false",
        "--set",
        "parallelism.ep=1",
    )
    assert result.returncode == 0, result.stderr
    out = flat(result.stdout)
    assert "localhost 2 cores 0-1" in out and "0:0 0 0:1" in out  # learner rank 0 on core 0, the engine's rank on core 1
    assert "VLLM_CPU_OMP_THREADS_BIND=1 " in out and "--enforce-eager" in out and "--no-enable-chunked-prefill" in out
    assert f"{RANK_CORES_ENV}=0 " in out  # the learner's torchrun command binds rank 0 to core 0
    assert not (tmp_path / "smoke-rl").exists()


def test_engines_that_do_not_fit_this_machine_are_refused_before_anything_starts(tmp_path):
    """The same check as --dry-run's, with this machine's devices found."""
    result = run_composer(
        "train",
        "rl",
        str(RECIPES / "smoke-rl.yaml"),
        "--set",
        f"run.dir={tmp_path}",
        "--set",
        "model.checkpoint=unused",
        "--set",
        "rollout.engine=server",
        "--set",
        "rollout.parallelism.tp=4",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "tp x pp x dp = 4 x 1 x 1 = 4 devices per engine, but rollout host localhost has 2 CPU cores" in result.stderr
    assert not (tmp_path / "smoke-rl").exists()


def test_tensor_and_pipeline_groups_over_hosts_use_vllms_multi_node_executor():
    from composer.rl.rollout_hosts import rollout_plan

    recipe = load_recipe(
        RECIPES / "kimi-k2-rl.yaml",
        [
            "rollout.parallelism.pp=2",
            "rollout.parallelism.dp=1",
            "rollout.parallelism.enable_expert_parallel=false",
            "rollout.devices.memory_gib=192",
        ],
    )
    plan = rollout_plan(recipe)
    assert len(plan) == 8 and all(len(commands) == 1 for _, _, commands in plan)  # 4 engines of 2 hosts each
    head, worker = plan[2][2][0], plan[3][2][0]
    assert "--port '<port>'" in head and "--nnodes 2 --node-rank 0 --master-addr infer-02 --master-port '<port on infer-02>'" in head
    assert "--port" not in worker and worker.endswith(
        "--nnodes 2 --node-rank 1 --master-addr infer-02 --master-port '<port on infer-02>' --headless"
    )
