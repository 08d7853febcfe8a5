"""Counting a rank's steps by kind for ``RankWorker.metrics()``.

A step is a decode step (a DECODE batch), an extend step (prefill chunks only) or a mixed step
(an EXTEND batch whose leading rows are decode rows: serving/scheduler.py). The worker's
counters keep their historical meaning: ``extend_steps`` counts every step that prefills (mixed
ones included), ``decode_steps`` the pure decode steps, and ``mixed_steps`` the mixed ones;
``steps_by_kind`` splits them into the three disjoint kinds that benchmarks report.
``StepTokenHistogram`` keeps the tokens of each recorded step (the server's
``vllm:iteration_tokens_total``).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

from dp_runtime.serving.scheduler import ScheduledStep

__all__ = ["STEP_COUNTERS", "STEP_TOKEN_BUCKETS", "StepTokenHistogram", "count_step",
           "steps_by_kind"]

# The counters this module writes, zero at the start (the worker merges them into its own).
STEP_COUNTERS = ("extend_steps", "mixed_steps", "decode_steps", "prefill_tokens", "decode_rows")


def count_step(counters: dict[str, int], step: ScheduledStep) -> None:
    """Add ``step`` (whose tokens were just recorded) to ``counters``: its kind, the prompt
    tokens it prefilled and the decode rows it ran."""
    if step.is_extend:
        counters["extend_steps"] += 1
        counters["mixed_steps"] += step.num_decode > 0
        counters["prefill_tokens"] += step.num_tokens - step.num_decode
        counters["decode_rows"] += step.num_decode
    else:
        counters["decode_steps"] += 1
        counters["decode_rows"] += step.batch.batch_size


def steps_by_kind(counters: dict[str, int]) -> dict[str, int]:
    """``{"decode": n, "extend": n, "mixed": n}``: disjoint counts of the recorded steps."""
    mixed = counters["mixed_steps"]
    return {"decode": counters["decode_steps"], "extend": counters["extend_steps"] - mixed, "mixed": mixed}


# vLLM's upper bounds for ``vllm:iteration_tokens_total`` (vllm/v1/metrics/loggers.py), so the
# quantiles of dashboards built for vLLM read the same buckets here.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokenHistogram:
    """Tokens per recorded step: the prompt tokens it prefilled plus its decode rows (a step's
    ``num_tokens``; IDLE steps record nothing). The rank observes each step as it records it,
    under its own lock, with no remote call; ``snapshot()`` reports the whole histogram, bucket
    counts cumulative as Prometheus keeps them, for the launcher's existing polling to carry."""

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
