"""`composer train rl` with a rollout host reached over SSH (a real OpenSSH server on loopback): the host pulls
each policy from the sync store itself and serves it with vLLM behind an SSH port forward."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import RECIPES
from tests.integration.test_rl import STEPS, metrics, processes_mentioning, start

pytestmark = [pytest.mark.engines, pytest.mark.ssh]


@pytest.mark.slow
def test_a_remote_rollout_host_serves_every_policy_and_dies_with_the_driver(sshd, tmp_path):
    from composer.recipes.loader import load_recipe
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    port, key, known_hosts, _ = sshd
    checkpoint = init_hf_checkpoint(load_recipe(RECIPES / "smoke-rl.yaml").model, tmp_path / "init", tokenizer_bytes=2**20)
    remote = tmp_path / "remote"
    remote_host = [
        "--set",
        "rollout.engine=server",
        "--set",
        "rollout.hosts=[127.0.0.1]",
        "--set",
        f"rollout.remote_dir={remote}",
        "--set",
        "cluster.ssh.user=root",
        "--set",
        f"cluster.ssh.port={port}",
        "--set",
        f"cluster.ssh.key_file={key}",
        "--set",
        f"cluster.ssh.known_hosts={known_hosts}",
    ]
    run = tmp_path / "runs" / "smoke-rl"
    first = start(tmp_path / "runs", checkpoint, *remote_host)
    deadline = time.monotonic() + 600
    while len(metrics(run)) < 2:
        assert first.poll() is None, first.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    deadline = time.monotonic() + 60
    while (left := processes_mentioning(remote)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []  # the remote vLLM server ended with the driver's SSH connection

    resumed = start(tmp_path / "runs", checkpoint, "--resume", *remote_host)
    output, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, output[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))
    groups = [json.loads(line) for line in (run / "rollout_metrics.jsonl").read_text().splitlines()]
    assert {g["host"] for g in groups} == {"127.0.0.1"}
    assert max(g["policy_version"] for g in groups) >= 2  # the remote engine loaded the policies its host pulled
    pulled = sorted(p.name for p in (remote / "smoke-rl" / "receiver" / "versions").iterdir())
    assert pulled and (remote / "smoke-rl" / "vllm-0.log").is_file()
    assert "vLLM" in (run / "logs" / "127.0.0.1-vllm-0.log").read_text()  # the host's server log, copied into the run's logs/
    assert processes_mentioning(remote) == []  # a finished run stops its remote servers too
    # the workspaces the killed driver left mounted (tmpfs caps) were reclaimed by the resumed one
    assert str(run) not in Path("/proc/self/mountinfo").read_text()


def test_an_unreachable_rollout_host_is_one_clear_error(sshd, tmp_path, composer):
    from composer.recipes.loader import load_recipe
    from composer.runtime.processes import free_port
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    _, key, known_hosts, _ = sshd
    checkpoint = init_hf_checkpoint(load_recipe(RECIPES / "smoke-rl.yaml").model, tmp_path / "init", tokenizer_bytes=2**20)
    closed = free_port()
    result = composer(
        "train",
        "rl",
        str(RECIPES / "smoke-rl.yaml"),
        "--set",
        f"run.dir={tmp_path}",
        "--set",
        f"model.checkpoint={checkpoint}",
        "--set",
        "rollout.engine=server",
        "--set",
        "rollout.hosts=[127.0.0.1]",
        "--set",
        f"cluster.ssh.port={closed}",
        "--set",
        f"cluster.ssh.key_file={key}",
        "--set",
        f"cluster.ssh.known_hosts={known_hosts}",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"@127.0.0.1:{closed}: cannot connect" in result.stderr
