"""The slurm launcher on a real one-node SLURM cluster (Debian's slurm-wlm + munge, started by the test):
a smoke mid-training through `srun` inside `salloc`, and through `--submit` (sbatch). Only the tests that need the
cluster skip where SLURM is absent; where it is installed, a cluster that does not start fails them with its logs."""

from __future__ import annotations

import os
import shutil
import signal
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


slurm = pytest.fixture(scope="module", name="slurm")(slurm_cluster.running_cluster)


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


# --- data prepare --submit: the pipeline's stages as job arrays ------------------------------------

ENTRY_FILES = ("tokens.bin", "tokens.idx", "manifest.json", "redactions.jsonl")


def jobs_in_queue(slurm, jobs: list[str]) -> list[str]:
    queued = subprocess.run(["squeue", "-h", "-o", "%F"], capture_output=True, text=True, env=slurm.env, check=True).stdout.split()
    return [job for job in jobs if job in queued]


def wait_for_jobs(slurm, jobs: list[str], seconds: float = 900) -> None:
    deadline = time.monotonic() + seconds
    while jobs_in_queue(slurm, jobs):
        assert time.monotonic() < deadline, f"jobs {jobs} did not leave the queue"
        time.sleep(1)


def task_process(work: Path, stage: str, seconds: float = 300) -> tuple[int, int]:
    """(pid, array task id) of the first array task of `stage` found running its program."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if b"composer.data.pipeline" in argv and argv[-3:-1] == [str(work).encode(), stage.encode()]:
                    env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
                    return int(proc.name), int(env[b"SLURM_ARRAY_TASK_ID"])
            except (OSError, ValueError, KeyError):  # gone meanwhile, or not an array task
                continue
        time.sleep(0.05)
    raise AssertionError(f"no {stage} task started")


@pytest.mark.slow
def test_data_prepare_submit_reruns_a_killed_array_task_and_writes_the_local_pools_bytes(slurm, tmp_path):
    from composer.data.pipeline import SourcePlan, pending_tasks, stages
    from composer.data.prepare import prepare_data
    from composer.recipes.loader import load_recipe
    from tests.helpers.data_helpers import train_tokenizer, write_recipe

    tokenizer = train_tokenizer(tmp_path / "tokenizer")

    def recipe(cache: str) -> Path:
        section = {
            "tokenizer": str(tokenizer),
            "cache_dir": str(tmp_path / cache),
            "tasks": 3,
            "num_workers": 3,
            "fim": {"rate": 0.5},
            "cleaning": {"near_threshold": 0.95},  # 4 LSH bands: 4 bucket tasks
            "sources": [{"name": "lib", "paths": ["{stdlib}/json/*.py", "{stdlib}/email/*.py"]}],
        }
        path = write_recipe(tmp_path / f"{cache}.yaml", section)
        path.write_text(path.read_text() + "cluster:\n  launcher: slurm\n")
        return path

    local = prepare_data(load_recipe(recipe("local")).data, model_checkpoint=None, model_vocab_size=4096)
    expected = {name: (local.sources[0].prefix.parent / name).read_bytes() for name in ENTRY_FILES}

    def composer(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "composer.cli", "data", *args, str(recipe("slurm"))],
            cwd=tmp_path,
            env={**slurm.env, "COLUMNS": "400"},
            capture_output=True,
            text=True,
            timeout=300,
        )

    def submit() -> list[str]:
        done = composer("prepare", "--submit")
        assert done.returncode == 0, done.stderr[-3000:]
        return [line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("submitted lib ")]

    first = submit()
    assert len(first) == 8  # clean, exact signatures and duplicates, minhash signatures, buckets, clusters, shape, publish
    [work] = (tmp_path / "slurm").glob(".work-lib-*")
    # kill -9 of one array task's program, scancel of another task of the same array
    pid, killed = task_process(work, "clean")
    os.kill(pid, signal.SIGKILL)
    cancelled = ({0, 1, 2} - {killed}).pop()
    subprocess.run(["scancel", f"{first[0]}_{cancelled}"], env=slurm.env, check=True)
    wait_for_jobs(slurm, first)  # the stages after clean are cancelled with it, not left waiting
    plan = SourcePlan.load(work)
    assert pending_tasks(plan, stages(plan)[0]) == sorted({killed, cancelled})
    assert not list((tmp_path / "slurm").glob("lib-*"))  # nothing published
    stats = composer("stats")
    assert stats.returncode == 2 and "run `composer data prepare --submit` again" in stats.stderr, stats.stderr[-3000:]

    second = submit()  # the unfinished tasks of clean, then every later stage
    assert len(second) == 8 and not set(second) & set(first)
    refused = composer("prepare", "--submit")  # while they run (the later stages wait for minutes)
    assert refused.returncode == 2 and "still queued or running" in refused.stderr, refused.stderr[-3000:]
    wait_for_jobs(slurm, second)
    [entry] = (tmp_path / "slurm").glob("lib-*")
    assert entry.name == local.sources[0].prefix.parent.name
    assert {name: (entry / name).read_bytes() for name in ENTRY_FILES} == expected
    assert not work.exists()  # the publish task cleans up as a local prepare does
    stats = composer("stats")
    assert stats.returncode == 0 and f"{local.sources[0].num_tokens:,}" in stats.stdout, stats.stderr[-3000:]
