"""Tokens per step on one rank, as a histogram: the server's ``vllm:iteration_tokens_total``.

The server sees requests, not steps, so the rank keeps the histogram as it records each step
(under the worker's lock, with no remote call) and ``RankWorker.metrics()`` reports it whole; the
launcher's existing polling carries it to ``engine.stats()``.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

__all__ = ["STEP_TOKEN_BUCKETS", "StepTokenHistogram"]

# vLLM's upper bounds for ``vllm:iteration_tokens_total`` (vllm/v1/metrics/loggers.py), so the
# quantiles of dashboards built for vLLM read the same buckets here.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokenHistogram:
    """Tokens per recorded step: the prompt tokens it prefilled plus its decode rows (a step's
    ``num_tokens``; IDLE steps, which carry none, record nothing). ``snapshot()`` gives the
    bucket counts cumulative, as Prometheus keeps them. Not thread-safe: its owner locks."""

    def __init__(self, bounds: tuple[int, ...] = STEP_TOKEN_BUCKETS):
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0

    def observe(self, tokens: int) -> None:
        self._counts[bisect.bisect_left(self._bounds, tokens)] += 1  # a bound is inclusive (le)
        self._sum += tokens

    def snapshot(self) -> dict[str, Any]:
        """``{"le": bounds, "buckets": cumulative counts (one more: +Inf), "count", "sum"}``."""
        buckets = list(itertools.accumulate(self._counts))
        return {"le": list(self._bounds), "buckets": buckets, "count": buckets[-1],
                "sum": self._sum}
