"""dp_gather (local -> global), dp_scatter and dp_reduce_scatter (global -> local), both paddings.

Shapes (legend): ``T`` = rows this rank brings, ``G`` = rows of the gathered buffer, ``P`` =
per-rank rows under MAX_LEN (``G = P * R``), ``D`` = hidden size, ``R`` = dp_size.

- MAX_LEN gather: the rank's rows go into its own slot (tail zeroed), then an in-place
  ``all_gather_into_tensor`` with the slot as input (no staging buffer).
- SUM_LEN gather: an uneven all-gather straight into the buffer's rows, live rows only (CUDA:
  torch's list ``all_gather``, coalesced NCCL broadcasts; gloo: a variable-split all-to-all).
- ``dp_reduce_scatter`` (the MoE combine): CUDA MAX_LEN ``reduce_scatter_tensor`` of the padded
  slots; CUDA SUM_LEN an uneven reduce-scatter of live rows; gloo: each peer's live rows by
  all-to-all, summed in fp32 in rank order.

World size 1 skips the collectives (same answer). Every function but ``dp_scatter`` is a
collective over ``group``; ranks with zero rows join. The full table: docs/dp_sync.md.
"""

from __future__ import annotations

from typing import Any

import torch

from dp_runtime.sync.collectives import (
    all_gather_into,
    all_gather_v,
    all_to_all_v,
    reduce_scatter_into,
    reduce_scatter_v,
    world_of,
)
from dp_runtime.sync.padding_mode import PaddingMode

__all__ = [
    "dp_gather",
    "dp_reduce_scatter",
    "dp_scatter",
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
        r = len(layout.global_num_tokens)
        all_to_all_v(global_GD, slot_PD.repeat(r, 1), list(layout.global_num_tokens), [rows] * r,
                     group)
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

    Takes the [G, D] per-rank partials (G = layout.global_dp_buffer_len), the step's layout, the
    group and an optional output buffer (>= the rank's slot rows; a new tensor otherwise).
    MAX_LEN on CUDA: one ``reduce_scatter_tensor`` of the padded slots; SUM_LEN on CUDA: an
    uneven reduce-scatter of the live rows; gloo: all-to-all of live rows, fp32 sum in rank
    order. ``global_GD`` is not modified. A collective over ``group``.
    """
    counts = layout.global_num_tokens
    n = counts[layout.rank]
    if world_of(group) == 1 or layout.global_dp_buffer_len == 0:
        return dp_scatter(global_GD, layout, out_TD)
    if out_TD is None:
        out_TD = global_GD.new_empty((max(n, layout.local_dp_buffer_len), global_GD.shape[1]))
    if global_GD.is_cuda:
        if layout.padding is PaddingMode.MAX_LEN:
            reduce_scatter_into(out_TD[: layout.local_dp_buffer_len], global_GD, group=group)
        else:
            reduce_scatter_v(out_TD[:n], list(global_GD.split(list(counts))), group=group)
        return out_TD[:n]
    # gloo: rank r gets its live rows of my partials; I get mine from every rank.
    r = len(counts)
    send_SD = torch.cat([global_GD[o : o + c] for o, c in zip(layout.offsets, counts, strict=True)])
    recv_RnD = global_GD.new_empty((r, n, global_GD.shape[1]))
    all_to_all_v(recv_RnD.view(r * n, global_GD.shape[1]), send_SD, [n] * r, list(counts), group)
    out_ND = out_TD[:n]
    out_ND.copy_(recv_RnD.float().sum(0))
    return out_ND
