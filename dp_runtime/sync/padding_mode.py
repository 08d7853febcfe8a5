"""PaddingMode and the rule that picks it for a step (a pure function).

MAX_LEN: every rank's rows are padded to the same length ``L`` (the step's max, or the graph
bucket); the gathered buffer holds ``L * dp_size`` rows, rank ``r`` at rows ``[r*L, r*L + n_r)``.
The gather is one ``all_gather_into_tensor``: per rank it moves ``(dp_size - 1) * L`` rows.

SUM_LEN: no padding; the gathered buffer holds ``sum(n)`` rows, rank ``r`` at
``offset_r = n_0 + ... + n_{r-1}``. The gather writes the rank's rows into a zeroed buffer and
sums over ranks with ``all_reduce``: a ring all-reduce moves ``2 * (dp_size - 1) / dp_size``
times the buffer, i.e. ``2 * (dp_size - 1) / dp_size * sum(n)`` rows per rank.

So MAX_LEN moves no more than SUM_LEN exactly when ``max(n) * dp_size <= 2 * sum(n)``: that is
where the threshold of the rule comes from.

The rule, first match wins (``n`` are the per-rank counts aligned up to ``attn_tp_size``):

=====  ========================================  ==========  =====================================
order  condition                                 mode        why
=====  ========================================  ==========  =====================================
1      the step replays a CUDA graph             MAX_LEN     a graph is captured at ``bucket`` rows
                                                             per rank: its shapes are MAX_LEN
2      the config sets ``dp_padding``            override    the operator's choice (legal on every
                                                             eager step)
3      extend step (any rank) and dp_size > 1    SUM_LEN     prefill counts are large and uneven
4      ``max(n) * dp_size <= 2 * sum(n)``        MAX_LEN     pays no more bytes than SUM_LEN, and
                                                             one all-gather is the cheaper launch
5      otherwise                                 SUM_LEN     padding would cost more than the sum
=====  ========================================  ==========  =====================================

(With dp_size == 1 rule 4 always holds: ``max == sum``.) A step where every rank is empty is
skipped by every rank and has no padding; its plan says MAX_LEN with a zero-length buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

__all__ = ["PaddingMode", "choose_padding_mode"]


class PaddingMode(IntEnum):
    """How the gathered DP buffer lays out each rank's rows (see the module docstring)."""

    MAX_LEN = 1
    SUM_LEN = 2

    @property
    def is_max_len(self) -> bool:
        return self is PaddingMode.MAX_LEN

    @classmethod
    def parse(cls, value: PaddingMode | str) -> PaddingMode:
        """``"max_len"`` / ``"sum_len"`` (any case) or a PaddingMode -> PaddingMode.

        Raises ValueError naming the value otherwise.
        """
        if isinstance(value, PaddingMode):
            return value
        try:
            return cls[str(value).strip().upper()]
        except KeyError:
            raise ValueError(f"padding mode {value!r} is not one of 'max_len', 'sum_len'") from None


def choose_padding_mode(
    aligned_num_tokens: Sequence[int],
    is_extend: bool,
    replays_graph: bool,
    override: PaddingMode | None,
) -> PaddingMode:
    """The padding of a step with these per-rank counts (the table in the module docstring).

    Takes the per-rank token counts already aligned to ``attn_tp_size`` (len == dp_size), whether
    any rank extends, whether the step replays a captured graph, and the config override (None:
    no override). Returns the PaddingMode. Pure: no state, no I/O.
    """
    if replays_graph:
        return PaddingMode.MAX_LEN
    if override is not None:
        return override
    dp_size = len(aligned_num_tokens)
    if is_extend and dp_size > 1:
        return PaddingMode.SUM_LEN
    if max(aligned_num_tokens, default=0) * dp_size <= 2 * sum(aligned_num_tokens):
        return PaddingMode.MAX_LEN
    return PaddingMode.SUM_LEN
