"""SLURM: ranks started by `srun` inside an allocation, and sbatch jobs that run a composer command in one.

Inside an allocation (`SLURM_JOB_ID` set), one srun task per node runs torchrun with SLURM's node id as its
node rank and the allocation's first node as the c10d rendezvous. Outside one, `submit` writes an sbatch
script (and the resolved recipe) into the run directory and submits it; the job runs the same composer
command inside its allocation, which then takes the srun path.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from rich.console import Console

from composer.cluster.launch import (
    HostCommand,
    HostProcess,
    Job,
    Launcher,
    LaunchPlan,
    OutputPump,
    clear_rank_errors,
    rank_environment,
    torchrun_argv,
)
from composer.recipes.errors import UserError
from composer.runtime.processes import die_with_parent
from composer.runtime.run_dir import RunDir, atomic_write_text


def in_allocation() -> bool:
    return "SLURM_JOB_ID" in os.environ


def allocation_nodes() -> list[str]:
    """The allocation's node names, in SLURM's order (node id 0 first)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"scontrol show hostnames {nodelist} failed: {result.stderr.strip()}")
    return result.stdout.split()


def require(tool: str, wanted_by: str = "cluster.launcher is slurm") -> str:
    path = shutil.which(tool)
    if path is None:
        raise UserError(f"{wanted_by} but `{tool}` is not on PATH; run on a SLURM login node")
    return path


class SlurmLauncher(Launcher):
    def nodes(self) -> list[str]:
        if not in_allocation():
            return list(self.cluster.hosts)  # placeholders until SLURM picks the nodes
        nodes = allocation_nodes()
        if len(nodes) != len(self.cluster.hosts):
            raise UserError(
                f"the SLURM allocation {os.environ['SLURM_JOB_ID']} has {len(nodes)} node(s) but cluster.hosts "
                f"lists {len(self.cluster.hosts)}: the recipe's world size needs one node per listed host"
            )
        return nodes

    def plan(self, module: str, args: list[str], run_id: str) -> LaunchPlan:
        nodes, nproc = self.nodes(), self.cluster.procs_per_host
        endpoint = f"{nodes[0]}:{self.cluster.rdzv_port}"
        env = rank_environment(self.cluster)
        commands = [
            HostCommand(
                node,
                index,
                range(index * nproc, (index + 1) * nproc),
                torchrun_argv(self.python, nproc, module, args, nnodes=len(nodes), node_rank=index, endpoint=endpoint, run_id=run_id),
                env,
                self.workdir,
            )
            for index, node in enumerate(nodes)
        ]
        notes = [f"srun: {shlex.join(self.srun_argv(module, args, run_id, nodes))}"]
        if not in_allocation():
            notes.insert(0, "outside an allocation: `--submit` writes an sbatch script into the run directory and submits it")
        return LaunchPlan("slurm", commands, endpoint, notes)

    def srun_argv(self, module: str, args: list[str], run_id: str, nodes: list[str]) -> list[str]:
        """One task per node; each task's torchrun takes the node id SLURM gives it as its node rank."""
        torchrun = torchrun_argv(
            self.python,
            self.cluster.procs_per_host,
            module,
            args,
            nnodes=len(nodes),
            node_rank="$SLURM_NODEID",
            endpoint=f"{nodes[0]}:{self.cluster.rdzv_port}",
            run_id=run_id,
        )
        script = shlex.join(torchrun).replace(shlex.quote("$SLURM_NODEID"), '"$SLURM_NODEID"')
        return [
            "srun",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
            "--label",
            f"--chdir={self.workdir}",
            "bash",
            "-c",
            f"exec {script}",
        ]

    def check_startable(self) -> None:
        if not in_allocation():
            raise UserError(
                "cluster.launcher is slurm but this is not inside a SLURM allocation (no SLURM_JOB_ID): "
                "pass --submit to run it as a batch job, or start it inside salloc"
            )
        require("srun")
        self.nodes()

    def start(self, module: str, args: list[str], run: RunDir, console: Console | None = None) -> Job:
        self.check_startable()
        nodes = self.nodes()
        argv = self.srun_argv(module, args, f"{run.root.name}-{os.environ['SLURM_JOB_ID']}", nodes)
        argv[0] = require("srun")
        clear_rank_errors(run)
        process = SrunProcess(argv, {**os.environ, **rank_environment(self.cluster)}, nodes, run, console, self.cluster.procs_per_host)
        return Job(run, [process])


class SrunProcess(HostProcess):
    """One srun step over every node; its labelled output ("<task>: line") is split by node."""

    def __init__(self, argv: list[str], env: dict[str, str], nodes: list[str], run: RunDir, console: Console | None, nproc: int):
        self.nodes, self.nproc, self.run = nodes, nproc, run
        self.host, self.node_rank, self.ranks = ",".join(nodes), 0, range(len(nodes) * nproc)
        self.log = run.logs / "srun.log"
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        self.node_offsets = {node: _size(run.logs / node / "torchrun.log") for node in nodes}  # logs of earlier runs stay
        self.pumps = {node: OutputPump(run.logs / node / "torchrun.log", console) for node in nodes}
        self.own = OutputPump(self.log, None)
        # srun cancels the step on every node when it gets SIGTERM: also when this process dies
        self.process = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=lambda: die_with_parent(signal.SIGTERM)
        )
        self.reader = threading.Thread(target=self._read, daemon=True, name="srun-output")
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.own.line("srun", line)
            labelled = re.match(rb"\s*(\d+): ?(.*)", line, re.S)
            if labelled and int(labelled.group(1)) < len(self.nodes):
                self.pumps[self.nodes[int(labelled.group(1))]].line(self.nodes[int(labelled.group(1))], labelled.group(2))

    def exit_code(self) -> int | None:
        code = self.process.poll()
        if code is not None:
            self.reader.join(timeout=5)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def close(self) -> None:
        self.reader.join(timeout=5)
        for pump in [*self.pumps.values(), self.own]:
            pump.close()

    def where(self) -> str:
        """The node whose torchrun reported a failure (its labelled output holds torchrun's report)."""
        for index, node in enumerate(self.nodes):
            path = self.run.logs / node / "torchrun.log"
            if path.exists() and b"Root Cause" in path.read_bytes()[self.node_offsets[node] :]:
                return f"host {node} (node {index}, ranks {index * self.nproc}-{(index + 1) * self.nproc - 1})"
        return f"srun over {self.host}"


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def sbatch_script(launcher: SlurmLauncher, command: list[str], run: RunDir, job_name: str) -> str:
    """A batch script that runs `command` (a composer command) on the first node of an allocation of one node per
    training host; the command then starts the ranks with srun."""
    cluster = launcher.cluster
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={len(cluster.hosts)}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={run.root / 'slurm' / 'job-%j.out'}",
    ]
    for flag, value in (("partition", cluster.slurm.partition), ("account", cluster.slurm.account), ("time", cluster.slurm.time_limit)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += ["set -euo pipefail", f"cd {shlex.quote(launcher.workdir)}", f"exec {shlex.join(command)}", ""]
    return "\n".join(lines)


def batch_script(launcher: SlurmLauncher, kind: str, run: RunDir, resume: bool) -> str:
    """The sbatch script of `composer train KIND` for this run (its resolved recipe in RUN/slurm/recipe.yaml)."""
    command = [
        launcher.python,
        "-m",
        "composer.cli",
        "train",
        kind,
        str(run.root / "slurm" / "recipe.yaml"),
        *(["--resume"] if resume else []),
    ]
    return sbatch_script(launcher, command, run, f"composer-{run.root.name}")


def submit(launcher: SlurmLauncher, kind: str, recipe_yaml: str, run: RunDir, resume: bool) -> tuple[str, Path]:
    """Write the resolved recipe and an sbatch script into RUN/slurm/ and submit it; returns (job id, script)."""
    if in_allocation():
        raise UserError("--submit: this is already inside a SLURM allocation; run the command without --submit")
    sbatch = require("sbatch")
    script = run.root / "slurm" / "job.sbatch"
    atomic_write_text(run.root / "slurm" / "recipe.yaml", recipe_yaml)
    atomic_write_text(script, batch_script(launcher, kind, run, resume))
    result = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"sbatch {script} failed: {(result.stderr or result.stdout).strip()}")
    return result.stdout.strip().split(";")[0], script
