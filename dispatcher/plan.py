"""What a dispatcher reads from a step plan, and a minimal plan for tests, benchmarks and warmup.

The real ``StepPlan`` lives in ``dp_runtime/`` (a layer above); the dispatcher takes it
duck-typed through ``StepPlanLike`` so that ``dispatcher/`` never imports ``dp_runtime/``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["FixedPlan", "StepPlanLike"]


@runtime_checkable
class StepPlanLike(Protocol):
    """The plan attributes a dispatcher reads (every rank holds the same values).

    - ``global_num_tokens_cpu``: tokens of each EP rank this step, indexed by EP rank.
    - ``runtime_max_tokens_per_rank``: the per-rank row count the step's buffers are laid out
      for; the same on every rank and ``>=`` every entry of ``global_num_tokens_cpu``.
    - ``is_max_len``: the gathered layout of a dispatcher that gathers (all_gather): each
      rank's slot padded to ``runtime_max_tokens_per_rank`` rows (True, MAX_LEN) or live rows
      only (False, SUM_LEN). The all-gather dispatcher lays its buffers out from it and the
      counts; the others do not read it.
    - ``fingerprint``: a cheap hash of the plan that ranks compare to detect disagreement.
    """

    @property
    def global_num_tokens_cpu(self) -> tuple[int, ...]: ...

    @property
    def runtime_max_tokens_per_rank(self) -> int: ...

    @property
    def is_max_len(self) -> bool: ...

    @property
    def fingerprint(self) -> int: ...


@dataclass(frozen=True)
class FixedPlan:
    """A frozen plan built from per-rank token counts; satisfies ``StepPlanLike``."""

    global_num_tokens_cpu: tuple[int, ...]
    runtime_max_tokens_per_rank: int
    fingerprint: int
    is_max_len: bool = True

    @classmethod
    def from_counts(cls, counts: Sequence[int], runtime_max_tokens_per_rank: int | None = None, *,
                    is_max_len: bool = True) -> FixedPlan:
        """Plan for ``counts`` tokens per rank; the runtime max defaults to ``max(counts)``;
        ``is_max_len=False``: an all-gather dispatcher moves live rows only (SUM_LEN)."""
        counts = tuple(int(c) for c in counts)
        runtime_max = (max(counts, default=0) if runtime_max_tokens_per_rank is None
                       else int(runtime_max_tokens_per_rank))
        # crc32 of the geometry: the same on every rank and every process (unlike hash()).
        fingerprint = zlib.crc32(repr((counts, runtime_max, bool(is_max_len))).encode())
        return cls(counts, runtime_max, fingerprint, bool(is_max_len))

    @classmethod
    def uniform(cls, ep_size: int, tokens_per_rank: int) -> FixedPlan:
        """Plan with ``tokens_per_rank`` tokens on each of ``ep_size`` ranks."""
        return cls.from_counts([tokens_per_rank] * ep_size)
