"""The hosts of an engine larger than one host pull each policy all at once: two network-namespace hosts (OpenSSH each,
their own rollout directory at the same path), each pulling with its composer as a run's hosts do. Each host's Python
waits at the start of a pull until the other host's pull has started too, so pulls one after the other fail; a pull
that fails on one host is one error naming that host, after the other host's pull has ended."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from composer.recipes.errors import UserError
from tests.conftest import RECIPES, REPO
from tests.helpers import netns_hosts

pytestmark = [pytest.mark.ssh, pytest.mark.skipif(netns_hosts.available() is not None, reason=str(netns_hosts.available()))]

PREFIX, SUBNET = "cmpep", "10.213.21"
ALONGSIDE_SECONDS = 30
"""How long a host's pull waits for the other's to start before it fails (only reached when pulls are not parallel)."""


def _python(work, index: int, broken: bool) -> str:
    """Host `index`'s Python: a pull first waits until the other host's has started; `broken`: its pulls fail."""
    other = work / f"pulling-{1 - index}"
    wait = (
        f"touch {work}/pulling-{index}; n=0; while [ ! -e {other} ]; do n=$((n+1)); [ $n -gt {ALONGSIDE_SECONDS * 10} ] && "
        f'{{ echo "host {index}: the other host never pulled alongside" >&2; exit 1; }}; sleep 0.1; done'
    )
    fail = 'echo "no composer on this host" >&2; exit 1' if broken else ":"
    return f'#!/bin/sh\ncase "$*" in *"sync pull"*) {wait}; {fail};; esac\ncd {REPO} && exec {sys.executable} "$@"\n'


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    work = tmp_path_factory.mktemp("pulls")
    (work / "remote").mkdir()
    (work / "shared-remote").mkdir()
    plain = work / "python-plain"
    plain.write_text(f'#!/bin/sh\ncd {REPO} && exec {sys.executable} "$@"\n')
    plain.chmod(0o755)
    overlays = {}
    for index in range(2):
        for name, broken in (("python", False), ("python-broken", index == 1)):
            (work / name).write_text("")  # the path every host names alike, its own script mounted there
            script = work / f"{name}-{index}"
            script.write_text(_python(work, index, broken))
            script.chmod(0o755)
        (work / f"remote-{index}").mkdir()
        overlays[index] = {
            str(work / "python"): str(work / f"python-{index}"),
            str(work / "python-broken"): str(work / f"python-broken-{index}"),
            str(work / "remote"): str(work / f"remote-{index}"),
        }
    made = netns_hosts.Hosts(work, 2, overlays, prefix=PREFIX, subnet=SUBNET)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def version(hosts):
    """One policy in a sync store both hosts see."""
    from composer.recipes.schema import SyncSection
    from composer.sync.pusher import push_version

    checkpoint = hosts.dir / "policy"
    checkpoint.mkdir()
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(checkpoint / "model.safetensors"))
    (checkpoint / "config.json").write_text("{}")
    return push_version(checkpoint, SyncSection(store=str(hosts.dir / "store")), cache_dir=hosts.dir / "cache").id


def engine_hosts(hosts, run: str, python: str, remote: str):
    from composer.recipes.loader import load_recipe
    from composer.rl.protocol import RLRunFiles
    from composer.rl.rollout_hosts import EngineHosts, RemoteHost

    recipe = load_recipe(
        RECIPES / "smoke-rl.yaml",
        [
            "model.checkpoint=unused",
            f"run.name={run}",
            f"run.dir={hosts.dir / 'runs'}",
            f"sync.store={hosts.dir / 'store'}",
            "rollout.engine=server",
            "rollout.parallelism.tp=2",
            f"rollout.hosts=[{hosts.names[0]}, {hosts.names[1]}]",
            f"rollout.remote_dir={hosts.dir / remote}",
            f"rollout.remote_python={hosts.dir / python}",
            "cluster.ssh.user=root",
            f"cluster.ssh.key_file={hosts.client_key}",
            f"cluster.ssh.known_hosts={hosts.known_hosts}",
        ],
    )
    files = RLRunFiles(hosts.dir / "runs" / run)
    return EngineHosts([RemoteHost(name, recipe, files) for name in recipe.rollout.hosts], number=0)


def _clear_marks(hosts) -> None:
    for index in range(2):
        (hosts.dir / f"pulling-{index}").unlink(missing_ok=True)


def test_every_host_of_an_engine_pulls_a_policy_at_the_same_time(hosts, version):
    _clear_marks(hosts)
    group = engine_hosts(hosts, "parallel", "python", "remote")
    try:
        weights = group.pull(version)
    finally:
        group.close()
    for index in range(2):  # each host's own receiver holds it, at the path both name alike
        current = (hosts.dir / f"remote-{index}" / "parallel" / "receiver" / "current").resolve()
        assert current.name == version and str(current).replace(f"remote-{index}", "remote") == weights


def test_a_failed_pull_is_one_error_naming_its_host_after_the_others_ended(hosts, version):
    _clear_marks(hosts)
    group = engine_hosts(hosts, "broken", "python-broken", "remote")
    try:
        with pytest.raises(UserError) as raised:
            group.pull(version)
    finally:
        group.close()
    said = str(raised.value)
    assert f"rollout host root@{hosts.names[1]}:22: " in said and "failed (exit 1): no composer on this host" in said
    assert hosts.names[0] not in said
    assert (hosts.dir / "remote-0" / "broken" / "receiver" / "current").resolve().name == version  # host 0's pull ended


@pytest.mark.slow  # 14 s here; the default run is near its budget
def test_hosts_that_mount_one_rollout_directory_pull_into_it_once(hosts, version):
    group = engine_hosts(hosts, "shared", "python-plain", "shared-remote")
    try:
        weights = group.pull(version)
        assert group._distinct_directories() == group.members[:1]
    finally:
        group.close()
    assert (hosts.dir / "shared-remote" / "shared" / "receiver" / "current").resolve() == Path(weights)
