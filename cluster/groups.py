"""Which global ranks form each parallel group, in the order Megatron-Core's parallel_state builds them.

Megatron lays ranks out as `tp-cp-ep-dp-pp` (tensor parallelism fastest): dense layers over (tp, cp, dp, pp),
experts over (etp, ep, expert-dp, pp). A group of some dimensions holds the ranks that differ only in those
dimensions; groups are numbered with the remaining dimensions, the fastest first.
"""

from __future__ import annotations

import itertools
import math

from composer.recipes.schema import ParallelismSection


def parallel_groups(p: ParallelismSection, world_size: int) -> dict[str, list[list[int]]]:
    """Every group kind of a layout: tp, cp, pp, dp (dense layers) and ep, etp, edp (experts)."""
    dp = world_size // (p.tp * p.cp * p.pp)
    edp = world_size // (p.etp * p.ep * p.pp)
    dense = [("tp", p.tp), ("cp", p.cp), ("dp", dp), ("pp", p.pp)]
    experts = [("etp", p.etp), ("ep", p.ep), ("edp", edp), ("pp", p.pp)]
    return {
        "tp": _groups(dense, {"tp"}),
        "cp": _groups(dense, {"cp"}),
        "pp": _groups(dense, {"pp"}),
        "dp": _groups(dense, {"dp"}),
        "ep": _groups(experts, {"ep"}),
        "etp": _groups(experts, {"etp"}),
        "edp": _groups(experts, {"edp"}),
    }


def _groups(dims: list[tuple[str, int]], members: set[str]) -> list[list[int]]:
    sizes = [size for _, size in dims]
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    inside = [i for i, (name, _) in enumerate(dims) if name in members]
    outside = [i for i in range(len(dims)) if i not in inside]

    def coordinates(axes: list[int]):
        # the first axis varies fastest, as Megatron numbers ranks inside a group and the groups themselves
        for combo in itertools.product(*(range(sizes[a]) for a in reversed(axes))):
            yield dict(zip(reversed(axes), combo))

    groups = []
    for fixed in coordinates(outside):
        base = sum(fixed[a] * strides[a] for a in outside)
        groups.append([base + sum(c[a] * strides[a] for a in inside) for c in coordinates(inside)])
    return groups


def describe_group(ranks: list[int]) -> str:
    """`0-7`, `0,8,..,56` or `3` for a group (short enough to print hundreds of them)."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        if step == 1:
            return f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 3:
            return f"{ranks[0]},{ranks[1]},..,{ranks[-1]}"
    return ",".join(map(str, ranks))
