"""Which batch sizes get a CUDA graph: the capture-size policy (pure, no torch).

The default list is dense where decode batches usually are and sparser above:

    1, 2, 4, 8,            powers of two for the smallest batches (one graph each is cheap)
    16, 24, ..., 256       steps of 8: a live batch pads at most 7 rows up to 256
    272, 288, ...          steps of 16 above 256, up to ``max_bs``

Every size is a multiple of ``alignment`` (the attention-TP size: each attention-TP rank must see
the same number of rows), none exceeds ``max_bs``, and the cap itself is always captured, so
every batch of at most ``max_bs`` rows has a bucket. The cap is ``max_bs`` rounded down to a
multiple of ``alignment``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["bucket_for", "capture_sizes", "default_capture_sizes"]


def default_capture_sizes(max_bs: int) -> list[int]:
    """The default candidates up to ``max_bs`` (before alignment): see the module docstring."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += range(16, min(max_bs, 256) + 1, 8)
    sizes += range(272, max_bs + 1, 16)
    return sizes


def capture_sizes(
    max_bs: int, *, configured: Sequence[int] | None = None, alignment: int = 1
) -> tuple[int, ...]:
    """The batch sizes to capture: sorted, unique, aligned, capped at ``max_bs``, cap included.

    Args:
        max_bs: the largest batch a graph must serve (e.g. max running requests per rank).
        configured: an explicit list from the config, or None for ``default_capture_sizes``.
            Values above the cap are dropped; a configured value that is not a multiple of
            ``alignment`` is an error (the default list is filtered silently instead).
        alignment: every size must be a multiple of it (attention-TP size).

    Returns the sizes as a tuple. Raises ValueError for a non-positive ``max_bs`` or
    ``alignment``, a cap below the alignment, an empty or non-positive configured list, or a
    misaligned configured value, naming the value and the limit.
    """
    if alignment < 1:
        raise ValueError(f"capture sizes: alignment must be >= 1, got {alignment}")
    if max_bs < 1:
        raise ValueError(f"capture sizes: max_bs must be >= 1, got {max_bs}")
    cap = max_bs - max_bs % alignment
    if cap == 0:
        raise ValueError(f"capture sizes: max_bs={max_bs} is below the alignment {alignment}")
    if configured is None:
        candidates = [s for s in default_capture_sizes(cap) if s % alignment == 0]
    else:
        configured = [int(s) for s in configured]
        if not configured:
            raise ValueError("capture sizes: the configured list is empty; give sizes or None for "
                             "the default")
        bad = sorted({s for s in configured if s < 1})
        if bad:
            raise ValueError(f"capture sizes: sizes must be >= 1, got {bad}")
        misaligned = sorted({s for s in configured if s % alignment})
        if misaligned:
            raise ValueError(
                f"capture sizes: {misaligned} are not multiples of the alignment {alignment} "
                "(attention-TP size)"
            )
        candidates = configured
    return tuple(sorted({s for s in candidates if s <= cap} | {cap}))


def bucket_for(sizes: Sequence[int], n: int) -> int:
    """The smallest of the sorted ``sizes`` that is >= ``n``.

    Raises ValueError when ``n`` is negative or above the largest size (naming both).
    """
    if n < 0:
        raise ValueError(f"bucket_for: size must be >= 0, got {n}")
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"bucket_for: size {n} exceeds the largest captured "
                         f"bucket {sizes[-1] if sizes else None}")
    return sizes[i]
