"""Hands out request rows and KV slots of a KVCache (row 0 and slot 0 stay reserved)."""

from __future__ import annotations

import numpy as np
import torch

from dp_runtime.serving.kv_cache import KVCache

__all__ = ["KVAllocator"]


class KVAllocator:
    """Free lists of request rows ``1..max_reqs`` and token slots ``1..num_slots`` (host side),
    and a host copy of every row's slots (``record`` / ``slots_of``): freeing a finished request
    reads it there, not from the device table, so it never waits for a step in flight.

    The free slots are a FIFO queue in a ring of ``num_slots`` entries: an allocation takes the
    oldest free slots, a free appends. Both cost the slots they move, never the whole list (a
    concatenation of the list on every finished request cost milliseconds at 160k slots)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._free_rows = list(range(cache.max_reqs, 0, -1))
        self._ring = np.arange(1, cache.num_slots + 1, dtype=np.int64)
        self._head = 0  # index in the ring of the oldest free slot
        self._free = cache.num_slots  # free slots, from _head on (wrapping)
        self._row_slots = torch.zeros(tuple(cache.req_to_token.shape), dtype=torch.int32)

    @property
    def num_free_slots(self) -> int:
        return self._free

    def alloc_row(self) -> int:
        """A free request row. Raises ValueError when all ``max_reqs`` rows are taken."""
        if not self._free_rows:
            raise ValueError(
                f"KVAllocator: all {self.cache.max_reqs} request rows (max_reqs) are in use"
            )
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(int(row))

    def alloc_slots(self, n: int, *, on_host: bool = False) -> torch.Tensor:
        """``n`` free slots as an int64 tensor on the cache's device (on the host with
        ``on_host``). Raises ValueError when fewer than ``n`` are free (naming both)."""
        if n > self._free:
            raise ValueError(f"KVAllocator: asked for {n} KV slots, {self._free} "
                             f"of {self.cache.num_slots} are free")
        slots = torch.from_numpy(self._ring.take(np.arange(self._head, self._head + n),
                                                 mode="wrap"))
        self._head = (self._head + n) % self._ring.size
        self._free -= n
        return slots if on_host else slots.to(self.cache.device)

    def free_slots(self, slots: torch.Tensor) -> None:
        n = int(slots.numel())
        if self._free + n > self._ring.size:
            raise ValueError(f"KVAllocator: freeing {n} slots with {self._free} "
                             f"of {self._ring.size} already free")
        tail = (self._head + self._free) % self._ring.size
        np.put(self._ring, np.arange(tail, tail + n), slots.to("cpu", torch.int64).numpy(),
               mode="wrap")
        self._free += n

    def record(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Note on the host that token ``positions[i]`` of row ``rows[i]`` lives in ``slots[i]``
        (host tensors; the device's ``req_to_token`` is written by the batch builder)."""
        self._row_slots[rows, positions] = slots.to(torch.int32)

    def slots_of(self, row: int, n: int) -> torch.Tensor:
        """The slots of the first ``n`` tokens of ``row`` (a host int32 view)."""
        return self._row_slots[row, :n]
