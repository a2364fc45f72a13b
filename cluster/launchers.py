"""The one way to get a launcher: `build_launcher(cluster)` for `cluster.launcher` (local, ssh, slurm)."""

from __future__ import annotations

from cluster.launch import Launcher, LocalLauncher, SSHLauncher
from cluster.slurm import SlurmLauncher
from recipes.schema import ClusterSection


def build_launcher(cluster: ClusterSection) -> Launcher:
    if cluster.launcher == "ssh":
        return SSHLauncher(cluster)
    if cluster.launcher == "slurm":
        return SlurmLauncher(cluster)
    return LocalLauncher(cluster)
