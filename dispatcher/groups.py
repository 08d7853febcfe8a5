"""The EP group a dispatcher communicates over: a data group and a CPU (gloo) control group.

- ``group`` carries the tensor collectives: NCCL for CUDA tensors, gloo for CPU tensors (a
  ``"cpu:gloo,cuda:nccl"`` group serves both).
- ``cpu_group`` is pure gloo: ``monitored_barrier`` (the first-step guard) only exists on gloo, and
  FlashInfer's ``TorchDistBackend`` exchanges its memory handles with object collectives there.

World size 1 needs no process group: ``rank = 0``, ``size = 1``, both groups ``None``, and every
collective becomes a local copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["EPGroup", "default_device"]


@dataclass(frozen=True)
class EPGroup:
    """This rank's place in the EP group and the process groups to reach its peers."""

    group: Any
    cpu_group: Any
    rank: int
    size: int

    @property
    def distributed(self) -> bool:
        """Whether there is a process group (False only for world size 1 without one)."""
        return self.group is not None

    @classmethod
    def local(cls) -> EPGroup:
        """World size 1 without a process group."""
        return cls(group=None, cpu_group=None, rank=0, size=1)

    @classmethod
    def from_torch(cls, group: Any = None, cpu_group: Any = None) -> EPGroup:
        """EP group over ``group`` (default: the world group) with a gloo ``cpu_group``.

        Takes an initialized torch.distributed group and optionally its gloo twin; returns the
        ``EPGroup``. Without an initialized process group returns ``EPGroup.local()``. When
        ``group`` is not pure gloo and no ``cpu_group`` is given, a gloo group over the same ranks
        is created with ``dist.new_group``, which is collective over the whole world: every rank
        of the job must make this call, members or not.
        """
        if not dist.is_initialized():
            if group is not None or cpu_group is not None:
                raise ValueError("process groups were passed but torch.distributed is not "
                                 "initialized")
            return cls.local()
        if group is None:
            group = dist.group.WORLD
        if cpu_group is None:
            if str(dist.get_backend(group)) == "gloo":
                cpu_group = group
            else:
                cpu_group = dist.new_group(ranks=dist.get_process_group_ranks(group),
                                           backend="gloo")
        elif str(dist.get_backend(cpu_group)) != "gloo":
            raise ValueError("cpu_group must be a gloo group, got "
                             f"backend {dist.get_backend(cpu_group)!r}")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if dist.get_world_size(cpu_group) != size or dist.get_rank(cpu_group) != rank:
            raise ValueError(
                f"cpu_group (rank {dist.get_rank(cpu_group)} of {dist.get_world_size(cpu_group)}) "
                f"does not match group (rank {rank} of {size})"
            )
        return cls(group=group, cpu_group=cpu_group, rank=rank, size=size)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by EP rank, over the CPU group (``[obj]`` at world size
        1)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


def default_device() -> torch.device:
    """CUDA's current device when CUDA is available (``dist_group`` and launchers set it per
    rank), else the CPU."""
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))
