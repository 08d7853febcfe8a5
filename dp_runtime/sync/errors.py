"""Errors of the DP step sync. Both are raised on every rank alike where the protocol allows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["DPPlanMismatchError", "DPSyncError", "DPSyncTimeoutError"]


class DPSyncError(RuntimeError):
    """Base class: the ranks of a DP group cannot agree on a step."""


class DPPlanMismatchError(DPSyncError):
    """Ranks disagree on something that must be rank-invariant (a plan fingerprint, the step
    counter, the kind of exchange, the config).

    Attributes: ``field`` (what disagrees), ``values`` ({rank: value}), ``ranks`` (the ranks
    whose value differs from the most common one).
    """

    def __init__(self, field: str, values: Mapping[int, object], detail: str = "") -> None:
        self.field = field
        self.values = dict(values)
        groups: dict[str, list[int]] = {}
        for rank, value in sorted(self.values.items()):
            groups.setdefault(repr(value), []).append(rank)
        # The reference is the most common value (ties: the one of the lowest rank), so with 3+
        # ranks the odd one out is named; with 2 ranks it is rank 1 by convention.
        majority = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
        self.ranks: tuple[int, ...] = tuple(r for r in sorted(self.values) if r not in majority)
        shown = "; ".join(f"ranks {ranks}: {value}" for value, ranks in groups.items())
        message = (f"DP ranks disagree on {field}: {shown} (differing from the majority: "
                   f"ranks {list(self.ranks)})")
        super().__init__(message + (f". {detail}" if detail else ""))


class DPSyncTimeoutError(DPSyncError):
    """A rank did not join a step exchange in time (it hangs, died, or skipped a step).

    Attributes: ``silent_ranks`` (the ranks that never wrote), ``timeout_s``.
    """

    def __init__(self, message: str, silent_ranks: Sequence[int], timeout_s: float) -> None:
        self.silent_ranks = tuple(silent_ranks)
        self.timeout_s = timeout_s
        super().__init__(message)
