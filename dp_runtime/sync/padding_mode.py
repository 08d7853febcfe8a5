"""PaddingMode and the rule that picks it for a step (a pure function).

MAX_LEN: every rank's rows are padded to one length ``L`` (the step's max, or the graph bucket);
the gathered buffer holds ``L * dp_size`` rows, rank ``r`` at ``[r*L, r*L + n_r)``.
SUM_LEN: no padding; ``sum(n)`` rows, rank ``r`` at ``n_0 + ... + n_{r-1}``; only live rows move.

The rule, first match wins (``n`` are the per-rank counts aligned up to ``attn_tp_size``):

=====  ========================================  ==========
order  condition                                 mode
=====  ========================================  ==========
1      the step replays a CUDA graph             MAX_LEN
2      the config sets ``dp_padding``            override
3      extend step (any rank) and dp_size > 1    SUM_LEN
4      ``max(n) * dp_size <= 2 * sum(n)``        MAX_LEN
5      otherwise                                 SUM_LEN
=====  ========================================  ==========

Why each rule, and what each mode moves: docs/dp_sync.md ("The padding rule"). A step where every
rank is empty is skipped and has no padding; its plan says MAX_LEN with a zero-length buffer.
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
