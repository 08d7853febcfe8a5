"""Thin wrappers over torch.distributed for the DP collectives: version compatibility and the
no-process-group case in one place.

``world_of(group)`` is 1 when torch.distributed is not initialized: a single rank then runs with
no process group and every collective here degenerates to the identity (the same answer).

Newer torch deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single`` (same arguments); older torch (>= 2.4, the
floor in pyproject) has only the former. We call whichever exists, preferring the new names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_into",
    "all_gather_v",
    "all_reduce_sum",
    "all_to_all_v",
    "rank_of",
    "reduce_scatter_into",
    "reduce_scatter_v",
    "world_of",
]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_of(group: Any = None) -> int:
    """The size of ``group`` (default: the world); 1 with no process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def rank_of(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); 0 with no process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_gather_into(
    out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """``out`` = concatenation over ranks of ``inp`` (rank order). Returns the work if async."""
    return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """``out`` = this rank's chunk of the sum over ranks of ``inp``."""
    _reduce_scatter(out, inp, group=group)


def all_reduce_sum(t: torch.Tensor, group: Any = None) -> None:
    """In place: ``t`` = sum over ranks of ``t``."""
    dist.all_reduce(t, group=group)


def all_gather_v(chunks: list[torch.Tensor], inp: torch.Tensor, group: Any = None) -> None:
    """``chunks[r]`` = rank ``r``'s ``inp`` (chunks may differ in rows; views of one buffer).

    With NCCL, torch runs an uneven ``all_gather`` as one group of broadcasts (one per source
    rank, coalesced): each rank receives exactly the live rows of the others, written straight
    into the views, no staging and no padding.
    """
    dist.all_gather(chunks, inp, group=group)


def reduce_scatter_v(out: torch.Tensor, chunks: list[torch.Tensor], group: Any = None) -> None:
    """``out`` = sum over ranks of their ``chunks[rank]`` (chunks may differ in rows).

    With NCCL, torch runs an uneven reduce-scatter as one group of reduces (one per destination
    rank, coalesced): each rank sends every peer only that peer's live rows.
    """
    dist.reduce_scatter(out, chunks, group=group)


def all_to_all_v(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: Any = None,
) -> None:
    """Variable-split all-to-all of rows: ``in_splits[r]`` rows of ``inp`` go to rank ``r``,
    ``out_splits[r]`` rows of ``out`` come from rank ``r`` (both rank-major). Gloo's uneven
    all-gather and reduce-scatter are built on it: it moves exactly the rows named."""
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
