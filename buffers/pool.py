"""A pool of named input buffers shared by every runner of one rank.

Several runners of a rank (decode graphs, prefill graphs, the eager path) need the same named
inputs: ``input_ids``, ``positions``, ``seq_lens``... Each runner *declares* what it needs
(name, shape, dtype, device). ``materialize()`` then allocates one storage per name, sized for
the largest number of elements any user declared, and each user gets a view of its own shape
on that storage. Because the size is a max over declarations, the result does not depend on
the order in which runners were built.

Ownership: the pool owns storage; registries and runners hold views. Storage never moves after
it is allocated, because a captured CUDA graph keeps raw pointers into it: a later request that
does not fit is an error, never a silent reallocation.

Sharing hazard (read before changing): two runners writing the same storage is only safe
because the forwards of one rank are serialized on one stream. A runner fills its inputs and
runs to completion (or enqueues its graph) before another runner fills the same storage. Do
not share one pool between ranks or between concurrently running streams.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BufferNeed", "BufferPool", "PoolEntry", "checked_shape"]


@dataclass(frozen=True)
class BufferNeed:
    """One user's declaration: ``user`` wants ``name`` with this shape, dtype and device."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    user: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return (f"{self.user!r} declared {self.name!r} as {tuple(self.shape)} {self.dtype} "
                f"on {self.device}")


@dataclass(frozen=True)
class PoolEntry:
    """One line of the pool report: a name, its storage and who declared it."""

    name: str
    numel: int
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    materialized: bool
    users: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def checked_shape(shape: Any, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of ints >= 0; raises ValueError starting with ``what`` and naming
    the shape when a dimension is not an integer (2.7 is refused, not read as 2) or is
    negative."""
    dims = tuple(shape)
    for d in dims:
        if isinstance(d, bool) or not _is_index(d):
            raise ValueError(f"{what} {dims}: dimension {d!r} is not an int")
    out = tuple(operator.index(d) for d in dims)
    if any(d < 0 for d in out):
        raise ValueError(f"{what} {out}: a dimension is negative")
    return out


def _is_index(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _canonical_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class BufferPool:
    """Named, shared input storage for one rank (see the module docstring for ownership).

    Usage::

        pool.declare("input_ids", (256,), torch.int64, "cuda", user="decode")
        pool.declare("input_ids", (8192,), torch.int64, "cuda", user="prefill")
        pool.materialize()
        ids = pool.view("input_ids", (256,))      # a view on the 8192-element storage
    """

    def __init__(self) -> None:
        self._needs: dict[str, list[BufferNeed]] = {}
        self._storage: dict[str, torch.Tensor] = {}

    # -- declaration ---------------------------------------------------------------------------
    def declare(
        self,
        name: str,
        shape: tuple[int, ...] | list[int] | torch.Size,
        dtype: torch.dtype,
        device: torch.device | str,
        user: str,
    ) -> BufferNeed:
        """Record that ``user`` needs ``name`` with ``shape``; return the declaration.

        Raises ValueError when ``name`` was declared with another dtype or device (naming both
        declarations), or when it is already materialized and the new shape does not fit.
        """
        shape = checked_shape(shape, f"{user!r} declared {name!r} with shape")
        need = BufferNeed(name, shape, dtype, _canonical_device(device), user)
        previous = self._needs.get(name, [])
        if previous:
            first = previous[0]
            if (first.dtype, first.device) != (need.dtype, need.device):
                raise ValueError(
                    f"pool buffer {name!r} declared twice with different dtype/device: "
                    f"{first.describe()}; {need.describe()}"
                )
        if name in self._storage and need.numel > self._storage[name].numel():
            self._refuse_growth(need)
        self._needs.setdefault(name, []).append(need)
        return need

    def declare_all(self, needs: list[tuple[str, tuple[int, ...], torch.dtype, torch.device | str]],
                    user: str) -> None:
        """Declare several buffers at once: either all are recorded or, on error, none is."""
        with self.atomic():
            for name, shape, dtype, device in needs:
                self.declare(name, shape, dtype, device, user)

    @contextlib.contextmanager
    def atomic(self) -> Iterator[BufferPool]:
        """Declarations and storage made inside the block are undone when it raises, so a
        refused declaration (or a failed allocation) leaves the pool as it was."""
        needs = {name: list(v) for name, v in self._needs.items()}
        had = set(self._storage)
        try:
            yield self
        except BaseException:
            self._needs = needs
            for name in set(self._storage) - had:
                del self._storage[name]
            raise

    def _refuse_growth(self, need: BufferNeed) -> None:
        have = self._storage[need.name].numel()
        raise ValueError(
            f"pool buffer {need.name!r} is materialized with {have} elements; {need.describe()} "
            f"needs {need.numel}. Storage is never reallocated (captured graphs point into it): "
            f"declare the largest size before materialize()."
        )

    # -- allocation ----------------------------------------------------------------------------
    def materialize(self) -> None:
        """Allocate storage for every declared name that has none yet (largest declared size).

        Allocation runs with inference mode off, so the storage can be written in place both
        inside and outside ``torch.inference_mode()``.
        """
        with torch.inference_mode(False):
            for name, needs in self._needs.items():
                if name in self._storage:
                    continue
                first = needs[0]
                numel = max(n.numel for n in needs)
                self._storage[name] = torch.zeros(numel, dtype=first.dtype, device=first.device)

    def is_materialized(self, name: str) -> bool:
        return name in self._storage

    def view(self, name: str, shape: tuple[int, ...] | list[int] | torch.Size) -> torch.Tensor:
        """A view of ``name``'s storage with ``shape`` (row-major, from the start of the storage).

        Raises KeyError for an unknown or unmaterialized name, ValueError when ``shape`` needs
        more elements than the storage holds.
        """
        if name not in self._storage:
            state = "declared but not materialized" if name in self._needs else "never declared"
            raise KeyError(f"pool buffer {name!r} is {state}")
        storage = self._storage[name]
        shape = checked_shape(shape, f"a view of pool buffer {name!r} with shape")
        numel = math.prod(shape)
        if numel > storage.numel():
            raise ValueError(
                f"pool buffer {name!r} holds {storage.numel()} elements; a view of shape {shape} "
                f"needs {numel}. Declare the larger size before materialize()."
            )
        with torch.inference_mode(False):
            return storage[:numel].view(shape)

    def request(
        self,
        name: str,
        shape: tuple[int, ...] | list[int] | torch.Size,
        dtype: torch.dtype,
        device: torch.device | str,
        user: str,
    ) -> torch.Tensor:
        """Declare, materialize what is new, and return the view: for users built one by one.

        A user built after a larger one shares its storage; a user built after a *smaller* one
        that is already materialized raises (see ``declare``). Runners that know all their needs
        up front should ``declare`` everything, ``materialize()`` once, then take views.
        """
        with self.atomic():  # a refused request leaves nothing declared
            need = self.declare(name, shape, dtype, device, user)
            if name not in self._storage:
                self.materialize()
            return self.view(name, need.shape)

    # -- reporting -----------------------------------------------------------------------------
    def report(self) -> list[PoolEntry]:
        """Names, sizes, dtypes, bytes and declaring users, sorted by name."""
        out = []
        for name in sorted(self._needs):
            needs = self._needs[name]
            first = needs[0]
            numel = (self._storage[name].numel() if name in self._storage
                     else max(n.numel for n in needs))
            out.append(
                PoolEntry(
                    name=name,
                    numel=numel,
                    dtype=first.dtype,
                    device=first.device,
                    nbytes=numel * first.dtype.itemsize,
                    materialized=name in self._storage,
                    users=tuple(n.user for n in needs),
                    shapes=tuple(n.shape for n in needs),
                )
            )
        return out

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.report())

    def format_report(self) -> str:
        lines = [f"{'name':<36} {'dtype':<14} {'device':<8} {'bytes':>12}  users"]
        for e in self.report():
            lines.append(
                f"{e.name:<36} {str(e.dtype).removeprefix('torch.'):<14} {e.device!s:<8} "
                f"{e.nbytes:>12}  {', '.join(e.users)}"
            )
        lines.append(f"{'total':<60} {self.total_bytes():>12}")
        return "\n".join(lines)

    def clear(self) -> None:
        """Drop every declaration and storage. Call only after graphs that point into it are
        gone."""
        self._needs.clear()
        self._storage.clear()
