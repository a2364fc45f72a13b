"""Launch plans without launching: parallel groups in Megatron-Core's order, `--dry-run` of the real-scale recipes,
and the local launcher's failure message naming host, rank and cause."""

from __future__ import annotations

import sys

import pytest

from cluster.groups import describe_group, parallel_groups
from cluster.launch import LocalLauncher, RanksFailed, run_to_end
from recipes.errors import UserError
from recipes.schema import ClusterSection, ParallelismSection
from runtime.run_dir import RunDir
from tests.conftest import RECIPES, run_composer

LAYOUTS = [  # tp, cp, pp, ep, etp, world
    (2, 1, 1, 8, 1, 16), (8, 1, 1, 64, 1, 256), (2, 2, 2, 2, 1, 32), (1, 1, 2, 2, 2, 8), (2, 1, 1, 2, 1, 4), (1, 4, 1, 1, 1, 8),
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
    assert "-m rl.learner_main" in out
    assert "#SBATCH --nodes=32" in out and "train rl" in out  # the script --submit would submit
    assert "tensor (TP) 8 32 0-7 8-15" in out
    assert "expert (EP) 64 4 0-63 64-127 128-191 192-255" in out
    assert not (tmp_path / "kimi-k2-rl").exists()


def test_the_local_launcher_refuses_several_hosts():
    with pytest.raises(UserError, match="cluster.launcher is `local`, which runs on this host only"):
        LocalLauncher(ClusterSection(hosts=["a", "b"])).plan("trainer.midtrain", [], "run")


def test_a_failed_rank_is_named_with_its_traceback_line(tmp_path):
    """torchrun's report names the rank; the message carries that rank's last traceback line."""
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.stderr = open(sys.argv[1] + f\"/rank-1.log\", 'w')\n"
                      "    raise RuntimeError('rank one broke')\n")
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
