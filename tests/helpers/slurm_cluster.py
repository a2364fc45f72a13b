"""A one-node SLURM cluster on this machine, for tests: Debian's slurm-wlm (slurmctld + slurmd) and munge, each
with its own configuration, key, sockets, ports and state under a temporary directory (SLURM_CONF points the
clients at it). `why_not` says why it cannot run here at all (SLURM absent from PATH, or not root); where it can,
a cluster that does not start raises with its daemons' logs. `close` stops every daemon it started."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from composer.runtime.processes import free_port
from tests.conftest import not_installed

PROGRAMS = ("munged", "slurmctld", "slurmd", "sinfo", "srun", "sbatch", "salloc", "squeue", "scancel")


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "the test SLURM cluster runs its daemons as root"
    missing = [program for program in PROGRAMS if not shutil.which(program)]
    return f"{not_installed('slurm-wlm munge')}: {', '.join(missing)} not on PATH" if missing else None


class SlurmCluster:
    def __init__(self, d: Path):
        self.dir = d
        self.node = socket.gethostname()
        self.processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
        for key in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[key]  # not inside anyone's allocation
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        d = self.dir
        (d / "state").mkdir()
        (d / "spool").mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = d / "munge.socket"
        self.processes.append(
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={socket_path}",
                    f"--pid-file={d / 'munged.pid'}",
                    f"--log-file={d / 'munged.log'}",
                    f"--seed-file={d / 'munged.seed'}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=open(d / "munged.err", "wb"),
            )
        )
        self._wait(lambda: socket_path.exists(), "munged", d / "munged.log")
        cpus = os.cpu_count() or 1
        (d / "slurm.conf").write_text(
            "\n".join(
                [
                    "ClusterName=composertest",
                    f"SlurmctldHost={self.node}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={socket_path}",
                    f"StateSaveLocation={d / 'state'}",
                    f"SlurmdSpoolDir={d / 'spool'}",
                    f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                    f"SlurmdPidFile={d / 'slurmd.pid'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    f"SlurmctldLogFile={d / 'slurmctld.log'}",
                    f"SlurmdLogFile={d / 'slurmd.log'}",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SchedulerType=sched/backfill",
                    "KillWait=5",
                    f"NodeName={self.node} CPUs={cpus} State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
                    "",
                ]
            )
        )
        for daemon in ("slurmctld", "slurmd"):
            self.processes.append(
                subprocess.Popen(
                    [daemon, "-D", "-f", str(d / "slurm.conf")],
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=open(d / f"{daemon}.err", "wb"),
                )
            )
        self._wait(self._idle, "slurmd", d / "slurmd.log", seconds=40)

    def _idle(self) -> bool:
        result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env)
        return result.stdout.strip() == "idle"

    def _wait(self, ready, what: str, log: Path, seconds: float = 15) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            dead = [p for p in self.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = ", ".join(f"{p.args[0]} exited {p.returncode}" for p in dead) or f"not ready after {seconds:.0f} s"
                logs = " | ".join(f"{p.name}: {p.read_text()[-500:]}" for p in sorted(self.dir.glob("*.err")) + [log] if p.exists())
                raise RuntimeError(f"{what} did not start ({why}); logs: {logs}")
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run(["scancel", "--full", "--quiet", "-u", "root"], env=self.env, capture_output=True)
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def running_cluster(tmp_path_factory):
    """A test module's cluster (its `slurm` fixture, module-scoped): skipped where one cannot run, stopped after."""
    import pytest

    if reason := why_not():
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.close()
