"""Integer arguments checked, not truncated: ``int(2.7)`` is 2 and ``int(True)`` is 1, so a
count or size that arrives as a float or a bool is refused with its name and value instead."""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["is_int", "require_int"]


def is_int(value: Any) -> bool:
    """True for a Python (or numpy/torch scalar) integer, never for a bool or a float."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def require_int(value: Any, what: str, minimum: int | None = None) -> int:
    """``value`` as an int; raises ValueError naming ``what`` and the value when it is not an
    integer (or is below ``minimum``)."""
    if not is_int(value):
        raise ValueError(f"{what} must be an int, got {value!r}")
    n = operator.index(value)
    if minimum is not None and n < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {n}")
    return n
