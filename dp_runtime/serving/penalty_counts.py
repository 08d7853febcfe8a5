"""The penalties' per-request state, kept on the device (``adjusted_rows``): how often each
request has generated each token (presence and frequency penalties) and which tokens its prompt
and output hold (repetition penalty). No host history, no host work that grows with the output.

``PenaltyCounts`` holds, per request row of the KV cache (the rows ``req_pool_indices`` name,
``KVCache.req_to_token``'s ``max_running_requests + 1``, row 0 the padding target), one float32
row of ``V`` counts and one bool row of ``V`` marks: ``(max_running_requests + 1) x V x (4 + 1)``
bytes, allocated when the rank is built, before it sizes its KV cache
(``memory_sizing.penalty_count_bytes``, the plan's ``penalty_counts``). float32 because the
penalties multiply the counts in float32 (``addcmul_``) and it counts exactly to 2**24; int32
would take as much and a conversion per chunk, int16 half but wraps at 32,767 repeats of one
token. The marks are a table of their own, not ``counts > 0``, because they hold the prompt too,
which the counts (OpenAI's rule: the output only) must not.

The device updates both in stream order, so the host never needs a token that is still in
flight (overlapped steps), in a step where some row reads them (``step_tokens.launch_tokens``;
the counts where a row has a presence or frequency penalty, the marks where one has a repetition
penalty, each table on its own):

1. at the step where such a request draws its first token (output index 0, the step of its
   last prompt chunk), its row is reset: the counts zeroed (``clear``); the marks zeroed and then
   set at every id of its whole prompt (``mark_prompts``: the ids of all such requests of the
   step in one asynchronous pinned copy, once per request). A row is read only by a request with
   that penalty, and only from its first draw on, so whatever the row held before (an earlier
   request's, or a prompt chunk's below) is gone by the time it is read. A request leaves its
   row only after every step that wrote it was launched, so a later request's reset follows
   those writes in stream order. At the last chunk, not the first: the earlier chunks' steps
   mark their rows too (their argmax, step 3) and those marks must be gone; and the host has
   the whole prompt then (``Request.prompt_ids``), whatever part of it the steps computed;
2. the draw reads a chunk's rows (``StepCounts.rows`` / ``seen``: one ``index_select`` each);
3. ``StepCounts.record``: each row of the step, penalized or not, sampling or not, gets its drawn
   token counted (1 added at (row, token)) and marked: one ``index_add_`` / ``index_fill_`` of B
   entries built on the device from the step's rows and ids, no host data and no mask to copy;
   the rows that are not read later are reset by (1) before they are.

A step without such a row touches neither table.

Legend: R request rows, V the vocabulary, B the step's rows, C a chunk's rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from dp_runtime.serving.host_copy import host_to_device

__all__ = ["PenaltyCounts", "StepCounts"]


@dataclass(frozen=True)
class StepCounts:
    """One step's view of the tables: row i of the step counts its request's output tokens so
    far in ``table_RV[rows_B[i]]`` and marks its prompt and output tokens in
    ``seen_RV[rows_B[i]]`` (``rows_B`` int64 on the tables' device). A table is None where no
    row of the step reads it (``record`` then leaves it alone)."""

    table_RV: torch.Tensor | None
    rows_B: torch.Tensor
    seen_RV: torch.Tensor | None = None

    def rows(self, at_C: torch.Tensor) -> torch.Tensor:
        """The counts of step rows ``at_C`` (int64, on the device): a C x V float32 copy."""
        return self.table_RV.index_select(0, self.rows_B.index_select(0, at_C))

    def seen(self, at_C: torch.Tensor) -> torch.Tensor:
        """The marks of step rows ``at_C`` (int64, on the device): a C x V bool copy, True at
        each token id of the request's prompt or output so far."""
        return self.seen_RV.index_select(0, self.rows_B.index_select(0, at_C))

    def record(self, ids_B: torch.Tensor) -> None:
        """Count and mark each row's drawn token at ``(rows_B[i], ids_B[i])``, on the device
        (after the draw, in stream order: the next step's draw reads it)."""
        table = self.table_RV if self.table_RV is not None else self.seen_RV
        at_B = self.rows_B * table.shape[1] + ids_B  # both tables are R x V
        if self.table_RV is not None:
            self.table_RV.view(-1).index_add_(0, at_B, torch.ones_like(at_B,
                                                                       dtype=self.table_RV.dtype))
        if self.seen_RV is not None:
            self.seen_RV.view(-1).index_fill_(0, at_B, True)


class PenaltyCounts:
    """The rank's tables (module docstring): ``rows x vocab`` float32 counts and bool marks,
    zeros on ``device``. Built once with the rank; ``close`` frees them."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str) -> None:
        self.table_RV: torch.Tensor | None = torch.zeros(rows, vocab, dtype=torch.float32,
                                                         device=device)
        self.seen_RV: torch.Tensor | None = torch.zeros(rows, vocab, dtype=torch.bool,
                                                        device=device)

    @classmethod
    def for_runtime(cls, max_running_requests: int, vocab: int,
                    device: torch.device | str) -> PenaltyCounts:
        """The tables of a rank serving ``max_running_requests``: a row for each KV request row,
        ``max_running_requests + 1`` (``KVCache``'s, row 0 the padding target)."""
        return cls(max_running_requests + 1, vocab, device)

    @property
    def nbytes(self) -> int:
        return sum(0 if t is None else t.nbytes for t in (self.table_RV, self.seen_RV))

    def clear(self, rows: Iterable[int]) -> None:
        """Zero the counts of request rows ``rows`` on the device (step 1 of the module
        docstring; no sync)."""
        for row in rows:
            self.table_RV[row].zero_()

    def mark_prompts(self, prompts: Iterable[tuple[int, Sequence[int]]]) -> None:
        """For each ``(request row, prompt ids)``: the row's marks zeroed, then set at every id
        of the prompt (step 1 of the module docstring): one asynchronous copy of the flat
        indices, one ``index_fill_``; no sync. Ids must be in the vocabulary (the door's rule)."""
        vocab, flat = self.seen_RV.shape[1], []
        for row, ids in prompts:
            self.seen_RV[row].zero_()
            flat.extend(row * vocab + t for t in ids)
        if flat:
            self.seen_RV.view(-1).index_fill_(0, host_to_device(flat, torch.int64,
                                                                self.seen_RV.device), True)

    def step(self, rows_B: torch.Tensor, *, counts: bool = True, seen: bool = False) -> StepCounts:
        """The view of a step whose row i is request row ``rows_B[i]``, with the counts and/or
        the marks (a table the step's rows do not read is left out: nothing writes it)."""
        return StepCounts(self.table_RV if counts else None, rows_B, self.seen_RV if seen else None)

    def close(self) -> None:
        self.table_RV = self.seen_RV = None
