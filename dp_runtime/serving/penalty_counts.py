"""How often each request has generated each token, kept on the device for its presence and
frequency penalties (``adjusted_rows``): no host history, no host work that grows with the
output.

``PenaltyCounts`` holds one float32 row of ``V`` counts per request row of the KV cache (the
rows ``req_pool_indices`` name, ``KVCache.req_to_token``'s ``max_running_requests + 1``, row 0
the padding target): ``(max_running_requests + 1) x V x 4`` bytes, allocated when the rank is
built, before it sizes its KV cache (``memory_sizing.penalty_count_bytes``, the plan's
``penalty_counts``). float32 because the penalties multiply the counts in float32
(``addcmul_``) and it counts exactly to 2**24; int32 would take as much and a conversion per
chunk, int16 half but wraps at 32,767 repeats of one token.

The device updates it in stream order, so the host never needs a token that is still in flight
(overlapped steps), in a step where some row is penalized (``step_tokens.launch_tokens``):

1. ``clear``: the rows of penalized requests that draw their first token (output index 0) are
   zeroed. A row's counts are read only by a penalized request, and only from its first draw
   on, so whatever the row held before (an earlier request's, or a prompt chunk's below) is
   gone by the time it is read. A request leaves its row only after every step that wrote it
   was launched, so a later request's clear follows those writes in stream order.
2. the draw reads a chunk's rows (``StepCounts.rows``: one ``index_select``);
3. ``StepCounts.record``: 1 added at (row, drawn token) for every row of the step, penalized
   or not, sampling or not: one ``index_add_`` of B entries built on the device from the step's
   rows and ids, no host data and no mask to copy; the rows that are not read later are
   cleared by (1) before they are.

A step without a penalized row does none of this.

Legend: R request rows, V the vocabulary, B the step's rows, C a chunk's rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["PenaltyCounts", "StepCounts"]


@dataclass(frozen=True)
class StepCounts:
    """One step's view of a count table: row i of the step counts its request's output tokens
    so far in ``table_RV[rows_B[i]]`` (``rows_B`` int64 on the table's device)."""

    table_RV: torch.Tensor
    rows_B: torch.Tensor

    def rows(self, at_C: torch.Tensor) -> torch.Tensor:
        """The counts of step rows ``at_C`` (int64, on the device): a C x V float32 copy."""
        return self.table_RV.index_select(0, self.rows_B.index_select(0, at_C))

    def record(self, ids_B: torch.Tensor) -> None:
        """Count each row's drawn token: 1 added at ``(rows_B[i], ids_B[i])``, on the device
        (after the draw, in stream order: the next step's draw reads it)."""
        vocab = self.table_RV.shape[1]
        at_B = self.rows_B * vocab + ids_B
        self.table_RV.view(-1).index_add_(0, at_B, torch.ones_like(at_B, dtype=self.table_RV.dtype))


class PenaltyCounts:
    """The rank's count table (module docstring): ``rows x vocab`` float32 zeros on ``device``.
    Built once with the rank; ``close`` frees it."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str) -> None:
        self.table_RV: torch.Tensor | None = torch.zeros(rows, vocab, dtype=torch.float32, device=device)

    @classmethod
    def for_runtime(cls, max_running_requests: int, vocab: int, device: torch.device | str) -> PenaltyCounts:
        """The table of a rank serving ``max_running_requests``: a row for each KV request row,
        ``max_running_requests + 1`` (``KVCache``'s, row 0 the padding target)."""
        return cls(max_running_requests + 1, vocab, device)

    @property
    def nbytes(self) -> int:
        return 0 if self.table_RV is None else self.table_RV.nbytes

    def clear(self, rows: Iterable[int]) -> None:
        """Zero request rows ``rows`` on the device (step 1 of the module docstring; no sync)."""
        for row in rows:
            self.table_RV[row].zero_()

    def step(self, rows_B: torch.Tensor) -> StepCounts:
        """The view of a step whose row i is request row ``rows_B[i]``."""
        return StepCounts(self.table_RV, rows_B)

    def close(self) -> None:
        self.table_RV = None
