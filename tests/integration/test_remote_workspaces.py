"""Repository workspaces on remote sandbox hosts: two network-namespace SSH hosts (tests/helpers/netns_hosts.py), each with a
sandbox root of its own (nothing shipped to one is seen by the other), running a user project's history task.

The same task graded on a remote host and on this machine earns the same reward and flags; the project's files and
environment cross to a host once (by digest, checked on arrival); a host killed in the middle of an episode has the
episode's workspace moved to the other host (its changes replayed) and graded there; a driver killed with -9 leaves
no workspace mounted on any host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import netns_hosts
from tests.integration.test_kernel_surface import ALL_REFUSED, PROBE

pytestmark = [pytest.mark.ssh, pytest.mark.skipif(netns_hosts.available() is not None, reason=str(netns_hosts.available()))]

SANDBOX_ROOT = "/tmp/composer-sandbox"
"""The default sandbox root, which each host has its own directory at."""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    base = tmp_path_factory.mktemp("workspace-hosts")
    Path(SANDBOX_ROOT).mkdir(mode=0o711, exist_ok=True)
    roots = {i: base / f"host-{i}" for i in range(2)}
    for root in roots.values():
        root.mkdir(mode=0o711)
    (base / "ssh").mkdir()
    made = netns_hosts.Hosts(
        base / "ssh", 2, overlays={i: {SANDBOX_ROOT: str(root)} for i, root in roots.items()}, prefix="cmpws", subnet="10.213.15"
    )  # apart from the fleet tests' hosts
    made.roots = [roots[0], roots[1]]
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A history task of the user project (tests/helpers/user_project.py), built on this machine."""
    from composer.recipes.env_schema import RepoTaskSettings, SandboxSection
    from composer.rollout.tasks.repository.build import build_repo_tasks
    from composer.rollout.tasks.repository.task_set import load_tasks, repo_tests
    from tests.helpers.user_project import make_project

    base = tmp_path_factory.mktemp("remote-task")
    made = make_project(base / "tally")
    settings = RepoTaskSettings(
        projects=[
            {"name": "tally", "path": str(base / "tally"), "commit": "main", "package": "src/tally", "install": "pip install pytest"}
        ],
        kinds=["history"],
        num_tasks=1,
        cache_dir=str(base / "cache"),
    )
    build_repo_tasks(settings, SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048), base / "sandboxes", workers=2)
    (record,) = load_tasks(settings)
    fix = next(f for f in made["fixes"] if f["commit"] == record["base"])
    return repo_tests(record, settings), fix, base / "sandboxes"


def sandbox_section(hosts, names):
    from composer.recipes.env_schema import SandboxSection

    return SandboxSection(
        hosts=names,
        sandboxes_per_host=2,
        cpu_seconds=60,
        wall_seconds=120,
        memory_mb=2048,
        retry_backoff_seconds=0.05,
        remote_python=str(hosts.python),
    )


def fleet_of(hosts, names):
    from composer.recipes.schema import SSHSection
    from composer.rollout.sandbox.hosts import SandboxFleet

    ssh = SSHSection(user="root", key_file=str(hosts.client_key), known_hosts=str(hosts.known_hosts))
    return SandboxFleet(sandbox_section(hosts, names), ssh)


def fixed(fix: dict) -> str:
    return f"cat > {fix['source']} <<'COMPOSER_EOF'\n{fix['fixed']}COMPOSER_EOF"


EPISODES = {
    "no change": [],
    "the commit's fix": ["FIX"],
    "the fix and an edited test": ["FIX", "echo '# seen' >> tests/test_stats.py"],
    "os._exit in the package": ["sed -i '1i import os; os._exit(0)' src/tally/__init__.py"],
}


def play(workspace, fix: dict, commands: list[str]):
    for command in commands:
        assert workspace.shell(fixed(fix) if command == "FIX" else command, 60).exit_code == 0
    return workspace.grade()


def test_a_task_graded_on_a_remote_host_earns_what_it_earns_here(hosts, task):
    from composer.rollout.sandbox.runs import Sandbox
    from composer.rollout.tasks.repository.remote import RemoteRepoWorkspace
    from composer.rollout.tasks.repository.task_set import open_workspace

    tests, fix, sandbox_root = task
    local = Sandbox(sandbox_section(hosts, ["localhost"]), root=sandbox_root)
    fleet = fleet_of(hosts, hosts.names)
    try:
        for name, commands in EPISODES.items():
            with open_workspace(tests, local) as here:
                mine = play(here, fix, commands)
            there_ws = RemoteRepoWorkspace(fleet, tests, "fraction")
            try:
                theirs = play(there_ws, fix, commands)
            finally:
                there_ws.close()
            assert (theirs.reward, theirs.flags, theirs.passed, theirs.total, theirs.status) == (
                mine.reward,
                mine.flags,
                mine.passed,
                mine.total,
                mine.status,
            ), name
            assert not theirs.infra_failure
        # the file tools and the agent's test run, there; two episodes at once go to both hosts
        ws, other = RemoteRepoWorkspace(fleet, tests, "fraction"), RemoteRepoWorkspace(fleet, tests, "fraction")
        try:
            assert {ws.host, other.host} == set(hosts.names)
            assert "def median" in ws.read_file("src/tally/stats.py")
            ws.write_file("notes.txt", "remote\n")
            assert ws.shell("cat notes.txt", 30).output == "remote\n"
            # the seccomp filter holds on the remote host too (a shell command there, and what it starts)
            assert ALL_REFUSED in ws.shell(f"python - <<'EOF'\n{PROBE}EOF", 60).output
            with pytest.raises(FileNotFoundError):
                ws.read_file("no/such/file.py")
            assert "1 failed" in other.run_tests().output
        finally:
            ws.close()
            other.close()
        shipped = dict(fleet.shipped_bytes)
        # each host got the project's files, its environment and the task once: later episodes ship nothing
        assert set(shipped) == set(hosts.names) and all(n > 1 << 20 for n in shipped.values())
        for again in [RemoteRepoWorkspace(fleet, tests, "fraction") for _ in range(2)]:
            again.close()
        assert dict(fleet.shipped_bytes) == shipped
        print(f"bytes shipped per host: {shipped}")
    finally:
        fleet.close()
    for root in hosts.roots:  # every host unpacked its own copies, and closed every workspace
        assert len([p for p in (root / "shipped").iterdir() if not p.name.startswith(".")]) == 3
        assert list((root / "workspaces").iterdir()) == []


def test_what_arrives_is_checked_against_its_digest(tmp_path):
    from composer.rollout.tasks.repository.shipping import ShippingError, Store, pack

    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("x = 1\n")
    digest, archive = pack(tree)
    store = Store(tmp_path / "host")
    store.begin(digest)
    store.chunk(digest, archive.read_bytes()[:-10] + b"0" * 10)
    with pytest.raises(ShippingError, match="has the digest"):
        store.receive(digest, None)
    assert not store.have(digest) and list(store.root.iterdir()) == []
    store.begin(digest)
    store.chunk(digest, archive.read_bytes())
    store.receive(digest, None)
    assert (store.path(digest) / "tree" / "pkg" / "mod.py").read_text() == "x = 1\n"


def mounted_workspaces() -> list[str]:
    """Workspace mounts in any mount namespace of this machine (every host's server lives in one of its own)."""
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry.name}/mountinfo").read_text()
        except OSError:
            continue
        found |= {line.split()[4] for line in text.splitlines() if "/workspaces/ws-" in line.split()[4]}
    return sorted(found)


def test_a_killed_driver_leaves_no_workspace_mounted_on_any_host(hosts, task):
    tests, _, _ = task
    driver_code = textwrap.dedent(f"""
        import pickle, sys, time
        from tests.integration.test_remote_workspaces import fleet_of
        from composer.rollout.tasks.repository.remote import RemoteRepoWorkspace

        class Hosts:
            names = {hosts.names!r}
            client_key = {str(hosts.client_key)!r}
            known_hosts = {str(hosts.known_hosts)!r}
            python = {str(hosts.python)!r}

        tests = pickle.loads(sys.stdin.buffer.read())
        fleet = fleet_of(Hosts, Hosts.names)
        workspaces = [RemoteRepoWorkspace(fleet, tests, "fraction") for _ in range(2)]
        for ws in workspaces:
            ws.shell("echo busy > busy.txt", 30)
        print("open", sorted(ws.host for ws in workspaces), flush=True)
        time.sleep(600)
    """)
    import pickle

    before = mounted_workspaces()
    driver = subprocess.Popen([sys.executable, "-c", driver_code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False)
    try:
        driver.stdin.write(pickle.dumps(tests))
        driver.stdin.close()
        line = driver.stdout.readline().decode()
        assert line.startswith("open") and all(name in line for name in hosts.names), line
        assert len(mounted_workspaces()) > len(before)  # the views (and their caps) are mounted on the hosts
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 30
    while (hosts.processes("rollout.sandbox_host") or mounted_workspaces() != before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hosts.processes("rollout.sandbox_host") == []
    assert mounted_workspaces() == before


def test_env_build_spreads_its_surveys_and_validations_over_the_sandbox_hosts(hosts, task):
    """The set a build on the two hosts makes (this machine not among them) is the one built here; a host validates
    across the grading boundary as this machine does (the task's function in a process of its own there: its answers
    judged by the grader's tests, an answer that is not data refused)."""
    import shutil

    from composer.recipes.env_schema import RepoTaskSettings
    from composer.recipes.schema import SSHSection
    from composer.rollout.tasks.repository.build import build_repo_tasks, set_dir
    from composer.rollout.tasks.repository.remote import remote_test_run
    from composer.rollout.tasks.repository.task_set import load_tasks
    from tests.helpers.repo_cheats import in_function

    tests, _, _ = task
    cache = tests.grading_base.parents[2]
    settings = RepoTaskSettings(
        projects=[
            {
                "name": "tally",
                "path": str(cache.parent / "tally"),
                "commit": "main",
                "package": "src/tally",
                "install": "pip install pytest",
            }
        ],
        kinds=["history"],
        num_tasks=1,
        cache_dir=str(cache),
    )
    here = [(t["id"], t["fail_to_pass"], t["pass_to_pass"]) for t in load_tasks(settings)]
    shutil.rmtree(set_dir(settings))  # its verdicts, and every survey: the build runs them again, on the hosts
    for survey in cache.glob("projects/*/survey-*"):
        shutil.rmtree(survey)
    ssh = SSHSection(user="root", key_file=str(hosts.client_key), known_hosts=str(hosts.known_hosts))
    report = build_repo_tasks(
        settings, sandbox_section(hosts, hosts.names), tests.grading_base.parents[3] / "sandboxes", workers=1, ssh=ssh
    )
    assert report.validated == 1 and set(report.host_runs) == set(hosts.names), report.host_runs
    assert [(t["id"], t["fail_to_pass"], t["pass_to_pass"]) for t in load_tasks(settings)] == here
    assert not wait_servers_gone(hosts)  # the build's fleet is closed

    (scope,) = tests.scope
    text = (tests.grading_base / scope.path).read_text()
    versions = {
        "the commit's": {},
        "the parent's": {scope.path: (tests.layer / scope.path).read_text()},
        "a class for an answer": {scope.path: in_function(text, scope.functions[0], [], ("", "class Made:\n    pass\n\nreturn Made\n"))},
    }
    fleet = fleet_of(hosts, hosts.names)
    try:
        across = remote_test_run(
            fleet,
            hosts.names[0],
            "tally",
            tests.grading_base,
            tests.environment,
            tests.pytest_args,
            False,
            tests.packages,
            tests.scope,
        )
        reports = {name: across(files, tests.test_files, 60) for name, files in versions.items()}
    finally:
        fleet.close()
    expected = (*tests.fail_to_pass, *tests.pass_to_pass)
    assert not any(r.infra_failure for r in reports.values())
    assert all(reports["the commit's"].outcomes.get(i) == "passed" for i in expected) and not reports["the commit's"].refused
    assert [reports["the parent's"].outcomes.get(i) for i in tests.fail_to_pass] == ["failed"] * len(tests.fail_to_pass)
    refused = reports["a class for an answer"].refused
    assert refused and all(reason.startswith("result: ") for reason in refused), refused


def wait_servers_gone(hosts, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while hosts.processes("rollout.sandbox_host") and time.monotonic() < deadline:
        time.sleep(0.2)
    return bool(hosts.processes("rollout.sandbox_host"))


@pytest.mark.slow
def test_a_host_killed_in_the_middle_of_an_episode_is_replaced(hosts, task):
    """Last in this module: it kills a host (and brings it back)."""
    from composer.rollout.tasks.repository.remote import RemoteRepoWorkspace

    tests, fix, _ = task
    fleet = fleet_of(hosts, hosts.names)
    try:
        ws = RemoteRepoWorkspace(fleet, tests, "fraction")
        first = ws.host
        assert ws.shell(fixed(fix), 60).exit_code == 0  # the episode's change, on the first host
        ws.write_file("notes.txt", "kept\n")
        hosts.kill(next(h for h in hosts.hosts if h.name == first))
        result = ws.grade()  # the host is gone: the workspace moves, its changes replayed, and is graded there
        assert (result.reward, result.flags, result.infra_failure) == (1.0, (), False), (result.detail, result.stdout_tail[-1000:])
        assert ws.hosts_used == [first, next(n for n in hosts.names if n != first)]
        assert ws.read_file("notes.txt") == "kept\n"
        ws.close()
    finally:
        fleet.close()
        hosts.restart(next(h for h in hosts.hosts if h.name == first))


@pytest.mark.slow
@pytest.mark.engines
def test_rl_on_repository_tasks_graded_on_the_remote_hosts(hosts, tmp_path, composer):
    """`composer train rl recipes/smoke-repo-rl.yaml` with both sandbox hosts remote: every episode's workspace lives,
    runs its tools and is graded there (the tiny model's reward may stay 0: the episodes and verdicts are checked)."""
    import json

    from composer.recipes.loader import load_recipe
    from composer.rl.trajectories import TrajectoryStore
    from composer.trainer.checkpoint_init import init_hf_checkpoint
    from tests.conftest import RECIPES

    recipe = RECIPES / "smoke-repo-rl.yaml"
    cache = ["--set", f"env.tasks.0.repo.cache_dir={tmp_path / 'repo-tasks'}"]
    built = composer("env", "build", str(recipe), *cache)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    checkpoint = init_hf_checkpoint(load_recipe(recipe).model, tmp_path / "init", tokenizer_bytes=2**20)
    run = tmp_path / "runs" / "smoke-repo-rl"

    def shipped():
        return {d.name for root in hosts.roots if (root / "shipped").is_dir() for d in (root / "shipped").iterdir()}

    before = shipped()
    remote = [
        f"env.sandbox.hosts=[{hosts.names[0]}, {hosts.names[1]}]",
        "env.sandbox.sandboxes_per_host=2",
        f"env.sandbox.remote_python={hosts.python}",
        "cluster.ssh.user=root",
        f"cluster.ssh.key_file={hosts.client_key}",
        f"cluster.ssh.known_hosts={hosts.known_hosts}",
    ]
    result = composer(
        "train",
        "rl",
        str(recipe),
        "--set",
        f"model.checkpoint={checkpoint}",
        "--set",
        f"run.dir={run.parent}",
        "--set",
        f"sync.store={run}/weights",
        *cache,
        *(a for s in remote for a in ("--set", s)),
        timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    groups = [json.loads(line) for line in (run / "rollout_metrics.jsonl").read_text().splitlines()]
    assert groups and all(g["infra_failure_rate"] == 0.0 for g in groups)
    assert shipped() - before  # the networkx trees the episodes worked and were graded in went to the hosts
    store = TrajectoryStore(run / "trajectories")
    trajectories = [t for stage in TrajectoryStore.STAGES for g in store.groups(stage) for t in store.load(g, stage)]
    assert trajectories and all(t.task_id.startswith("repo/networkx/bug/") for t in trajectories)
    for t in trajectories:
        # graded on a remote host by the project's own tests: every expected test id was reported
        assert t.info["tests_total"] >= 1 and t.info["sandbox_status"] != "infra"
    assert not any(root.joinpath("workspaces").exists() and any(root.joinpath("workspaces").iterdir()) for root in hosts.roots)
