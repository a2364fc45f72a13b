"""The sandbox fleet on real hosts: three network namespaces on this machine, each with its own OpenSSH server
(tests/helpers/netns_hosts.py); every host grades on its own sandbox server, started over SSH with its composer.

A host killed in the middle of a burst (every process of it: sshd, its sandbox server, the runs) has its runs
retried on the others, and every run ends with its own program's score (no infra failure); an unreachable host at
start is one clear error; a driver killed with -9 leaves no sandbox server behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO
from tests.helpers import netns_hosts

pytestmark = [pytest.mark.ssh, pytest.mark.skipif(netns_hosts.available() is not None, reason=str(netns_hosts.available()))]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    made = netns_hosts.Hosts(tmp_path_factory.mktemp("sandbox-hosts"), 3)
    try:
        yield made
    finally:
        made.close()


def ssh_section(hosts):
    from composer.recipes.schema import SSHSection

    return SSHSection(user="root", key_file=str(hosts.client_key), known_hosts=str(hosts.known_hosts))


def sandbox_section(names: list[str], hosts=None, **more):
    from composer.recipes.env_schema import SandboxSection

    if hosts is not None:
        more = {"remote_python": str(hosts.python), **more}
    return SandboxSection(hosts=names, sandboxes_per_host=2, cpu_seconds=5, wall_seconds=30, retry_backoff_seconds=0.05, **more)


def numbered(i: int, seconds: float):
    """A program returning `i` after `seconds`, and tests that pass only for `i`: a result is its own run's."""
    from composer.rollout.sandbox.results import AssertionTests

    program = f"import time\n\ndef answer():\n    time.sleep({seconds})\n    return {i}\n"
    return program, AssertionTests(entry_point="answer", setup="", cases=(f"assert candidate() == {i}",))


def wait_for_no_process(hosts, pattern: str, seconds: float = 20) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := hosts.processes(pattern)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_remote_hosts_grade_like_this_one(hosts, tmp_path):
    from composer.recipes.env_schema import SandboxSection
    from composer.rollout.sandbox.hosts import SandboxFleet
    from composer.rollout.sandbox.results import CallTests, GeneratedCalls, ScriptRun
    from composer.rollout.sandbox.runs import Sandbox

    cases = [
        numbered(7, 0),
        ("def f(x):\n    return x * 2\n", CallTests(entry_point="f", inputs=('{"x": 2}', '{"x": 3}'), expected=("4", "7"), seed=1)),
        (
            "import random\n\ndef f(x):\n    return x + 1\n\ndef gen(rng):\n    return {'x': rng.randrange(9)}\n",
            GeneratedCalls(entry_point="f", generator="gen", count=3, seed=5),
        ),
        ("print('hello from', 6 * 7)\n", ScriptRun()),
    ]
    local = Sandbox(SandboxSection(cpu_seconds=5, wall_seconds=30), root=tmp_path)
    fleet = SandboxFleet(sandbox_section(hosts.names[:2], hosts), ssh_section(hosts))
    try:
        assert fleet.capacities == {name: 2 for name in hosts.names[:2]}
        assert all(iso.dedicated_uid and iso.namespaces for iso in fleet.isolations.values())
        for program, tests in cases:
            here, there = local.run(program, tests), fleet.run(program, tests)
            assert (there.reward, there.passed, there.total, there.status, there.stdout_tail, there.flags) == (
                here.reward,
                here.passed,
                here.total,
                here.status,
                here.stdout_tail,
                here.flags,
            )
            assert [(c.ok, c.input, c.output) for c in there.cases] == [(c.ok, c.input, c.output) for c in here.cases]
            assert not there.infra_failure
        assert sum(fleet.metrics()["sandbox_host_runs"].values()) == len(cases)
    finally:
        fleet.close()
    assert wait_for_no_process(hosts, "rollout.sandbox_host") == []  # closing the fleet ends its servers


def test_an_unreachable_host_or_a_missing_composer_at_start_is_one_clear_error(hosts):
    from composer.recipes.errors import UserError
    from composer.rollout.sandbox.hosts import SandboxFleet

    with pytest.raises(UserError, match=f"root@{netns_hosts.UNUSED_ADDRESS}:22: cannot connect"):
        SandboxFleet(sandbox_section([hosts.names[0], netns_hosts.UNUSED_ADDRESS], hosts), ssh_section(hosts))
    assert wait_for_no_process(hosts, "rollout.sandbox_host") == []  # the reachable host was closed again
    with pytest.raises(
        UserError,
        match=f"sandbox host root@{hosts.names[0]}:22: its sandbox server .* did not start: .*No such file.*env.sandbox.remote_python",
    ):
        SandboxFleet(sandbox_section([hosts.names[0]], remote_python="/nonexistent/python"), ssh_section(hosts))


def test_a_killed_driver_leaves_no_sandbox_server(hosts):
    driver_code = textwrap.dedent(f"""
        import time
        from composer.recipes.env_schema import SandboxSection
        from composer.recipes.schema import SSHSection
        from composer.rollout.sandbox.hosts import SandboxFleet
        from composer.rollout.sandbox.wire import RunRequest
        from tests.integration.test_fleet_hosts import numbered

        ssh = SSHSection(user="root", key_file={str(hosts.client_key)!r}, known_hosts={str(hosts.known_hosts)!r})
        fleet = SandboxFleet(SandboxSection(hosts={hosts.names[:2]!r}, sandboxes_per_host=2, wall_seconds=600,
                                            remote_python={str(hosts.python)!r}), ssh)
        futures = [fleet.submit(RunRequest(*numbered(i, 300))) for i in range(4)]
        while len(fleet.pool.metrics.start_latency) < 4:  # every host's server has started its runs
            time.sleep(0.05)
        print("running", flush=True)
        futures[0].result()
    """)
    driver = subprocess.Popen([sys.executable, "-c", driver_code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "running"
        assert len(hosts.processes("rollout.sandbox_host")) == 2
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    assert wait_for_no_process(hosts, "rollout.sandbox_host") == []
    assert wait_for_no_process(hosts, "sandbox/zygote.py") == []


def test_env_check_grades_every_reference_on_the_recipes_sandbox_hosts(hosts, write_recipe):
    from tests.conftest import RECIPES, run_composer

    recipe = write_recipe(
        f"extends: {RECIPES / 'smoke-rl.yaml'}\n"
        "env:\n  tasks:\n    - {name: smoke, limit: 6}\n    - {name: humaneval, limit: 4}\n"
        f"  sandbox: {{hosts: [{hosts.names[0]}, {hosts.names[1]}], sandboxes_per_host: 1, remote_python: {hosts.python}}}\n"
        f"cluster: {{ssh: {{user: root, key_file: {hosts.client_key}, known_hosts: {hosts.known_hosts}}}}}\n"
        "rl: {eval: null}\n"
    )
    result = run_composer("env", "check", str(recipe), "--workers", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    for name in hosts.names[:2]:
        assert f"sandbox on {name} (1 at once): a dedicated uid per run, mount, PID and network namespaces" in result.stdout
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 5}
    assert "100.0%" in rows["smoke"] and "100.0%" in rows["humaneval"]
    assert wait_for_no_process(hosts, "rollout.sandbox_host") == []

    unreachable = run_composer("env", "check", str(recipe), "--set", f"env.sandbox.hosts=[{hosts.names[0]}, {netns_hosts.UNUSED_ADDRESS}]")
    assert unreachable.returncode == 2 and "Traceback" not in unreachable.stderr
    assert f"root@{netns_hosts.UNUSED_ADDRESS}:22: cannot connect" in " ".join(unreachable.stderr.split())


@pytest.mark.engines
def test_an_rl_run_grades_its_episodes_on_the_sandbox_hosts(hosts, tmp_path):
    import json

    from composer.recipes.loader import load_recipe
    from composer.trainer.checkpoint_init import init_hf_checkpoint
    from tests.conftest import RECIPES
    from tests.integration.test_rl import start

    checkpoint = init_hf_checkpoint(load_recipe(RECIPES / "smoke-rl.yaml").model, tmp_path / "init", tokenizer_bytes=2**20)
    sets = [
        f"env.sandbox.hosts=[{hosts.names[0]}, {hosts.names[1]}]",
        "env.sandbox.sandboxes_per_host=2",
        "cluster.ssh.user=root",
        f"env.sandbox.remote_python={hosts.python}",
        f"cluster.ssh.key_file={hosts.client_key}",
        f"cluster.ssh.known_hosts={hosts.known_hosts}",
        "train.steps=2",
        "rl.eval=null",
    ]
    driver = start(tmp_path / "runs", checkpoint, *(a for s in sets for a in ("--set", s)))
    output, _ = driver.communicate(timeout=900)
    assert driver.returncode == 0, output[-3000:]
    groups = [json.loads(line) for line in (tmp_path / "runs" / "smoke-rl" / "rollout_metrics.jsonl").read_text().splitlines()]
    last = groups[-1]
    assert set(last["sandbox_host_runs"]) == set(hosts.names[:2]) and all(n > 0 for n in last["sandbox_host_runs"].values())
    assert last["sandbox_infra_failures"] == 0 and last["infra_failure_rate"] == 0 and last["sandbox_hosts_up"] == 2
    assert wait_for_no_process(hosts, "rollout.sandbox_host") == []


def test_a_host_killed_mid_run_has_its_runs_retried_on_the_others_and_is_readmitted_when_back(hosts):
    """Last in this module: it kills the third host (and brings it back)."""
    from composer.rollout.sandbox.hosts import SandboxFleet
    from composer.rollout.sandbox.wire import RunRequest

    runs = 24
    fleet = SandboxFleet(sandbox_section(hosts.names, hosts, readmit_seconds=2), ssh_section(hosts))
    victim = hosts.hosts[2]
    try:
        futures = [fleet.submit(RunRequest(*numbered(i, 0.5)), task_set="smoke") for i in range(runs)]
        deadline = time.monotonic() + 60
        while not hosts.pids(victim, "sandbox/zygote.py") or fleet.metrics()["sandbox_completed"] < 2:
            assert time.monotonic() < deadline, fleet.metrics()
            time.sleep(0.05)
        before = fleet.metrics()
        hosts.kill(victim)  # sshd, its sessions, the sandbox server, the runs
        results = [f.result(timeout=600) for f in futures]
        after = fleet.metrics()
        assert before["sandbox_completed"] < runs, "the host died after the burst"
        assert [r.reward for r in results] == [1.0] * runs, [(r.status, r.detail) for r in results if r.reward != 1.0]
        assert not any(r.infra_failure for r in results)
        assert after["sandbox_failures"].get("connection_lost", 0) >= 1 and after["sandbox_retries"] >= 1, after
        assert after["sandbox_hosts_up"] == 2 and after["sandbox_infra_failures"] == 0
        assert all(after["sandbox_host_runs"][name] > 0 for name in hosts.names[:2])
        print(f"host {victim.name} killed after {before['sandbox_completed']} of {runs} runs: {after}")

        # probed while it is down, every cool-down (2 s): it stays out
        deadline = time.monotonic() + 60
        while fleet.metrics()["sandbox_failures"].get("probe_failed", 0) < 1:
            assert time.monotonic() < deadline, fleet.metrics()
            time.sleep(0.1)
        assert fleet.metrics()["sandbox_hosts_up"] == 2
        # back: a probe after the cool-down reconnects, starts its server again and re-admits it
        hosts.restart(victim)
        while fleet.metrics()["sandbox_hosts_up"] < 3:
            assert time.monotonic() < deadline, fleet.metrics()
            time.sleep(0.1)
        again = [fleet.submit(RunRequest(*numbered(i, 0.2))) for i in range(12)]
        assert [f.result(timeout=600).reward for f in again] == [1.0] * 12
        assert fleet.metrics()["sandbox_host_runs"][victim.name] > after["sandbox_host_runs"][victim.name]
    finally:
        fleet.close()
