"""Repository tasks from a user's project on sandbox hosts: what a build of the test project (tests/helpers/user_project.py)
validates per kind and rejects, the build's time on 1 and on 2 SSH sandbox hosts (network namespaces on this
machine, as root; their ratio), grading latency of the same task here and on a remote host (p50/p95), and the bytes
shipped to a host for the project's environment, its files and one task.

    python benchmarks/repo_envs_bench.py [--tasks 24] [--episodes 10]

The hosts share this machine's CPUs: the 1-vs-2-host ratio shows the spreading works, not what separate machines gain.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer.recipes.env_schema import RepoTaskSettings, SandboxSection
from composer.recipes.schema import SSHSection  # noqa: E402
from composer.rollout.sandbox.fleet import percentile  # noqa: E402
from composer.rollout.sandbox.hosts import SandboxFleet  # noqa: E402
from composer.rollout.sandbox.runs import Sandbox  # noqa: E402
from composer.rollout.tasks.repository.build import build_repo_tasks, set_dir  # noqa: E402
from composer.rollout.tasks.repository.remote import RemoteRepoWorkspace  # noqa: E402
from composer.rollout.tasks.repository.shipping import pack  # noqa: E402
from composer.rollout.tasks.repository.task_set import load_tasks, open_workspace, repo_tests
from tests.helpers import netns_hosts  # noqa: E402
from tests.helpers.user_project import make_project  # noqa: E402

LIMITS = dict(cpu_seconds=60, wall_seconds=120, memory_mb=2048)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=24)
    parser.add_argument("--episodes", type=int, default=10)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="repo-envs-bench-"))
    made = make_project(base / "tally")
    settings = RepoTaskSettings(
        projects=[
            {"name": "tally", "path": str(base / "tally"), "commit": "main", "package": "src/tally", "install": "pip install pytest"}
        ],
        kinds=["history", "bug", "multi", "feature"],
        num_tasks=args.tasks,
        cache_dir=str(base / "cache"),
    )
    started = time.monotonic()
    report = build_repo_tasks(settings, SandboxSection(**LIMITS), base / "sandboxes", workers=2)
    print(f"local build (environment included): {time.monotonic() - started:.1f} s; validated {report.validated} of {report.tried} tried")
    for (project, kind), count in sorted(report.by_project_kind.items()):
        print(f"  {project} {kind}: {count}")
    for reason, count in report.rejected.most_common():
        print(f"  rejected: {reason}: {count}")
    local_ids = [t["id"] for t in load_tasks(settings)]

    roots = {i: base / f"host-{i}" for i in range(2)}
    for root in roots.values():
        root.mkdir()
    Path("/tmp/composer-sandbox").mkdir(mode=0o711, exist_ok=True)
    (base / "ssh").mkdir()
    hosts = netns_hosts.Hosts(
        base / "ssh", 2, overlays={i: {"/tmp/composer-sandbox": str(r)} for i, r in roots.items()}, prefix="cmpbn", subnet="10.213.16"
    )
    python = hosts.python
    ssh = SSHSection(user="root", key_file=str(hosts.client_key), known_hosts=str(hosts.known_hosts))
    try:
        seconds = {}
        for count in (1, 2):
            shutil.rmtree(set_dir(settings))
            for survey in (base / "cache").glob("projects/*/survey-*"):
                shutil.rmtree(survey)
            sandbox = SandboxSection(**LIMITS, hosts=hosts.names[:count], sandboxes_per_host=2, remote_python=str(python))
            started = time.monotonic()
            again = build_repo_tasks(settings, sandbox, base / "sandboxes", workers=1, ssh=ssh)
            seconds[count] = time.monotonic() - started
            assert [t["id"] for t in load_tasks(settings)] == local_ids, "a remote build made another set"
            print(f"build on {count} host(s): {seconds[count]:.1f} s (runs by host {again.host_runs})")
        print(f"build time 1 host / 2 hosts: {seconds[1] / seconds[2]:.2f}")

        task = next(t for t in load_tasks(settings) if t["kind"] == "history")
        tests = repo_tests(task, settings)
        fix = next(f for f in made["fixes"] if f["commit"] == task["base"])
        command = f"cat > {fix['source']} <<'COMPOSER_EOF'\n{fix['fixed']}COMPOSER_EOF"
        local = Sandbox(SandboxSection(**LIMITS), root=base / "sandboxes")
        fleet = SandboxFleet(SandboxSection(**LIMITS, hosts=hosts.names[:1], sandboxes_per_host=2, remote_python=str(python)), ssh)
        try:
            latency = {"local": [], "remote": []}
            for _ in range(args.episodes):
                for where in latency:
                    ws = open_workspace(tests, local) if where == "local" else RemoteRepoWorkspace(fleet, tests, "fraction")
                    try:
                        ws.shell(command, 60)
                        started = time.monotonic()
                        result = ws.grade()
                        latency[where].append(time.monotonic() - started)
                        assert result.reward == 1.0, (where, result.detail)
                    finally:
                        ws.close()
            for where, values in latency.items():
                values.sort()
                print(
                    f"grading latency {where}: p50 {percentile(values, 50):.3f} s, p95 {percentile(values, 95):.3f} s "
                    f"(mean {statistics.mean(values):.3f} s, {len(values)} grades)"
                )
            print(f"remote / local p50: {percentile(latency['remote'], 50) / percentile(latency['local'], 50):.2f}")
            venv = Path(tests.environment.path[0]).parent
            sizes = {
                "project environment": pack(venv)[1].stat().st_size,
                "project files at the commit": pack(tests.grading_base)[1].stat().st_size,
                "a workspace (the task's changed files)": pack(tests.layer)[1].stat().st_size,
            }
            for what, size in sizes.items():
                print(f"bytes shipped for {what}: {size:,}")
            print(f"bytes shipped to the host in all: {dict(fleet.shipped_bytes)}")
        finally:
            fleet.close()
    finally:
        hosts.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
