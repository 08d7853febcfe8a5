"""What a registry fill of one size needs, built once per size and cached (bounded): the grouped
copies and pads, where each slot's pairs sit, the packed computed slots. ``registry.py`` builds
and runs these plans."""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from buffers.slot import FillSizes, Slot

__all__ = ["PER_SIZE_CACHE", "BoundedCache", "CopyGroup", "FillPlan", "LiveSlot", "PackedSlots", "count_arg"]

# Entries each per-size cache keeps (least recently used go first).
PER_SIZE_CACHE = 256

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(OrderedDict, Generic[K, V]):
    """A dict that keeps its ``capacity`` most recently used entries."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


def count_arg(value: Any, what: str) -> int:
    """``value`` as an int >= 0, or ValueError naming ``what`` and the value (2.7 is refused,
    not truncated to 2)."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    return n


@dataclass
class CopyGroup:
    """Copies and pads that one ``torch._foreach_copy_`` call can carry.

    On CUDA that call is one launch only when every pair shares device and dtype and is dense
    with matching strides; pairs that are not (the ``[:, :raw]`` slice of a ``(3, T)`` slot)
    travel in a group of their own so they do not push the whole group onto the slow path.
    """

    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor | None]  # None: a live source, read from the batch at fill time


@dataclass(frozen=True)
class LiveSlot:
    """Where a plain slot's live copies and pads sit among the plan's groups.

    A slot whose axis is dim 1 of a 2-D buffer (``(3, T)`` mrope positions) is copied row by
    row: each row slice is dense, so it joins the one-launch group instead of a strided one.
    """

    slot: Slot
    shape: torch.Size  # what the batch tensor must look like for this fill
    dtype: torch.dtype
    lives: tuple[tuple[int, int], ...]  # (group, index) of each live pair (one per row if split)
    pads: tuple[tuple[int, int], ...]  # (group, index) of each pad pair
    split_rows: bool


@dataclass
class PackedSlots:
    """Computed CUDA slots of one dtype laid out in one storage: their host values (cached,
    immutable tensors the hooks return) are concatenated once per distinct set of values and
    go over in one transfer."""

    block: torch.Tensor
    members: list[tuple[Slot, torch.Tensor]]
    cache: dict[tuple[int, ...], tuple[torch.Tensor, list[torch.Tensor]]]


@dataclass
class FillPlan:
    """Everything a fill of one size needs, built once per size."""

    sizes: FillSizes
    groups: list[CopyGroup]
    live: list[LiveSlot]
    fill_once: list[tuple[Slot, torch.Tensor]]  # slots whose buffer still awaits its one fill
    computed: list[tuple[Slot, torch.Tensor]]  # unpacked computed slots: (slot, whole buffer)
    plain: frozenset[str]  # names of the plain (copied) slots


