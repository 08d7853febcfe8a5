"""Row collectives over an ``EPGroup``, with the world-size-1 (no process group) case built in.

Legend: ``R`` ranks, ``P`` rows per rank, ``X`` row width (any trailing size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dispatcher.groups import EPGroup

__all__ = ["all_gather_rows", "all_to_all_rows", "exchange_counts", "reduce_scatter_rows"]


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def all_gather_rows(out_RPX: torch.Tensor, src_PX: torch.Tensor, ep: EPGroup) -> None:
    """Write every rank's ``src_PX`` into block ``r`` of ``out_RPX`` (``R*P`` rows, rank-major).

    CUDA: one ``all_gather_single`` (fixed shape: CUDA-graph capturable). CPU: ``dist.all_gather``
    into views of ``out_RPX`` (every backend and torch version has it; no extra copy).
    """
    if not ep.distributed:
        out_RPX.copy_(src_PX)
        return
    if src_PX.is_cuda:
        _all_gather_single(out_RPX, src_PX.contiguous(), ep.group)
    else:
        dist.all_gather(list(out_RPX.view(ep.size, *src_PX.shape).unbind(0)), src_PX.contiguous(), group=ep.group)


def reduce_scatter_rows(out_PX: torch.Tensor, src_RPX: torch.Tensor, ep: EPGroup) -> None:
    """``out_PX`` = sum over ranks of block ``ep.rank`` of each rank's ``src_RPX`` (CUDA only:
    the CPU path of the all-gather dispatcher uses ``all_to_all_rows`` and sums locally)."""
    if not ep.distributed:
        out_PX.copy_(src_RPX)
        return
    _reduce_scatter_single(out_PX, src_RPX.contiguous(), ep.group)


def all_to_all_rows(out_NX: torch.Tensor, src_SX: torch.Tensor, out_splits: Sequence[int],
                    in_splits: Sequence[int], ep: EPGroup) -> None:
    """Variable-split all-to-all of rows: ``in_splits[r]`` rows of ``src_SX`` go to rank ``r``,
    ``out_splits[r]`` rows arrive from rank ``r`` (both rank-major)."""
    if not ep.distributed:
        out_NX.copy_(src_SX)
        return
    dist.all_to_all_single(out_NX, src_SX.contiguous(), list(out_splits), list(in_splits), group=ep.group)


def exchange_counts(send_counts_R: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """Each rank's row count for this rank: one small all-to-all of an int64 ``[R]`` tensor."""
    if not ep.distributed:
        return send_counts_R.clone()
    recv_counts_R = torch.empty_like(send_counts_R)
    dist.all_to_all_single(recv_counts_R, send_counts_R.contiguous(), group=ep.group)
    return recv_counts_R
