"""Sandbox servers that composer starts itself through SLURM (`env.sandbox.slurm`), on the real one-node test
cluster (tests/helpers/slurm_cluster.py): as steps of a job of their own outside an allocation, registered with the
fleet as they come up, a killed step replaced and its runs retried, nothing left in the queue after the fleet
closes or its driver is killed with -9, servers that cannot start and a job that can never start as one clear error;
and an RL smoke run inside `salloc` whose episodes are all graded by servers running as steps of its job.

The test cluster has one node (one slurmd on this machine), so a replacement lands on the same node: "another node
when one is left" is the placement rule of `cluster.slurm_steps.StepJob.place`, with no second node to show it here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import RECIPES
from tests.helpers import slurm_cluster

slurm = pytest.fixture(scope="module", name="slurm")(slurm_cluster.running_cluster)


@pytest.fixture
def slurm_env(slurm, monkeypatch):
    """This process as a login node of the test cluster, outside any allocation."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    return slurm


def squeue(slurm, *args: str) -> list[list[str]]:
    out = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, check=True, env=slurm.env).stdout
    return [line.split() for line in out.splitlines() if line.strip()]


def server_steps(slurm) -> dict[str, str]:
    """The sandbox servers' steps in the queue (named composer-sandbox-PID-SERVER): server name -> step id."""
    steps = squeue(slurm, "-s", "-o", "%i %j")
    return {name.split("-sandbox-")[1].split("-", 1)[1]: step for step, name in steps if "-sandbox-" in name}


def numbered(i: int, seconds: float):
    """A program returning `i` after `seconds`, and tests that pass only for `i`: a result is its own run's."""
    from composer.rollout.sandbox.results import AssertionTests

    program = f"import time\n\ndef answer():\n    time.sleep({seconds})\n    return {i}\n"
    return program, AssertionTests(entry_point="answer", setup="", cases=(f"assert candidate() == {i}",))


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_without_srun_the_run_stops_with_one_line(tmp_path, monkeypatch, composer):
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM here
    done = composer("env", "check", str(RECIPES / "smoke-rl.yaml"), "--set", "env.sandbox.hosts=[]", "--set", "env.sandbox.slurm.servers=1")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "error: env.sandbox.slurm starts sandbox servers but `srun` is not on PATH; run on a SLURM login node"


def test_servers_that_cannot_start_are_one_clear_error_and_leave_nothing_in_the_queue(slurm_env, tmp_path):
    from composer.recipes.env_schema import SandboxSection
    from composer.recipes.errors import UserError
    from composer.recipes.schema import SSHSection
    from composer.rollout.sandbox.hosts import SandboxFleet

    config = SandboxSection(hosts=[], slurm={"servers": 2, "nodes": 1}, remote_python=str(tmp_path / "no-python"))
    with pytest.raises(UserError) as error:
        SandboxFleet(config, SSHSection(), root=tmp_path)
    message = str(error.value)
    assert message.startswith("env.sandbox.slurm: no sandbox server started (slurm-")
    assert "no-python" in message and "env.sandbox.remote_python names the Python" in message
    wait_until(lambda: squeue(slurm_env) == [], 30, "the job of their own was left in the queue")


def test_a_job_of_their_own_that_slurm_will_never_start_is_one_clear_error(slurm_env, tmp_path):
    from composer.recipes.env_schema import SandboxSection
    from composer.recipes.errors import UserError
    from composer.recipes.schema import SSHSection
    from composer.rollout.sandbox.hosts import SandboxFleet

    # two nodes (one per server) from a one-node cluster: a job that would wait in the queue for ever
    with pytest.raises(UserError, match=r"SLURM will never start job \d+ \(salloc --nodes=2 .*\): PartitionNodeLimit"):
        SandboxFleet(SandboxSection(hosts=[], slurm={"servers": 2}), SSHSection(), root=tmp_path)
    assert squeue(slurm_env) == []


@pytest.mark.slow
def test_servers_started_as_steps_grade_and_a_killed_step_is_replaced(slurm_env, tmp_path):
    from composer.recipes.env_schema import SandboxSection
    from composer.recipes.schema import SSHSection
    from composer.rollout.sandbox.hosts import SandboxFleet
    from composer.rollout.sandbox.wire import RunRequest

    config = SandboxSection(
        hosts=[],
        slurm={"servers": 2, "nodes": 1},
        sandboxes_per_host=2,
        cpu_seconds=5,
        wall_seconds=30,
        retry_backoff_seconds=0.05,
        readmit_seconds=1.0,
    )
    fleet = SandboxFleet(config, SSHSection(), root=tmp_path)
    try:
        [(job, name)] = [row for row in squeue(slurm_env, "-o", "%i %j")]
        assert name.startswith("composer-sandbox-")  # a job of their own: this process is in no allocation
        wait_until(lambda: len(fleet.capacities) == 2, 120, "the second server never joined")
        steps = server_steps(slurm_env)
        assert sorted(steps) == ["slurm-0", "slurm-1"] and all(step.startswith(f"{job}.") for step in steps.values())

        futures = [fleet.submit(RunRequest(*numbered(i, 3))) for i in range(8)]
        wait_until(lambda: fleet.metrics()["sandbox_running"] == 4, 60, "the runs never started on both servers")
        subprocess.run(["scancel", steps["slurm-0"]], check=True)
        results = [future.result(timeout=300) for future in futures]
        assert [r.reward for r in results] == [1.0] * 8 and not any(r.infra_failure for r in results)
        figures = fleet.metrics()
        assert figures["sandbox_failures"].get("connection_lost", 0) >= 1 and figures["sandbox_infra_failures"] == 0

        # slurm-0 comes back as a new step of the same job and takes runs again
        wait_until(lambda: fleet.metrics()["sandbox_hosts_up"] == 2, 120, "the killed server was not started again")
        replaced = server_steps(slurm_env)
        assert replaced["slurm-0"] != steps["slurm-0"] and replaced["slurm-0"].startswith(f"{job}.")
        before = fleet.metrics()["sandbox_host_runs"]["slurm-0"]
        again = [fleet.submit(RunRequest(*numbered(i, 1))) for i in range(8)]
        assert [f.result(timeout=300).reward for f in again] == [1.0] * 8
        assert fleet.metrics()["sandbox_host_runs"]["slurm-0"] > before
    finally:
        fleet.close()
    assert squeue(slurm_env) == []  # the steps and the job of their own are gone


@pytest.mark.slow
@pytest.mark.engines
def test_an_rl_run_inside_salloc_is_graded_by_servers_of_its_job_and_a_killed_one_is_replaced(slurm, tmp_path):
    from composer.recipes.loader import load_recipe
    from composer.trainer.checkpoint_init import init_hf_checkpoint
    from tests.integration.test_rl import STEPS, metrics, start

    checkpoint = init_hf_checkpoint(load_recipe(RECIPES / "smoke-rl.yaml").model, tmp_path / "init", tokenizer_bytes=2**20)
    run = tmp_path / "runs" / "smoke-rl"
    servers = ["--set", "env.sandbox.hosts=[]", "--set", "env.sandbox.slurm.servers=2", "--set", "env.sandbox.readmit_seconds=2"]
    driver = start(
        tmp_path / "runs",
        checkpoint,
        *servers,
        "--set",
        "rl.eval=null",
        prefix=("salloc", "--nodes=1", "--job-name=composer-rl"),
        env={**slurm.env, "COLUMNS": "200"},
    )
    seen: dict[str, set[str]] = {}

    def watch() -> dict[str, str]:
        steps = server_steps(slurm)
        for name, step in steps.items():
            seen.setdefault(name, set()).add(step)
        return steps

    try:
        wait_until(lambda: driver.poll() is not None or (len(metrics(run)) >= 1 and len(watch()) == 2), 600, "no trained step")
        assert driver.poll() is None, driver.stdout.read()[-3000:]
        [(job, _)] = [row for row in squeue(slurm, "-o", "%i %j") if row[1] == "composer-rl"]
        steps = watch()
        assert all(step.startswith(f"{job}.") for step in steps.values())  # steps of the run's own job
        subprocess.run(["scancel", steps["slurm-0"]], env=slurm.env, check=True)
        while driver.poll() is None:
            watch()
            time.sleep(0.5)
        output = driver.stdout.read()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 0, output[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))
    assert len(seen["slurm-0"]) == 2 and len(seen["slurm-1"]) == 1  # the killed server's step was replaced
    groups = [json.loads(line) for line in (run / "rollout_metrics.jsonl").read_text().splitlines()]
    last = groups[-1]
    assert last["sandbox_failures"].get("connection_lost", 0) >= 1
    assert last["sandbox_infra_failures"] == 0  # every episode got its own grade
    assert set(last["sandbox_host_runs"]) == {"slurm-0", "slurm-1"} and all(last["sandbox_host_runs"].values())
    assert last["sandbox_completed"] >= 4 * len(groups)  # rl.group_size episodes a group, each graded once
    assert squeue(slurm) == []  # the run's job ended, its steps with it


DRIVER = """
import sys, time
from pathlib import Path
from composer.recipes.env_schema import SandboxSection
from composer.recipes.schema import SSHSection
from composer.rollout.sandbox.hosts import SandboxFleet

fleet = SandboxFleet(SandboxSection(hosts=[], slurm={"servers": 1}), SSHSection(), root=Path(sys.argv[1]))
print("up", flush=True)
time.sleep(600)
"""


def test_a_driver_killed_with_9_leaves_no_step_and_no_job_behind(slurm_env, tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert driver.stdout.readline() == "up\n"
        assert len(server_steps(slurm_env)) == 1
    finally:
        driver.kill()
        driver.wait()
    wait_until(lambda: squeue(slurm_env) == [], 60, "the server's step or the job of their own outlived the driver")
