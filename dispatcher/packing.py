"""Packing a token's hidden row and routing into one byte row, so one collective carries both.

Row layout (bytes): ``[ids: K x int32 | weights: K x fp32 | hidden: D x dtype | pad to 16]``.
Routing goes first so that every field starts at an offset its dtype divides, whatever ``D``;
the row length is a multiple of 16 so that dtype views of a ``[S, B]`` byte tensor are legal.

Legend: ``S`` rows, ``K`` top-k, ``D`` hidden size, ``B`` bytes per packed row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatcher.sizing import dtype_bytes

__all__ = ["RowLayout"]

_ROW_ALIGN = 16


@dataclass(frozen=True)
class RowLayout:
    """Byte layout of a packed row for ``hidden_size`` in ``dtype`` and ``top_k`` picks."""

    hidden_size: int
    top_k: int
    dtype: torch.dtype

    @property
    def hidden_offset(self) -> int:
        return 8 * self.top_k

    @property
    def row_bytes(self) -> int:
        raw = self.hidden_offset + self.hidden_size * dtype_bytes(self.dtype)
        return (raw + _ROW_ALIGN - 1) // _ROW_ALIGN * _ROW_ALIGN

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        """An uninitialized ``[rows, B]`` uint8 buffer."""
        return torch.empty((rows, self.row_bytes), dtype=torch.uint8, device=device)

    def views(self, rows_SB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Typed views ``(hidden_SD, ids_SK int32, weights_SK fp32)`` into packed rows."""
        k, off = self.top_k, self.hidden_offset
        end = off + self.hidden_size * dtype_bytes(self.dtype)
        ids_SK = rows_SB[:, : 4 * k].view(torch.int32)
        weights_SK = rows_SB[:, 4 * k: off].view(torch.float32)
        hidden_SD = rows_SB[:, off:end].view(self.dtype)
        return hidden_SD, ids_SK, weights_SK

    def pack(self, hidden_SD: torch.Tensor, ids_SK: torch.Tensor, weights_SK: torch.Tensor) -> torch.Tensor:
        """New ``[S, B]`` uint8 rows holding the given hidden rows, ids and weights."""
        rows_SB = self.empty(hidden_SD.shape[0], hidden_SD.device)
        h, i, w = self.views(rows_SB)
        h.copy_(hidden_SD)
        i.copy_(ids_SK)
        w.copy_(weights_SK)
        return rows_SB
