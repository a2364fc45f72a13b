"""The one way to get a launcher: `build_launcher(cluster)` for `cluster.launcher` (local, ssh, slurm)."""

from __future__ import annotations

from composer.cluster.launch import Launcher, LocalLauncher, SSHLauncher
from composer.cluster.slurm import SlurmLauncher
from composer.recipes.schema import ClusterSection


def build_launcher(cluster: ClusterSection) -> Launcher:
    if cluster.launcher == "ssh":
        return SSHLauncher(cluster)
    if cluster.launcher == "slurm":
        return SlurmLauncher(cluster)
    return LocalLauncher(cluster)
