"""What a registry fill of one size needs, built once per size and cached (bounded): the grouped
copies and pads, where each slot's pairs sit, the packed computed slots. ``registry.py`` builds
and runs these plans."""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from buffers.slot import Axis, FillSizes, Slot

__all__ = ["PER_SIZE_CACHE", "BoundedCache", "CopyGroup", "FillPlan", "LiveSlot", "PackedSlots",
           "checked_fill_sizes", "count_arg"]

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




def checked_fill_sizes(user: str, raw_bs: int, padded_bs: int, raw_num_tokens: int | None,
                       padded_num_tokens: int | None, capacities: list[tuple[Slot,
                                                                             int]]) -> FillSizes:
    """The sizes of one ``fill`` of registry ``user``: the token counts default to the request
    counts (one token per request), or the padded tokens to the raw ones. ValueError unless
    ``0 <= raw <= padded`` on each axis and every slot of that axis (``capacities``: each slot
    and its rows) holds the padded size."""
    where = f"registry {user!r}: fill"
    raw_bs, padded_bs = (count_arg(raw_bs, f"{where} raw_bs"),
                         count_arg(padded_bs, f"{where} padded_bs"))
    if raw_num_tokens is not None:
        raw_num_tokens = count_arg(raw_num_tokens, f"{where} raw_num_tokens")
    if padded_num_tokens is not None:
        padded_num_tokens = count_arg(padded_num_tokens, f"{where} padded_num_tokens")
    raw_t = raw_bs if raw_num_tokens is None else raw_num_tokens
    pad_t = ((padded_bs if raw_num_tokens is None else raw_t) if padded_num_tokens is None
             else padded_num_tokens)
    sizes = FillSizes(raw_bs, padded_bs, raw_t, pad_t)
    for axis, raw, padded in (
        (Axis.BS, sizes.raw_bs, sizes.padded_bs),
        (Axis.TOKENS, sizes.raw_num_tokens, sizes.padded_num_tokens),
    ):
        if raw < 0 or raw > padded:
            raise ValueError(f"registry {user!r}: need 0 <= raw <= padded on axis {axis.value}, "
                             f"got raw={raw}, padded={padded}")
        for slot, capacity in capacities:
            if slot.axis is axis and padded > capacity:
                raise ValueError(
                    f"registry {user!r}: slot {slot.name!r} holds {capacity} rows on axis "
                    f"{axis.value} (limit); padded size {padded} (raw {raw}) exceeds it"
                )
    return sizes
