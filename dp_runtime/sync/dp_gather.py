"""dp_gather (local -> global) and dp_scatter (global -> local) for both padding modes.

Shapes (legend): ``T`` = rows this rank brings, ``G`` = rows of the gathered buffer, ``P`` =
per-rank rows under MAX_LEN (``G = P * R``), ``D`` = hidden size, ``R`` = dp_size.

MAX_LEN (``dp_gather``): the rank writes its rows into its own slot ``[r*P, (r+1)*P)`` of the
global buffer (zeroing the slot's tail) and runs an in-place ``all_gather_into_tensor`` with
that slot as input. In place because NCCL supports it natively (input == output + r * chunk):
no staging buffer, no extra copy.

SUM_LEN (``dp_gather``) on CUDA: an uneven all-gather straight into the rows of the global
buffer (``all_gather_v``: NCCL broadcasts from every rank, coalesced into one group), so each
rank receives exactly the others' live rows: no padding, no staging, no compaction. It
replaced zero + ``all_reduce(SUM)``, which reached only about 55% of a raw all-gather of the
same bytes on H200s (docs/BENCHMARKS.md). On CPU (gloo) the rank writes its rows at its offset,
zeroes every other row and runs ``all_reduce(SUM)``: each row has one non-zero contributor, so
the sum is exact (``x + 0 == x`` in every dtype).

Graph-safe SUM_LEN (``dp_gather_by_counts`` / ``dp_scatter_by_counts``): inside a CUDA graph the
counts change between replays while the shapes do not, so the offsets must come from a device
tensor of counts, not from the host. The global buffer has a fixed capacity ``G``; its row ``j``
is ``local[j - offset]`` where ``0 <= j - offset < count`` and zero elsewhere, written by one
``index_select`` into the buffer plus one ``masked_fill`` (no atomics, deterministic, no host
sync), then the same ``all_reduce``. The caller guarantees ``sum(counts) <= G`` and
``count[rank] <= T`` (the graph runner checks the plan against the bucket on the host).

``dp_scatter`` takes this rank's rows back (a slice, or a copy into ``out_TD``);
``dp_reduce_scatter`` sums over ranks first (the MoE combine): MAX_LEN on CUDA uses
``reduce_scatter_tensor``; otherwise an all-reduce and a slice.

With world size 1 (no process group) the collectives are skipped: same answer.
Every function is a collective over ``group`` except the scatters; ranks with zero rows join.
"""

from __future__ import annotations

from typing import Any

import torch

from dp_runtime.sync.collectives import (
    all_gather_into,
    all_gather_v,
    all_reduce_sum,
    reduce_scatter_into,
    world_of,
)
from dp_runtime.sync.padding_mode import PaddingMode

__all__ = [
    "dp_gather",
    "dp_gather_by_counts",
    "dp_reduce_scatter",
    "dp_scatter",
    "dp_scatter_by_counts",
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _own_rows(layout: Any) -> tuple[int, int]:
    """(first row, row count) of this rank's slot: MAX_LEN slots are the padded length."""
    if layout.padding is PaddingMode.MAX_LEN:
        return layout.offsets[layout.rank], layout.local_dp_buffer_len
    return layout.offsets[layout.rank], layout.global_num_tokens[layout.rank]


def dp_gather(
    global_GD: torch.Tensor, local_TD: torch.Tensor, layout: Any, group: Any = None
) -> torch.Tensor:
    """Gather every rank's rows into ``global_GD``; returns ``global_GD``.

    Takes the [G, D] global buffer (G = layout.global_dp_buffer_len), this rank's [T, D] rows
    (live rows first; ``T`` <= the rank's slot; the slot's remaining rows are sent as zeros; it
    may already be the slot itself, then nothing is copied), the step's DPBufferLayout (read by
    attribute: padding, rank, offsets, global_num_tokens, local_dp_buffer_len,
    global_dp_buffer_len) and the device group. Raises ValueError when shapes disagree.
    """
    g = layout.global_dp_buffer_len
    if global_GD.shape[0] != g:
        raise ValueError(
            f"dp_gather: global buffer has {global_GD.shape[0]} rows, global_dp_buffer_len is {g}"
        )
    start, rows = _own_rows(layout)
    t = local_TD.shape[0]
    if t > rows:
        raise ValueError(
            f"dp_gather: rank {layout.rank} brings {t} rows, its slot holds {rows} "
            f"({layout.padding.name}, counts {list(layout.global_num_tokens)})"
        )
    slot_PD = global_GD[start : start + rows]
    if not _same(local_TD, slot_PD[:t]):
        slot_PD[:t].copy_(local_TD)
    if t < rows:
        slot_PD[t:].zero_()
    if world_of(group) == 1 or g == 0:
        return global_GD
    if layout.padding is PaddingMode.MAX_LEN:
        all_gather_into(global_GD, slot_PD, group=group)
    elif global_GD.is_cuda:
        chunks = list(global_GD.split(list(layout.global_num_tokens)))
        all_gather_v(chunks, slot_PD, group=group)
    else:
        global_GD[:start].zero_()
        global_GD[start + rows :].zero_()
        all_reduce_sum(global_GD, group=group)
    return global_GD


def dp_scatter(
    global_GD: torch.Tensor, layout: Any, out_TD: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's live rows of ``global_GD`` ([n, D], n = layout.global_num_tokens[rank]).

    Without ``out_TD`` it is a view of ``global_GD`` (valid until the buffer is written again);
    with ``out_TD`` (at least n rows) the rows are copied into it and ``out_TD[:n]`` returned.
    Not a collective.
    """
    start = layout.offsets[layout.rank]
    n = layout.global_num_tokens[layout.rank]
    rows_ND = global_GD[start : start + n]
    if out_TD is None:
        return rows_ND
    out_ND = out_TD[:n]
    out_ND.copy_(rows_ND)
    return out_ND


def dp_reduce_scatter(
    global_GD: torch.Tensor, layout: Any, group: Any = None, out_TD: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum ``global_GD`` over ranks and return this rank's live rows ([n, D]).

    MAX_LEN on CUDA with ``out_TD`` (>= P rows): one ``reduce_scatter_tensor`` into ``out_TD``.
    Otherwise ``global_GD`` is all-reduced in place and sliced (copied into ``out_TD`` if given).
    A collective over ``group``.
    """
    n = layout.global_num_tokens[layout.rank]
    if world_of(group) == 1 or layout.global_dp_buffer_len == 0:
        return dp_scatter(global_GD, layout, out_TD)
    if layout.padding is PaddingMode.MAX_LEN and out_TD is not None and global_GD.is_cuda:
        p = layout.local_dp_buffer_len
        reduce_scatter_into(out_TD[:p], global_GD, group=group)
        return out_TD[:n]
    all_reduce_sum(global_GD, group=group)
    return dp_scatter(global_GD, layout, out_TD)


def _offset_and_count(counts_R: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = counts_R.to(torch.int64)
    ends = torch.cumsum(counts, 0)
    return ends[rank] - counts[rank], counts[rank]


def dp_gather_by_counts(
    global_GD: torch.Tensor,
    local_TD: torch.Tensor,
    counts_R: torch.Tensor,
    rank: int,
    group: Any = None,
) -> torch.Tensor:
    """SUM_LEN gather with offsets computed on the device (capturable in a CUDA graph).

    Takes the fixed-capacity [G, D] global buffer, this rank's [T, D] rows, the per-rank live
    counts as a device int tensor [R] (read at run time, so a replay sees new counts), this
    rank's index and the group. Rows ``[offset_r, offset_r + count_r)`` hold rank r's rows;
    rows past ``sum(counts)`` are zero. Returns ``global_GD``. No host synchronization.
    """
    g, t = global_GD.shape[0], local_TD.shape[0]
    if t == 0 or g == 0:
        global_GD.zero_()
    else:
        offset, count = _offset_and_count(counts_R, rank)
        src_G = torch.arange(g, device=global_GD.device) - offset
        keep_G = (src_G >= 0) & (src_G < count)
        torch.index_select(local_TD, 0, src_G.clamp_(0, t - 1), out=global_GD)
        global_GD.masked_fill_(~keep_G.unsqueeze(1), 0)
    if world_of(group) > 1 and g > 0:
        all_reduce_sum(global_GD, group=group)
    return global_GD


def dp_scatter_by_counts(
    global_GD: torch.Tensor, counts_R: torch.Tensor, rank: int, out_TD: torch.Tensor
) -> torch.Tensor:
    """This rank's rows of a SUM_LEN buffer into ``out_TD`` ([T, D]), offsets from the device.

    Row ``j < count[rank]`` of ``out_TD`` gets ``global_GD[offset + j]``; rows past the count
    are zeroed. Returns ``out_TD``. Capturable in a CUDA graph (no host synchronization).
    """
    g, t = global_GD.shape[0], out_TD.shape[0]
    if t == 0:
        return out_TD
    if g == 0:
        return out_TD.zero_()
    offset, count = _offset_and_count(counts_R, rank)
    j_T = torch.arange(t, device=out_TD.device)
    torch.index_select(global_GD, 0, (j_T + offset).clamp_(max=g - 1), out=out_TD)
    out_TD.masked_fill_((j_T >= count).unsqueeze(1), 0)
    return out_TD
