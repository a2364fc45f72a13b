"""Which devices each rollout engine and each learner rank gets on a host.

The learner's ranks take a training host's first `cluster.procs_per_host` devices (on GPUs `cuda:LOCAL_RANK`
already is; on CPUs each rank is bound to its core), the engines the next ones in order, so the two never
share a device unless `rollout.share_learner_devices` says so. On a GPU host an engine sees only its own GPUs
(CUDA_VISIBLE_DEVICES, one per engine rank); on a CPU host each engine rank gets its own cores through vLLM's
VLLM_CPU_OMP_THREADS_BIND (one core list per rank, `|` between them), and one core is left to the engines'
front ends (API server, scheduler) when there are more cores than engine ranks, as vLLM's own binding does.

An engine larger than one host (rollout.parallelism over several hosts' devices) takes consecutive hosts of
`rollout.hosts`, all their devices; its commands are vLLM's multi-node modes (rollout/engines/vllm_engine.py).
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass

from composer.cluster.engine_fit import engine_fit_problems, learner_devices_on
from composer.recipes.errors import UserError
from composer.recipes.schema import Recipe, RolloutDevicesSection, RolloutSection

RANK_CORES_ENV = "COMPOSER_RANK_CORES"
"""The cores of each local learner rank on a CPU host (`0|1|...`, by LOCAL_RANK), set by the driver when the
learner must keep off the engines' cores."""


def _found_devices() -> dict:
    """This host's GPUs (torch decides, as vLLM does) or, without any, the CPU cores this process may use (its source
    is also `PROBE`, run on other hosts: it imports what it needs itself)."""
    import os

    try:
        import torch

        gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    except ImportError:
        gpus = []
    if gpus:
        return {"kind": "gpu", "ids": list(range(len(gpus))), "memory": min(gpus)}
    return {"kind": "cpu", "ids": sorted(os.sched_getaffinity(0)), "memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}


PROBE = f"import json\n{inspect.getsource(_found_devices)}\nprint(json.dumps(_found_devices()))"
"""Run by a host's own Python: its devices as one JSON line (`HostDevices.from_probe`)."""


@dataclass(frozen=True)
class HostDevices:
    """What a host has: GPU indices (memory per GPU) or the CPU cores this process may use (the host's memory)."""

    kind: str
    ids: tuple[int, ...]
    memory_gib: float

    @classmethod
    def from_probe(cls, line: str) -> HostDevices:
        found = json.loads(line)
        return cls(found["kind"], tuple(found["ids"]), found["memory"] / 2**30)

    @classmethod
    def declared(cls, devices: RolloutDevicesSection) -> HostDevices:
        return cls(devices.kind, tuple(range(devices.per_host)), devices.memory_gib)

    def section(self) -> RolloutDevicesSection:
        return RolloutDevicesSection(kind=self.kind, per_host=len(self.ids), memory_gib=self.memory_gib)

    @property
    def unit(self) -> str:
        return "GPU" if self.kind == "gpu" else "core"


def local_devices() -> HostDevices:
    """This machine's devices."""
    return HostDevices.from_probe(json.dumps(_found_devices()))


@dataclass(frozen=True)
class EnginePlacement:
    """One engine's share of a host: the devices of each of its ranks there."""

    number: int
    """The engine's number on its host (an engine over several hosts: its number in the fleet)."""
    ranks: tuple[tuple[int, ...], ...]
    """Per local rank: its GPU (one), or its CPU cores."""
    kind: str
    node_rank: int = 0
    """Which of the engine's hosts this is (0: the one serving the API)."""
    nodes: int = 1
    """Hosts the engine spans."""

    def env(self) -> dict[str, str]:
        """What the engine's processes need to stay on these devices."""
        if self.kind == "gpu":
            return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for rank in self.ranks for d in rank)}
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(describe_devices(rank) for rank in self.ranks)}


@dataclass(frozen=True)
class HostPlacement:
    host: str
    devices: HostDevices
    learner: tuple[tuple[int, ...], ...]
    """Per local learner rank: its devices (empty when the host runs no learner rank)."""
    learner_shares: bool
    """The learner's ranks run on this host on the engines' devices (rollout.share_learner_devices)."""
    engines: tuple[EnginePlacement, ...]
    front_end: tuple[int, ...]
    """CPU cores left to the engines' front ends (none when every core went to an engine rank)."""

    def learner_env(self) -> dict[str, str]:
        """Binds each learner rank to its own core on a CPU host that also runs engines (nothing on GPUs, where
        rank i already computes on cuda:i, and nothing when the learner shares the engines' devices)."""
        if self.devices.kind != "cpu" or not self.learner or self.learner_shares or not self.engines:
            return {}
        return {RANK_CORES_ENV: "|".join(describe_devices(rank) for rank in self.learner)}


def place_host(host: str, devices: HostDevices, recipe: Recipe, *, node_rank: int = 0, engine_base: int = 0) -> HostPlacement:
    """The placement on rollout host `host` (one clear error when its engines cannot fit: nothing is started)."""
    rollout = recipe.rollout
    learner_devices = learner_devices_on(host, recipe)
    problems = engine_fit_problems(recipe.model, rollout, devices.section(), learner_devices=learner_devices, where=f"rollout host {host}")
    if problems:
        raise UserError(
            f"rollout host {host} ({len(devices.ids)} {devices.unit}s, {devices.memory_gib:.1f} GiB):\n"
            + "\n".join(f"  {p}" for p in problems)
        )
    ids = devices.ids
    learner_ranks = recipe.cluster.procs_per_host if host in recipe.cluster.hosts else 0
    if learner_devices:
        learner, free = tuple((d,) for d in ids[:learner_devices]), ids[learner_devices:]
    else:
        learner, free = tuple((ids[i % len(ids)],) for i in range(learner_ranks)), ids
    engines, front_end = place_engines(devices.kind, free, rollout, node_rank=node_rank, engine_base=engine_base)
    return HostPlacement(host, devices, learner, bool(learner_ranks) and not learner_devices, engines, front_end)


def place_engines(
    kind: str, free: tuple[int, ...], rollout: RolloutSection, *, node_rank: int = 0, engine_base: int = 0
) -> tuple[tuple[EnginePlacement, ...], tuple[int, ...]]:
    """A host's engines on its `free` devices (those the learner leaves), and the CPU cores left to their front ends."""
    nodes = max(rollout.parallelism.devices // len(free), 1)
    per_engine = min(rollout.parallelism.devices, len(free))
    engines_here = 1 if nodes > 1 else rollout.engines_per_host
    engine_ranks = per_engine * engines_here
    front_end: tuple[int, ...] = ()
    if kind == "gpu":
        slices = [(d,) for d in free[:engine_ranks]]
    else:
        if len(free) > engine_ranks:
            free, front_end = free[:-1], free[-1:]
        share = len(free) // engine_ranks
        slices = [tuple(free[i * share : (i + 1) * share]) for i in range(engine_ranks)]
    engines = tuple(
        EnginePlacement(engine_base + e, tuple(slices[e * per_engine : (e + 1) * per_engine]), kind, node_rank=node_rank, nodes=nodes)
        for e in range(engines_here)
    )
    return engines, front_end


def place_fleet(recipe: Recipe, found: dict[str, HostDevices]) -> list[HostPlacement | None]:
    """Every rollout host's placement, in rollout.hosts order, on the devices the recipe declares (rollout.devices),
    else on those `found` on it (None for a host whose devices are not known yet)."""
    rollout = recipe.rollout
    placements: list[HostPlacement | None] = []
    for index, host in enumerate(rollout.hosts):
        devices = planned_devices(rollout, host, found.get(host))
        if devices is None:
            placements.append(None)
            continue
        nodes = max(rollout.parallelism.devices // len(devices.ids), 1)
        node_rank, engine_base = (index % nodes, index // nodes) if nodes > 1 else (0, 0)
        placements.append(place_host(host, devices, recipe, node_rank=node_rank, engine_base=engine_base))
    return placements


def planned_devices(rollout: RolloutSection, host: str, found: HostDevices | None) -> HostDevices | None:
    """The devices a host's plan uses: those rollout.devices declares (a host found with less is refused), numbered as
    the host numbers its own when it was asked; else those `found` (None: not known before the host is asked)."""
    declared = rollout.devices
    if declared is None or found is None:
        return found if declared is None else HostDevices.declared(declared)
    if found.kind != declared.kind or len(found.ids) < declared.per_host or found.memory_gib < declared.memory_gib * 0.95:
        raise UserError(
            f"rollout host {host} has {len(found.ids)} {found.unit}(s) ({found.kind}, {found.memory_gib:.1f} GiB) but "
            f"rollout.devices says {declared.per_host} x {declared.kind} with {declared.memory_gib:g} GiB; "
            "correct rollout.devices (or remove it to use what each host has)"
        )
    return HostDevices(declared.kind, found.ids[: declared.per_host], declared.memory_gib)


def bind_this_rank() -> None:
    """Bind a learner rank to its cores when the driver planned them (RANK_CORES_ENV); call at the rank's start."""
    plan = os.environ.get(RANK_CORES_ENV)
    if plan:
        cores = plan.split("|")[int(os.environ.get("LOCAL_RANK", "0"))]
        os.sched_setaffinity(0, parse_devices(cores))


def describe_devices(ids: tuple[int, ...]) -> str:
    """`0-3`, `5` or `0,2` (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    if len(ids) > 1 and list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(str(i) for i in ids)


def parse_devices(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out
