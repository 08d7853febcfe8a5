"""Slots: declarative descriptions of graph-resident input buffers.

A slot says what a buffer is (name, shape as a function of ``(max_bs, max_num_tokens)``, dtype,
device), which of its dimensions follows the batch (``axis`` ``bs`` or ``tokens``, at ``dim``;
``none`` for fixed-size buffers), what its padded tail holds (``padding``), and where its value
comes from: the batch field of the same name (default), a dotted path or a function of the batch
(``source``), or a post-fill hook (``compute``: a computed slot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

__all__ = [
    "KEEP",
    "ZERO",
    "Axis",
    "FillSizes",
    "Padding",
    "Slot",
    "fill",
    "fill_once",
]


class Axis(str, Enum):
    """Which batch size a slot's ``dim`` follows."""

    BS = "bs"
    TOKENS = "tokens"
    NONE = "none"


@dataclass(frozen=True)
class Padding:
    """What the padded tail ``[raw:padded)`` of a slot holds after ``fill``.

    - ``keep``: untouched (whatever an earlier step left there).
    - ``zero``: zeros, written on every fill that has a tail.
    - ``fill``: ``value``, written on every fill that has a tail.
    - ``fill_once``: ``value`` written over the whole buffer on the first fill that has a tail,
      then kept: for slots whose padded rows only need *some* valid value (a stale live value is
      as good as the fill value) and whose per-step reset is not worth a launch.
    """

    kind: str
    value: int | float | bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("keep", "zero", "fill", "fill_once"):
            raise ValueError(f"unknown padding kind {self.kind!r}; expected keep, zero, fill or "
                             "fill_once")


KEEP = Padding("keep")
ZERO = Padding("zero")


def fill(value: int | float | bool | None) -> Padding:
    """Pad the tail with ``value`` on every fill (``None`` raises when a tail must be filled)."""
    return Padding("fill", value)


def fill_once(value: int | float | bool | None) -> Padding:
    """Write ``value`` over the buffer once, on the first fill with a tail; keep it after."""
    return Padding("fill_once", value)


@dataclass(frozen=True)
class FillSizes:
    """The live and padded sizes of one fill, on both axes."""

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int

    def raw(self, axis: Axis) -> int:
        return self.raw_bs if axis is Axis.BS else self.raw_num_tokens

    def padded(self, axis: Axis) -> int:
        return self.padded_bs if axis is Axis.BS else self.padded_num_tokens


ShapeFn = Callable[[int, int], tuple[int, ...]]
SourceFn = Callable[[Any], "torch.Tensor | None"]
# A post-fill hook: (the slot's whole buffer, the batch, the sizes of this fill) -> a tensor to
# copy into the buffer, or None when the hook wrote the buffer itself. It runs after every plain
# slot was copied, so it may read their live rows. A returned tensor must not be written again
# (the copy is asynchronous): return cached constants, not a reused staging buffer.
ComputeFn = Callable[[torch.Tensor, Any, FillSizes], "torch.Tensor | None"]


@dataclass(frozen=True)
class Slot:
    """One graph input buffer, described as data (see the module docstring)."""

    name: str
    shape: ShapeFn
    dtype: torch.dtype
    axis: Axis | str = Axis.BS
    padding: Padding = ZERO
    source: str | SourceFn | None = None
    compute: ComputeFn | None = None
    device: torch.device | str | None = None
    dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "_path", tuple((self.source or self.name).split("."))
                           if not callable(self.source) else None)
        if not self.name:
            raise ValueError("a slot needs a name")
        try:
            object.__setattr__(self, "axis", Axis(self.axis))
        except ValueError:
            raise ValueError(
                f"slot {self.name!r}: axis {self.axis!r} is not one of 'bs', 'tokens', 'none'"
            ) from None
        if self.source is not None and self.compute is not None:
            raise ValueError(f"slot {self.name!r}: give a source or a compute hook, not both")
        if not isinstance(self.padding, Padding):
            raise TypeError(f"slot {self.name!r}: padding must be a Padding, got {self.padding!r}")

    @property
    def computed(self) -> bool:
        return self.compute is not None

    @property
    def top_level(self) -> bool:
        """Whether the slot is a top-level field of the batch (dotted names are nested)."""
        return "." not in self.name

    def read(self, batch: Any) -> torch.Tensor | None:
        """The live value of a plain slot from ``batch`` (None when the batch has none)."""
        path = self._path
        if path is None:
            return self.source(batch)
        if len(path) == 1:
            return getattr(batch, path[0], None)
        obj = batch
        for part in path:
            obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
            if obj is None:
                return None
        return obj
