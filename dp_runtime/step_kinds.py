"""Counting a rank's steps by kind for ``RankWorker.metrics()``.

A step is a decode step (a DECODE batch), an extend step (prefill chunks only) or a mixed step
(an EXTEND batch whose leading rows are decode rows: serving/scheduler.py). The worker's
counters keep their historical meaning: ``extend_steps`` counts every step that prefills (mixed
ones included), ``decode_steps`` the pure decode steps, and ``mixed_steps`` the mixed ones;
``steps_by_kind`` splits them into the three disjoint kinds that benchmarks report.
"""

from __future__ import annotations

from dp_runtime.serving.scheduler import ScheduledStep

__all__ = ["STEP_COUNTERS", "count_step", "dp_balance", "steps_by_kind"]

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


def dp_balance(counters: dict[str, int]) -> float:
    """Mean tokens a rank over the most tokens a rank, over the steps that ran: ``dp_tokens /
    dp_max_tokens`` (every step's token table summed, and its largest entry times the ranks).
    1.0 when every rank carried as many tokens as the busiest (and before any step); a rank
    left IDLE while its peers work lowers it. The difference of two readings (before / after
    a run) gives the run's own balance."""
    most = counters.get("dp_max_tokens", 0)
    return counters.get("dp_tokens", 0) / most if most else 1.0


def steps_by_kind(counters: dict[str, int]) -> dict[str, int]:
    """``{"decode": n, "extend": n, "mixed": n}``: disjoint counts of the recorded steps."""
    mixed = counters["mixed_steps"]
    return {"decode": counters["decode_steps"], "extend": counters["extend_steps"] - mixed,
            "mixed": mixed}
