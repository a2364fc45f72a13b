"""Training on several hosts over SSH: network namespaces with their own addresses and OpenSSH servers
(tests/helpers/netns_hosts.py), torchrun's c10d rendezvous across them, gloo on their own interfaces.

A 2-host x 2-process mid-training reproduces the 1-host x 4-process run; a host's torchrun killed with -9 stops
the job on every host with one message naming it; a killed driver leaves nothing running; `--resume` finishes on a
replacement host; `composer cluster check` names every broken host; rollout hosts pull from the sync store themselves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer.runtime.run_dir import read_metrics
from tests.conftest import COMPOSER, RECIPES, REPO, run_composer
from tests.helpers import netns_hosts

pytestmark = [pytest.mark.ssh, pytest.mark.skipif(netns_hosts.available() is not None, reason=str(netns_hosts.available()))]

FAKE_TORCH = "2.99.0"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Three hosts; the third one's `cluster.python` reports torch 2.99.0, and its `private/` is its own."""
    d = tmp_path_factory.mktemp("hosts")
    python = d / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    other = d / "other-python"
    fake = d / "fake-site" / f"torch-{FAKE_TORCH}.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {FAKE_TORCH}\n")
    # a Python whose package metadata says another torch: what a host with another install reports
    other.write_text(f'#!/bin/sh\nPYTHONPATH={fake.parent} exec {sys.executable} "$@"\n')
    for script in (python, other):
        script.chmod(0o755)
    (d / "shared").mkdir()
    (d / "elsewhere").mkdir()
    made = netns_hosts.Hosts(d, 3, overlays={2: {str(python): str(other), str(d / "shared"): str(d / "elsewhere")}})
    made.cluster_python = python
    try:
        yield made
    finally:
        made.close()


def cluster_sets(hosts, names: list[str]) -> list[str]:
    return [
        f"cluster.hosts={names}",
        "cluster.launcher=ssh",
        f"cluster.python={hosts.cluster_python}",
        "cluster.ssh.user=root",
        f"cluster.ssh.key_file={hosts.client_key}",
        f"cluster.ssh.known_hosts={hosts.known_hosts}",
        f"cluster.env={{GLOO_SOCKET_IFNAME: {netns_hosts.INTERFACE}}}",
    ]


def midtrain(init: Path, run_dir: Path, name: str, steps: int, *extra: str) -> list[str]:
    sets = [
        f"run.dir={run_dir}",
        f"run.name={name}",
        f"model.checkpoint={init}",
        f"data.cache_dir={init.parent / 'cache'}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        "train.eval_batches=1",
        "train.checkpoint_every=3",
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
        "optim.warmup_steps=1",
        "data.split=[90,10,0]",
        'data.sources.0.paths=["{stdlib}/email/**/*.py"]',
        *extra,
    ]
    return ["train", "midtrain", str(RECIPES / "smoke-midtrain.yaml"), *(a for s in sets for a in ("--set", s))]


def losses(run: Path) -> dict[int, tuple]:
    return {r["step"]: (r.get("loss"), r.get("eval_loss"), r.get("grad_norm")) for r in read_metrics(run / "metrics.jsonl")}


def wait_for_nothing_running(hosts, pattern: str, seconds: float = 20) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := hosts.processes(pattern)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.slow  # a minute here; the RL learner on two hosts below keeps a multi-host run in the default suite
@pytest.mark.engines
def test_two_hosts_by_two_processes_train_like_one_host_by_four(hosts, init, tmp_path):
    runs = tmp_path / "runs"
    local = run_composer(*midtrain(init, runs, "local", 4, "cluster.procs_per_host=4"))
    assert local.returncode == 0, local.stderr[-3000:]
    two = run_composer(*midtrain(init, runs, "two", 4, "cluster.procs_per_host=2", *cluster_sets(hosts, hosts.names[:2])))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    a, b = losses(runs / "local"), losses(runs / "two")
    assert sorted(a) == sorted(b) == list(range(5))
    worst = max(abs(x - y) for s in a for x, y in zip(a[s], b[s]) if x is not None)
    print(f"2 hosts x 2 vs 1 host x 4: max |difference| over loss, eval loss, grad norm = {worst:.3e}")
    assert worst <= 1e-5, (a, b)
    # every host's output, prefixed on the console and in logs/<host>/
    for host in hosts.names[:2]:
        assert f"{host} | " in two.stdout
        assert (runs / "two" / "logs" / host / "torchrun.log").stat().st_size > 0
    assert "midtrain step 4/4" in (runs / "two" / "logs" / hosts.names[0] / "torchrun.log").read_text()  # rank 0 lives on the first host
    assert wait_for_nothing_running(hosts, "torch.distributed.run") == []


@pytest.mark.slow
@pytest.mark.engines
def test_a_killed_host_stops_the_job_a_killed_driver_leaves_nothing_and_resume_finishes_on_a_replacement_host(hosts, init, tmp_path):
    runs, steps = tmp_path / "runs", 9
    args = midtrain(init, runs, "kill", steps, "cluster.procs_per_host=2", *cluster_sets(hosts, hosts.names[:2]))
    metrics = runs / "kill" / "metrics.jsonl"

    def start_and_wait_for_step(step: int, *more: str) -> subprocess.Popen:
        driver = subprocess.Popen(
            [*COMPOSER, *args, *more],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
        )
        deadline = time.monotonic() + 600  # a guard against a hang, not a speed limit
        while not (metrics.exists() and any(r["step"] >= step for r in read_metrics(metrics))):
            assert driver.poll() is None, driver.communicate()
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.2)
        return driver

    # kill -9 of the second host's torchrun: the whole job stops, one message names the host and the signal
    driver = start_and_wait_for_step(2)
    victim = hosts.hosts[1]
    torchruns = hosts.pids(victim, "torch.distributed.run --nproc-per-node")
    assert torchruns, hosts.processes("torch")
    killed_at = time.monotonic()
    os.kill(torchruns[0], signal.SIGKILL)
    _, stderr = driver.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert driver.returncode == 1
    message = " ".join(stderr.split())
    assert f"host {victim.name} (node 1, ranks 2-3)" in message and "SIGKILL" in message, stderr
    assert "Traceback" not in stderr
    print(f"a killed host, stopped in {time.monotonic() - killed_at:.1f} s: {message}")
    assert wait_for_nothing_running(hosts, "trainer.midtrain") == []

    # kill -9 of the driver: every host's torchrun and ranks end with its SSH sessions
    driver = start_and_wait_for_step(5, "--resume")
    driver.kill()
    driver.communicate()
    assert wait_for_nothing_running(hosts, "trainer.midtrain") == [], "ranks outlived the driver"

    # the second host is replaced by the third: the run resumes from the shared checkpoint
    replaced = midtrain(init, runs, "kill", steps, "cluster.procs_per_host=2", *cluster_sets(hosts, [hosts.names[0], hosts.names[2]]))
    resumed = run_composer(*replaced, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (runs / "kill" / "logs" / hosts.names[2] / "torchrun.log").is_file()
    assert sorted(losses(runs / "kill")) == list(range(steps + 1))
    assert (runs / "kill" / "export" / "config.json").is_file()
    assert wait_for_nothing_running(hosts, "torch.distributed.run") == []


def test_a_run_dir_that_a_host_does_not_see_is_refused_before_launch(hosts, init, tmp_path):
    run_dir = hosts.dir / "shared" / "runs"  # host 3 mounts its own directory there
    result = run_composer(
        *midtrain(init, run_dir, "unshared", 2, "cluster.procs_per_host=1", *cluster_sets(hosts, [hosts.names[0], hosts.names[2]]))
    )
    assert result.returncode == 2
    message = " ".join(result.stderr.split())
    assert f"is not shared: a file written there on {hosts.names[0]} is not visible on {hosts.names[2]}" in message, result.stderr
    assert hosts.processes("torch.distributed.run") == []


def test_cluster_check_passes_healthy_hosts_and_names_each_problem(hosts, tmp_path, write_recipe):
    recipe = RECIPES / "smoke-midtrain.yaml"
    sets = [f"run.dir={tmp_path / 'runs'}", "cluster.procs_per_host=2"]
    healthy = run_composer(
        "cluster", "check", str(recipe), *(a for s in [*sets, *cluster_sets(hosts, hosts.names[:2])] for a in ("--set", s))
    )
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert "every host is ready" in healthy.stdout
    for host in hosts.names[:2]:
        assert host in healthy.stdout

    broken_hosts = [hosts.names[0], hosts.names[2], netns_hosts.UNUSED_ADDRESS]
    sets_broken = [*sets, *cluster_sets(hosts, broken_hosts), f"run.dir={hosts.dir / 'shared' / 'runs'}", "train.global_batch_size=24"]
    broken = run_composer("cluster", "check", str(recipe), *(a for s in sets_broken for a in ("--set", s)))
    assert broken.returncode == 2, broken.stdout + broken.stderr
    first_lines = {line.split("│")[1].strip(): line for line in broken.stdout.splitlines() if line.count("│") > 3}
    assert "ok" in first_lines[hosts.names[0]]
    text = " ".join(broken.stdout.replace("│", " ").split())
    assert f"torch {FAKE_TORCH} != " in text and hosts.names[2] in first_lines
    assert "not shared" in text
    assert "unreachable" in text and "cannot connect" in text and netns_hosts.UNUSED_ADDRESS in first_lines
    assert "problem(s)" in text


def rollout_recipe(hosts, tmp_path: Path, host: str, *more: str):
    from composer.recipes.loader import load_recipe

    sets = [
        f"run.dir={tmp_path / 'runs'}",
        "model.checkpoint=unused",
        "rollout.engine=server",
        f"rollout.hosts=[{host}]",
        f"rollout.remote_dir={tmp_path / 'remote'}",
        f"rollout.remote_python={hosts.cluster_python}",
        "cluster.ssh.user=root",
        f"cluster.ssh.key_file={hosts.client_key}",
        f"cluster.ssh.known_hosts={hosts.known_hosts}",
        *more,
    ]
    return load_recipe(RECIPES / "smoke-rl.yaml", sets)


def test_a_rollout_host_pulls_from_an_ssh_store_with_the_recipe_key_and_known_hosts(hosts, tmp_path):
    from composer.rl.protocol import RLRunFiles
    from composer.rl.rollout_hosts import RemoteHost
    from composer.sync.pusher import push_version
    from tests.helpers.sync_testing import TrainingRun

    weights = TrainingRun(tmp_path / "checkpoints")
    weights.step()
    checkpoint = weights.save()
    # the store is on the second host; the first one pulls from it, authenticated with the recipe's key only
    recipe = rollout_recipe(hosts, tmp_path, hosts.names[0], f"sync.store=ssh://root@{hosts.names[1]}{tmp_path / 'store'}")
    info = push_version(checkpoint, recipe.sync, recipe.cluster.ssh, cache_dir=tmp_path / "cache")
    host = RemoteHost(hosts.names[0], recipe, RLRunFiles(tmp_path / "runs" / "smoke-rl"))
    try:
        pulled = Path(host.pull(info.id))
    finally:
        host.close()
    for shard in checkpoint.glob("*.safetensors"):
        assert (pulled / shard.name).read_bytes() == shard.read_bytes()


def test_a_rollout_host_that_does_not_see_a_directory_store_is_refused(hosts):
    from composer.recipes.errors import UserError
    from composer.rl.protocol import RLRunFiles
    from composer.rl.rollout_hosts import RemoteHost

    shared = hosts.dir / "shared" / "rl"  # host 3 mounts its own directory there
    recipe = rollout_recipe(hosts, shared, hosts.names[2])
    with pytest.raises(UserError, match=f"rollout host root@{hosts.names[2]}:22 does not see the sync store"):
        RemoteHost(hosts.names[2], recipe, RLRunFiles(shared / "runs" / "smoke-rl"))
    RemoteHost(hosts.names[0], recipe, RLRunFiles(shared / "runs" / "smoke-rl")).close()  # host 1 sees it: no error


@pytest.mark.engines
def test_the_rl_learner_runs_on_two_hosts(hosts, tmp_path):
    from composer.recipes.loader import load_recipe
    from composer.trainer.checkpoint_init import init_hf_checkpoint
    from tests.integration.test_rl import metrics, start

    checkpoint = init_hf_checkpoint(load_recipe(RECIPES / "smoke-rl.yaml").model, tmp_path / "init", tokenizer_bytes=2**20)
    learner = cluster_sets(hosts, hosts.names[:2]) + ["cluster.procs_per_host=1", "train.steps=3"]
    driver = start(tmp_path / "runs", checkpoint, *(a for s in learner for a in ("--set", s)))
    output, _ = driver.communicate(timeout=600)
    assert driver.returncode == 0, output[-3000:]
    run = tmp_path / "runs" / "smoke-rl"
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    for host in hosts.names[:2]:
        assert (run / "logs" / host / "torchrun.log").is_file()
    assert wait_for_nothing_running(hosts, "rl.learner_main") == []
