"""The process groups of one rank: the device group of its collectives and a gloo group of its own
for the host-side exchanges."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["min_over_ranks", "rank_groups"]


def rank_groups(group: Any, world_size: int, timeout_s: float) -> tuple[Any, Any, Any]:
    """``(device_group, cpu_group, own_group)`` for a rank of ``world_size`` (all None at world
    size 1). ``own_group`` is a new pure gloo group over ``group``'s ranks for the host-side
    exchanges (step sync, dispatcher counts: the dispatcher insists on pure gloo, and a
    "cpu:gloo,cuda:nccl" group is not); its timeout is the step sync's, so a peer whose forward
    raised costs the others that, not the default group's (sync/peer_failure.py). The caller
    destroys ``own_group``. Collective. Raises RuntimeError without a process group of that size.
    """
    if world_size == 1:
        return None, None, None
    if not dist.is_initialized() or dist.get_world_size(group) != world_size:
        raise RuntimeError(f"RankWorker: world_size={world_size} needs an initialised process "
                           "group of that size")
    group = group if group is not None else dist.group.WORLD
    own = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                         timeout=timedelta(seconds=timeout_s))
    if str(dist.get_backend(group)) == "gloo":
        return own, own, own
    return group, own, own


def min_over_ranks(value: float | None, cpu_group: Any) -> float | None:
    """The smallest ``value`` over the ranks of ``cpu_group`` (None where a rank has none; None
    when no rank has one). Collective; the value itself without a group."""
    if cpu_group is None:
        return value
    t = torch.tensor([math.inf if value is None else value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
    return None if math.isinf(t.item()) else t.item()
