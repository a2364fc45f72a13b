"""Launch plans without launching: parallel groups in Megatron-Core's order, `--dry-run` of the real-scale recipes,
the local launcher's failure message naming host, rank and cause, and the memory plan (`composer plan`, cluster.plan)
checked against real training steps on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from composer.cluster.groups import describe_group, parallel_groups
from composer.cluster.launch import LocalLauncher, RanksFailed, run_to_end, torchrun_argv
from composer.cluster.plan import GIB, make_plan, output_activation_bytes, output_transient_bytes, rank_params, stage_memory
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.recipes.schema import ClusterSection, ParallelismSection
from composer.recipes.sizes import parameter_counts, routed_expert_parameters
from composer.runtime.run_dir import RunDir
from tests.conftest import RECIPES, REPO, run_composer

LAYOUTS = [  # tp, cp, pp, ep, etp, world
    (2, 1, 1, 8, 1, 16),
    (8, 1, 1, 64, 1, 256),
    (2, 2, 2, 2, 1, 32),
    (1, 1, 2, 2, 2, 8),
    (2, 1, 1, 2, 1, 4),
    (1, 4, 1, 1, 1, 8),
]


@pytest.mark.parametrize("tp,cp,pp,ep,etp,world", LAYOUTS)
def test_groups_are_the_ones_megatron_builds(tp, cp, pp, ep, etp, world):
    from megatron.core.parallel_state import RankGenerator

    groups = parallel_groups(ParallelismSection(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp), world)
    # the two generators initialize_model_parallel builds, with its default order
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    experts = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert groups["tp"] == dense.get_ranks("tp")
    assert groups["cp"] == dense.get_ranks("cp")
    assert groups["pp"] == dense.get_ranks("pp")
    assert groups["dp"] == dense.get_ranks("dp")
    assert groups["ep"] == experts.get_ranks("ep")
    assert groups["etp"] == experts.get_ranks("tp")
    assert groups["edp"] == experts.get_ranks("dp")


def test_group_descriptions_are_exact():
    assert describe_group([0, 1, 2, 3]) == "0-3"
    assert describe_group([1, 9, 17, 25]) == "1,9,..,25"
    assert describe_group([0, 8]) == "0,8"
    assert describe_group([0, 2, 3]) == "0,2,3"


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_dry_run_of_the_two_node_midtrain_recipe(tmp_path):
    result = run_composer("train", "midtrain", str(RECIPES / "qwen3-30b-a3b-midtrain.yaml"), "--dry-run", "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    out = flat(result.stdout)
    assert "launcher ssh, 2 host(s), world size 16, rendezvous node-0:29400" in out
    for host, node, ranks in (("node-0", 0, "0-7"), ("node-1", 1, "8-15")):
        assert f"{host} {node} {ranks}" in out
    assert "--nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint node-0:29400" in out.replace("\n", " ")
    # tp 2, ep 8, dp 8 on 16 ranks
    assert "tensor (TP) 2 8 0-1 2-3 4-5 6-7 8-9 10-11 12-13 14-15" in out
    assert "data (DP) 8 2 0,2,..,14 1,3,..,15" in out
    assert "expert (EP) 8 2 0-7 8-15" in out
    assert "expert data (EDP) 2 8 0,8 1,9" in out
    assert not (tmp_path / "qwen3-30b-a3b-midtrain").exists()  # nothing started, nothing written


def test_dry_run_of_the_32_node_rl_recipe(tmp_path):
    result = run_composer("train", "rl", str(RECIPES / "kimi-k2-rl.yaml"), "--dry-run", "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    out = flat(result.stdout)
    assert "launcher slurm, 32 host(s), world size 256, rendezvous train-00:29400" in out
    assert "sandbox hosts: localhost, sandbox-00, sandbox-01, sandbox-02, sandbox-03 (96 sandboxes per host)" in out
    assert "train-31 31 248-255" in out
    assert "srun: srun --nodes=32 --ntasks=32 --ntasks-per-node=1 --kill-on-bad-exit=1" in out
    assert '--node-rank "$SLURM_NODEID"' in out
    assert "-m composer.rl.learner_main" in out
    assert "#SBATCH --nodes=32" in out and "train rl" in out  # the script --submit would submit
    assert "tensor (TP) 8 32 0-7 8-15" in out
    assert "expert (EP) 128 2 0-127 128-255" in out
    assert not (tmp_path / "kimi-k2-rl").exists()
    # the inference fleet: 2 engines over 4 hosts each, in vLLM's multi-node data-parallel mode
    assert "each tp 8 x pp 1 x dp 4, expert parallel over 32" in out
    assert out.count("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7") == 8
    head = "--data-parallel-size 4 --enable-expert-parallel --distributed-executor-backend mp --data-parallel-size-local 1"
    assert f"{head} --data-parallel-address infer-00 --data-parallel-rpc-port '<port on infer-00>'" in out
    for rank, host in ((1, "infer-00"), (2, "infer-00"), (3, "infer-00"), (1, "infer-04")):
        assert (
            f"--data-parallel-address {host} --data-parallel-rpc-port '<port on {host}>' --headless --data-parallel-start-rank {rank}"
            in out
        )
    assert "--enforce-eager" not in out and "chunked-prefill" not in out  # GPUs: vLLM's defaults


def test_the_local_launcher_refuses_several_hosts():
    with pytest.raises(UserError, match="cluster.launcher is `local`, which runs on this host only"):
        LocalLauncher(ClusterSection(hosts=["a", "b"])).plan("trainer.midtrain", [], "run")


def test_a_failed_rank_is_named_with_its_traceback_line(tmp_path):
    """torchrun's report names the rank; the message carries that rank's last traceback line."""
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys\nif os.environ['RANK'] == '1':\n    sys.stderr = open(sys.argv[1] + f\"/rank-1.log\", 'w')\n"
        "    raise RuntimeError('rank one broke')\n"
    )
    launcher = LocalLauncher(ClusterSection(procs_per_host=2, python=sys.executable, workdir=str(tmp_path)))
    with pytest.raises(RanksFailed) as failed:
        run_to_end(launcher.start("worker", [str(run.logs)], run))
    message = str(failed.value)
    assert message.startswith("host localhost (node 0, ranks 0-1): rank 1 failed (exit code 1): RuntimeError: rank one broke"), message
    assert "the job was stopped on every host" in message


def test_cluster_check_of_this_host(tmp_path):
    result = run_composer("cluster", "check", str(RECIPES / "smoke-midtrain.yaml"), "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stdout + result.stderr
    out = flat(result.stdout)
    assert "1 host(s), launcher local" in out and "localhost" in out and "every host is ready" in out
    from importlib.metadata import version

    assert version("torch") in out and version("megatron-core") in out


# --- the memory plan -----------------------------------------------------------------------------

REAL_SCALE = ["kimi-k2-rl.yaml", "kimi-k2-long-context-midtrain.yaml", "qwen3-30b-a3b-midtrain.yaml"]


def test_the_plan_splits_the_parameters_recipes_sizes_counts():
    for path in sorted(RECIPES.glob("*.yaml")):
        m = load_recipe(path, []).model
        assert rank_params(m, ParallelismSection()).total == parameter_counts(m)[0], path.name
    kimi = load_recipe(RECIPES / "kimi-k2-rl.yaml", []).model
    assert rank_params(kimi, ParallelismSection(tp=8, ep=128)).expert * 128 == routed_expert_parameters(kimi)
    qwen = load_recipe(RECIPES / "qwen3-30b-a3b-midtrain.yaml", []).model
    stages = [rank_params(qwen, ParallelismSection(pp=4), stage).total for stage in range(4)]
    assert sum(stages) == parameter_counts(qwen)[0]
    assert stages[0] > stages[1] == stages[2] < stages[3]  # the embedding on the first stage, the output layer on the last


WIDE = ["model.checkpoint=null", "model.hidden_size=512", "model.vocab_size=16384", "train.micro_batch_size=2", "train.global_batch_size=4"]
GQA = ["model.moe_ffn_hidden_size=512", "data.seq_length=1024"]
MLA = ["model.moe_ffn_hidden_size=256", "model.ffn_hidden_size=1024", "data.seq_length=512"]
DENSE_PARALLEL = ["parallelism.ep=1"]
# on CPU, Muon's default `medium` precision runs its Newton-Schulz matmuls in bf16 through oneDNN, which keeps about
# 50 MiB of its own resident here: not optimizer state, so the measurement uses fp32 matmuls
MUON = ["optim.name=muon", "optim.muon.matmul_precision=highest"]
slow = pytest.mark.slow
MEASURED = [  # (recipe, overrides), 2 ranks each
    pytest.param("smoke-deepseek-v3-midtrain.yaml", MLA + MUON, id="mla-ep2-muon"),
    pytest.param("smoke-midtrain.yaml", GQA, id="gqa-ep2", marks=slow),
    pytest.param(
        "smoke-midtrain.yaml",
        GQA + DENSE_PARALLEL + ["parallelism.tp=2", "parallelism.sequence_parallel=true"],
        id="gqa-tp2-sp",
        marks=slow,
    ),
    pytest.param("smoke-midtrain.yaml", GQA + DENSE_PARALLEL + ["parallelism.cp=2"], id="gqa-cp2", marks=slow),
    pytest.param("smoke-midtrain.yaml", GQA + DENSE_PARALLEL + ["parallelism.pp=2", "train.global_batch_size=8"], id="gqa-pp2", marks=slow),
    pytest.param(
        "smoke-midtrain.yaml",
        GQA + ["train.recompute_activations=true", "parallelism.distributed_optimizer=true"],
        id="gqa-ep2-recompute-distopt",
        marks=slow,
    ),
    pytest.param("smoke-deepseek-v3-midtrain.yaml", MLA, id="mla-ep2", marks=slow),
    pytest.param("smoke-deepseek-v3-midtrain.yaml", MLA + DENSE_PARALLEL + ["parallelism.cp=2"], id="mla-cp2", marks=slow),
    pytest.param(
        "smoke-deepseek-v3-midtrain.yaml",
        MLA + DENSE_PARALLEL + ["parallelism.tp=2", "parallelism.sequence_parallel=true"],
        id="mla-tp2-sp",
        marks=slow,
    ),
]


@pytest.mark.engines
@pytest.mark.parametrize("recipe_name,overrides", MEASURED)
def test_the_plan_predicts_what_each_rank_holds(recipe_name, overrides, tmp_path):
    """Real mid-training steps (tests/helpers/workers/plan_memory_worker.py): parameters, gradient buffers and optimizer state
    as planned (within 1%), and each rank's peak memory within 15% of its pipeline stage's plan."""
    recipe = load_recipe(RECIPES / recipe_name, WIDE + overrides)
    out = tmp_path / "held.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "65536"}
    argv = torchrun_argv(
        sys.executable,
        recipe.cluster.world_size,
        "tests.helpers.workers.plan_memory_worker",
        [str(RECIPES / recipe_name), json.dumps(WIDE + overrides), str(out)],
    )
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank, held in enumerate(json.loads(out.read_text())):
        planned = stage_memory(recipe, recipe.parallelism, held["stage"])
        for part in ("parameters", "gradients", "optimizer"):
            assert abs(held[part] / getattr(planned, part) - 1) <= 0.01, (rank, part, held[part], getattr(planned, part))
        print(
            f"rank {rank}: peak {held['peak'] / 2**20:.0f} MiB, planned {planned.total / 2**20:.0f} MiB "
            f"(x{held['peak'] / planned.total:.3f})"
        )  # the figures README quotes, shown with pytest -s
        assert abs(held["peak"] / planned.total - 1) <= 0.15, (rank, held["peak"] / 2**20, planned.total / 2**20)


@pytest.mark.parametrize("name", REAL_SCALE)
def test_the_plans_of_the_real_scale_recipes(name):
    result = run_composer("plan", str(RECIPES / name))
    print(result.stdout)  # the plan itself, shown with pytest -s
    assert result.returncode == 0, result.stdout + result.stderr
    out, plan = flat(result.stdout), make_plan(load_recipe(RECIPES / name, []))
    assert f"total {plan.rank.total / GIB:.2f}" in out and plan.fits
    assert f"layouts of world size {plan.recipe.cluster.world_size} that fit, best first" in out
    # docs/midtraining.md quotes the tool, figure for figure
    docs = (REPO / "docs/midtraining.md").read_text()
    quoted = docs.split(f"$ composer plan recipes/{name}\n", 1)[1].split("\n\n", 1)[0].split("\n```", 1)[0]
    assert flat(quoted) == flat(result.stdout)


def test_the_loss_is_planned_in_fp32_whatever_the_dtype():
    """Megatron's cross entropy takes an fp32 copy of the logits (`calculate_logits_max`), exponentiates it in place
    and keeps it for backward; below fp32 the logits in their own dtype sit beside it for a moment."""
    recipe = load_recipe(RECIPES / "qwen3-30b-a3b-midtrain.yaml", [])
    m, p = recipe.model, recipe.parallelism
    tokens, vocab = 32768, m.vocab_size // p.tp
    bf16 = output_activation_bytes(m, p, tokens)
    fp32 = output_activation_bytes(m.model_copy(update={"dtype": "float32"}), p, tokens)
    hidden = (tokens // p.tp) * m.hidden_size
    assert bf16 == hidden * (4 + 2) + hidden * 2 + tokens * vocab * 4
    assert fp32 == hidden * (4 + 4) + hidden * 4 + tokens * vocab * 4  # the copy is the logits themselves
    assert output_transient_bytes(m, p, tokens) == vocab * m.hidden_size * 2 + tokens * vocab * 2
    assert output_transient_bytes(m.model_copy(update={"dtype": "float32"}), p, tokens) == vocab * m.hidden_size * 4
    assert round(make_plan(recipe).rank.total / GIB, 1) == 63.4


def test_a_layout_that_cannot_fit_is_refused_naming_the_key(tmp_path):
    """Kimi-K2's 200k-token episodes need context parallelism: without it the plan refuses the recipe, in every
    command that checks it, with one message naming the key and the closest layout that fits."""
    recipe = str(RECIPES / "kimi-k2-rl.yaml")
    unsplit = ["--set", "parallelism.cp=1", "--set", f"run.dir={tmp_path}"]
    for command in (["recipe", "validate", recipe], ["train", "rl", recipe, "--dry-run"], ["plan", recipe]):
        result = run_composer(*command, *unsplit)
        text = flat(result.stdout + result.stderr)
        assert result.returncode != 0, command
        assert "Traceback" not in text, command
        assert "exceeds the 130.2 GiB usable of cluster.device_memory_gib=139.0" in text, (command, text[-2000:])
        assert "parallelism: " in text and "the closest layout that fits: parallelism.cp=2" in text, (command, text[-2000:])
    assert not (tmp_path / "kimi-k2-rl").exists()


def test_muon_is_not_told_to_shard_its_state():
    """Megatron-Core's Muon has no distributed optimizer: where Adam is told to shard its state, Muon (one momentum
    per weight matrix, less state unsharded) is told another change."""
    from composer.cluster.plan import fit_problems

    tight = ["parallelism.distributed_optimizer=false", "cluster.device_memory_gib=72"]
    adam = load_recipe(RECIPES / "qwen3-30b-a3b-midtrain.yaml", tight)
    muon = load_recipe(RECIPES / "qwen3-30b-a3b-midtrain.yaml", tight + ["optim.name=muon"])
    assert make_plan(muon).rank.optimizer < make_plan(adam).rank.optimizer
    assert [p.path for p in fit_problems(adam)] == ["parallelism.distributed_optimizer"]
    assert [p.path for p in fit_problems(muon)] == ["parallelism"]
