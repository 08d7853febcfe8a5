"""What each rank reports in a step (LocalStepInfo) and the gathered table of all ranks.

The report travels as a row of int64 values; ``ROW_WIDTH`` columns in this order:
``num_tokens, num_tokens_for_logprob, can_run_graph, is_extend, forward_mode`` (the mode as its
``MODE_CODES`` int).
The step sync appends its own columns (kind, step counter, previous fingerprint) after these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dp_runtime.checks import require_int
from dp_runtime.forward_mode import ForwardMode

__all__ = ["CODE_MODES", "MODE_CODES", "ROW_WIDTH", "LocalStepInfo", "StepTable"]

ROW_WIDTH = 5


# Wire codes of the forward modes (ForwardMode is defined in graph/ with string values, whose
# hashes are salted per process; the row and the fingerprint need ints). IDLE, DECODE, EXTEND
# keep fixed codes; any other member follows in definition order.
def _mode_codes() -> dict[ForwardMode, int]:
    codes = {ForwardMode[name]: i for i, name in enumerate(("IDLE", "DECODE", "EXTEND"))}
    for mode in ForwardMode:
        codes.setdefault(mode, len(codes))
    return codes


MODE_CODES: dict[ForwardMode, int] = _mode_codes()
CODE_MODES: dict[int, ForwardMode] = {code: mode for mode, code in MODE_CODES.items()}


@dataclass(frozen=True, slots=True)
class LocalStepInfo:
    """One rank's counts and flags for a step, as its scheduler sees them.

    ``num_tokens``: tokens this rank runs (0: nothing to do). ``num_tokens_for_logprob``: rows
    that need logits (default: ``num_tokens``). ``can_run_graph``: this rank's batch fits a
    captured graph. ``is_extend``: the batch prefills. ``forward_mode``: default IDLE for 0
    tokens, else EXTEND or DECODE by ``is_extend``.
    """

    num_tokens: int
    num_tokens_for_logprob: int | None = None
    can_run_graph: bool = False
    is_extend: bool = False
    forward_mode: ForwardMode | None = None

    def __post_init__(self) -> None:
        # to_row() packs int64s: a float count would otherwise travel truncated (2.7 as 2).
        require_int(self.num_tokens, "LocalStepInfo.num_tokens")
        if self.num_tokens_for_logprob is not None:
            require_int(self.num_tokens_for_logprob, "LocalStepInfo.num_tokens_for_logprob")

    def to_row(self) -> tuple[int, int, int, int, int]:
        """The ROW_WIDTH int64 values this rank contributes to the exchange."""
        n = self.num_tokens
        lp = n if self.num_tokens_for_logprob is None else self.num_tokens_for_logprob
        mode = self.forward_mode
        if mode is None:
            mode = (
                ForwardMode.IDLE
                if n == 0
                else (ForwardMode.EXTEND if self.is_extend else ForwardMode.DECODE)
            )
        return (
            int(n),
            int(lp),
            int(bool(self.can_run_graph)),
            int(bool(self.is_extend)),
            MODE_CODES[mode],
        )


@dataclass(frozen=True, slots=True)
class StepTable:
    """The gathered reports of every rank, one column per field, indexed by rank."""

    num_tokens: tuple[int, ...]
    num_tokens_for_logprob: tuple[int, ...]
    can_run_graph: tuple[bool, ...]
    is_extend: tuple[bool, ...]
    forward_modes: tuple[int, ...]  # wire codes (MODE_CODES)

    @property
    def dp_size(self) -> int:
        return len(self.num_tokens)

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]]) -> StepTable:
        """From the exchanged rows (rank order); columns past ROW_WIDTH are ignored."""
        n, lp, graph, ext, mode = tuple(zip(*(r[:ROW_WIDTH] for r in rows), strict=True))
        return cls(n, lp, tuple(map(bool, graph)), tuple(map(bool, ext)), mode)

    @classmethod
    def from_locals(cls, infos: Iterable[LocalStepInfo]) -> StepTable:
        """From each rank's LocalStepInfo, in rank order (tests and single-process tools)."""
        return cls.from_rows([i.to_row() for i in infos])

    @classmethod
    def from_counts(
        cls, num_tokens: Sequence[int], *, can_run_graph: bool = False, is_extend: bool = False
    ) -> StepTable:
        """Every rank with the same flags and its own count (a shorthand for tests and tools)."""
        return cls.from_locals(
            LocalStepInfo(n, can_run_graph=can_run_graph, is_extend=is_extend and n > 0)
            for n in num_tokens
        )
