"""`composer cluster check`: can the recipe's training hosts run it? Asked of every host before anything launches.

Each host runs one short script with the recipe's `cluster.python` (over SSH for the ssh launcher, here for
local) that reports its package versions, GPUs, free disk in run.dir and its clock; the first host also tries to
bind the rendezvous port. Then a probe file shows whether run.dir is shared.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from composer.recipes.errors import UserError
from composer.recipes.schema import ClusterSection

PACKAGES = ("composer-train", "torch", "megatron-core", "vllm")
MAX_CLOCK_SKEW_SECONDS = 1.0
MIN_FREE_GIB = 1.0

# Run on each host with its own Python: argv = run_dir, rendezvous address ("" on all but the first host), port.
# One JSON line out.
_FACTS = r"""
import json, os, shutil, socket, subprocess, sys, time
from importlib.metadata import PackageNotFoundError, version
def ver(name):
    for n in ([name, name + "-cpu"] if name == "vllm" else [name]):
        try:
            return version(n)
        except PackageNotFoundError:
            pass
    return None
run_dir, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if address == "slurm":  # under srun: the first node binds the rendezvous port on every address
    address = "0.0.0.0" if os.environ.get("SLURM_NODEID") == "0" else ""
existing = run_dir
while not os.path.exists(existing):
    existing = os.path.dirname(existing) or "/"
gpus = []
if shutil.which("nvidia-smi"):
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True)
    gpus = [line.split(", ") for line in out.stdout.strip().splitlines() if line.strip()]
port_free = None
if address:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port)); port_free = True
        except OSError:
            port_free = False
probe = os.environ.get("COMPOSER_PROBE")
probe = open(probe).read() if probe and os.path.exists(probe) else None
print(json.dumps({"probe": probe, "versions": {n: ver(n) for n in %r}, "gpus": gpus, "cpus": os.cpu_count(),
                  "free_gib": shutil.disk_usage(existing).free / 2**30, "time": time.time(), "port_free": port_free}))
""" % (PACKAGES,)


@dataclass
class HostReport:
    host: str
    facts: dict | None = None
    skew: float | None = None
    problems: list[str] = field(default_factory=list)


def check_cluster(cluster: ClusterSection, run_dir: Path) -> list[HostReport]:
    """A report per training host; problems name what to fix."""
    python = cluster.python or sys.executable
    reports = [HostReport(host) for host in cluster.hosts]
    if cluster.launcher == "local":
        _facts_here(reports[0], python, run_dir, cluster.rdzv_port)
    elif cluster.launcher == "ssh":
        _facts_over_ssh(reports, cluster, python, run_dir)
    else:
        reports = _facts_under_srun(cluster, python, run_dir)
    _compare(reports, cluster)
    return reports


def _facts_args(python: str, run_dir: Path, address: str, port: int) -> list[str]:
    return [python, "-c", _FACTS, str(run_dir), address, str(port)]


def _record(report: HostReport, stdout: str, asked: float, answered: float) -> None:
    try:
        report.facts = json.loads(stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        report.problems.append(f"cluster.python did not answer: {stdout.strip()[-200:]}")
        return
    report.skew = report.facts["time"] - (asked + answered) / 2


def _facts_here(report: HostReport, python: str, run_dir: Path, port: int) -> None:
    asked = time.time()
    # the local launcher's torchrun picks a free port of its own: no rendezvous port to check
    result = subprocess.run(_facts_args(python, run_dir, "", port), capture_output=True, text=True)
    if result.returncode != 0:
        report.problems.append(f"cluster.python {python} failed: {result.stderr.strip()[-200:]}")
        return
    _record(report, result.stdout, asked, time.time())
    report.skew = 0.0  # this host's own clock


def _facts_over_ssh(reports: list[HostReport], cluster: ClusterSection, python: str, run_dir: Path) -> None:
    from composer.cluster.ssh import SSHHost

    connections = []
    try:
        for index, report in enumerate(reports):
            try:
                ssh = SSHHost(report.host, cluster.ssh)
            except UserError as e:
                report.problems.append(f"unreachable: {e}")
                continue
            connections.append(ssh)
            command = shlex.join(_facts_args(python, run_dir, report.host if index == 0 else "", cluster.rdzv_port))
            asked = time.time()
            try:
                result = ssh.conn.run(command, hide=True, warn=True, in_stream=False)
            except Exception as e:
                report.problems.append(f"unreachable: {ssh.explain(e)}")
                continue
            if result.exited != 0:
                report.problems.append(f"cluster.python {python} failed (exit {result.exited}): {result.stderr.strip()[-200:]}")
                continue
            _record(report, result.stdout, asked, time.time())
            if report.facts:  # the clock again, without the time Python takes to start
                asked = time.time()
                clock = ssh.conn.run("date +%s.%N", hide=True, warn=True, in_stream=False)
                report.skew = float(clock.stdout.strip()) - (asked + time.time()) / 2
        if len(connections) > 1:
            from composer.cluster.launch import unshared_hosts

            for host in unshared_hosts(connections, run_dir):
                next(r for r in reports if r.host == host).problems.append(
                    f"run.dir {run_dir} not shared: a file written there on {connections[0].host} is not visible here"
                )
    finally:
        for ssh in connections:
            ssh.close()


def _facts_under_srun(cluster: ClusterSection, python: str, run_dir: Path) -> list[HostReport]:
    """Inside an allocation: one srun task per node; the probe file is written here (on the first node)."""
    import os
    import uuid

    from composer.cluster.slurm import allocation_nodes, in_allocation

    if not in_allocation():
        raise UserError(
            "cluster check: cluster.launcher is slurm; run the check inside an allocation (salloc), where it asks every node with srun"
        )
    nodes = allocation_nodes()
    reports = [HostReport(node) for node in nodes]
    if len(nodes) != len(cluster.hosts):
        reports[0].problems.append(f"the allocation has {len(nodes)} node(s), cluster.hosts lists {len(cluster.hosts)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / f".probe-{uuid.uuid4().hex}"
    probe.write_text(probe.name)
    try:
        asked = time.time()
        result = subprocess.run(
            [
                "srun",
                f"--nodes={len(nodes)}",
                f"--ntasks={len(nodes)}",
                "--ntasks-per-node=1",
                "--label",
                *_facts_args(python, run_dir, "slurm", cluster.rdzv_port),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "COMPOSER_PROBE": str(probe)},
        )
        answered = time.time()
    finally:
        probe.unlink()
    for line in result.stdout.splitlines():
        task, _, out = line.partition(": ")
        if task.strip().isdigit() and int(task) < len(reports):
            _record(reports[int(task)], out, asked, answered)
    for report in reports:
        if report.facts is None and not report.problems:
            report.problems.append(f"no answer from srun: {result.stderr.strip()[-200:]}")
        elif report.facts and report.facts.get("probe") != probe.name:
            report.problems.append(f"run.dir {run_dir} not shared: the probe file written on {nodes[0]} is not visible here")
    return reports


def _compare(reports: list[HostReport], cluster: ClusterSection) -> None:
    answered = [r for r in reports if r.facts]
    if not answered:
        return
    reference = answered[0]
    for report in answered:
        facts = report.facts
        for name in PACKAGES:
            mine, theirs = facts["versions"].get(name), reference.facts["versions"].get(name)
            if mine != theirs:
                report.problems.append(f"{name} {mine or 'missing'} != {theirs or 'missing'} on {reference.host}")
            elif mine is None and name != "vllm":
                report.problems.append(f"{name} is not installed for cluster.python")
        if facts["gpus"] and len(facts["gpus"]) < cluster.procs_per_host:
            report.problems.append(f"{len(facts['gpus'])} GPU(s) < cluster.procs_per_host={cluster.procs_per_host}")
        if facts["free_gib"] < MIN_FREE_GIB:
            report.problems.append(f"only {facts['free_gib']:.2f} GiB free in run.dir")
        if report.skew is not None and abs(report.skew) > MAX_CLOCK_SKEW_SECONDS:
            report.problems.append(f"clock off by {report.skew:+.1f} s")
        if facts["port_free"] is False:
            report.problems.append(f"rendezvous port {cluster.rdzv_port} (cluster.rdzv_port) is in use")
