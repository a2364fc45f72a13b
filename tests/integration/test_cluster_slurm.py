"""The slurm launcher on a real one-node SLURM cluster (Debian's slurm-wlm + munge, started by the test):
a smoke mid-training through `srun` inside `salloc`, and through `--submit` (sbatch). Only the tests that need the
cluster skip where SLURM is absent; where it is installed, a cluster that does not start fails them with its logs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer.runtime.processes import free_port
from composer.runtime.run_dir import read_metrics
from tests.conftest import RECIPES, REPO
from tests.helpers import slurm_cluster

pytestmark = pytest.mark.engines

STEPS = 3


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if reason := slurm_cluster.why_not():
        pytest.skip(reason)
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.close()


def midtrain(init: Path, run_dir: Path, name: str, *more: str) -> list[str]:
    sets = [
        f"run.dir={run_dir}",
        f"run.name={name}",
        f"model.checkpoint={init}",
        f"data.cache_dir={init.parent / 'cache'}",
        f"train.steps={STEPS}",
        f"train.eval_every={STEPS}",
        "train.eval_batches=1",
        f"train.checkpoint_every={STEPS}",
        "optim.warmup_steps=1",
        "data.split=[90,10,0]",
        'data.sources.0.paths=["{stdlib}/email/**/*.py"]',
        "cluster.launcher=slurm",
        f"cluster.rdzv_port={free_port()}",
    ]
    return [
        sys.executable,
        "-m",
        "composer.cli",
        "train",
        "midtrain",
        str(RECIPES / "smoke-midtrain.yaml"),
        *(a for s in sets for a in ("--set", s)),
        *more,
    ]


def steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl")]


def test_srun_inside_salloc_runs_the_ranks(slurm, init, tmp_path):
    result = subprocess.run(
        ["salloc", "--nodes=1", *midtrain(init, tmp_path, "salloc")],
        cwd=REPO,
        env={**slurm.env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    run = tmp_path / "salloc"
    assert steps(run) == list(range(STEPS + 1))
    assert f"{slurm.node} | " in result.stdout  # the node's output, prefixed
    assert f"midtrain step {STEPS}/{STEPS}" in (run / "logs" / slurm.node / "torchrun.log").read_text()


def test_submit_writes_an_sbatch_script_and_the_job_trains(slurm, init, tmp_path):
    result = subprocess.run(
        midtrain(init, tmp_path, "batch", "--submit"),
        cwd=REPO,
        env={**slurm.env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split("submitted SLURM job ")[1].split()[0]
    assert job_id.isdigit()
    run = tmp_path / "batch"
    script = (run / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1" in script and "train midtrain" in script
    deadline = time.monotonic() + 300
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=slurm.env).stdout.strip():
        assert time.monotonic() < deadline, "the batch job did not finish"
        time.sleep(1)
    out = (run / "slurm" / f"job-{job_id}.out").read_text()
    assert steps(run) == list(range(STEPS + 1)), out[-3000:]
    assert (run / "export" / "config.json").is_file()
    assert f"{slurm.node} | " in out


def test_submit_outside_slurm_launcher_is_refused(init, tmp_path):
    args = midtrain(init, tmp_path, "refused", "--submit")
    args[args.index("cluster.launcher=slurm")] = "cluster.launcher=local"
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 2
    assert "--submit needs cluster.launcher: slurm" in result.stderr


def pytest_this_module(path: str, basetemp: Path, *tests: str) -> subprocess.CompletedProcess:
    """Some of this module's tests in a fresh pytest whose PATH is `path` (the SLURM it finds)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rs",
            f"--basetemp={basetemp}",
            *(f"{__file__}::{test}" for test in tests),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PATH": path, "COLUMNS": "400"},
    )


def test_without_slurm_only_the_tests_that_need_it_skip(monkeypatch, tmp_path):
    path = "/usr/bin:/bin"  # Debian's SLURM and munge daemons live in /usr/sbin
    monkeypatch.setenv("PATH", path)
    reason = slurm_cluster.why_not()
    assert reason is not None
    done = pytest_this_module(
        path,
        tmp_path / "pytest",
        "test_srun_inside_salloc_runs_the_ranks",
        "test_submit_writes_an_sbatch_script_and_the_job_trains",
        "test_submit_outside_slurm_launcher_is_refused",
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 passed, 2 skipped" in done.stdout and reason in done.stdout, done.stdout[-3000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="the test SLURM cluster runs its daemons as root")
def test_a_slurm_cluster_that_does_not_start_fails_with_its_logs(tmp_path):
    """SLURM's programs all present, but daemons that exit at once (`false` under their names): an error, not a skip."""
    programs = tmp_path / "bin"
    programs.mkdir()
    for program in slurm_cluster.PROGRAMS:
        (programs / program).symlink_to(shutil.which("false"))
    done = pytest_this_module(f"{programs}:/usr/bin:/bin", tmp_path / "pytest", "test_srun_inside_salloc_runs_the_ranks")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "1 error" in done.stdout and "munged did not start (munged exited 1); logs: munged.err:" in done.stdout, done.stdout[-3000:]
