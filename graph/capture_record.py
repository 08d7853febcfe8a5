"""What a captured graph baked in, and the check that a replay's plan still matches it.

A CUDA graph replays the exact kernels and sizes of its capture: the bucket (every shape), the
DP padding mode and ``runtime_max_tokens_per_rank`` (the sizes of the gathered buffers and of
the collectives inside the graph), and which optional inputs existed (a branch on
``input_embeds is None`` was taken once, at capture). A replay under a plan that disagrees
would read the wrong rows or hang in a collective, so each mismatch is named.
"""

from __future__ import annotations

from dataclasses import dataclass

from graph.forward_mode import ForwardMode
from graph.step_plan_view import StepPlanView, padding_name

__all__ = ["CaptureRecord"]


@dataclass(frozen=True)
class CaptureRecord:
    """The values one bucket's graph was captured with."""

    bucket: int
    num_tokens: int
    forward_mode: ForwardMode
    padding: str
    runtime_max_tokens_per_rank: int
    fields: frozenset[str]  # plain registry slots the capture batch provided

    def plan_mismatch(self, bucket: int, plan: StepPlanView) -> str | None:
        """Why ``plan`` cannot replay this graph as bucket ``bucket``, or None when it can."""
        problems = []
        if bucket != self.bucket:
            problems.append(f"bucket {bucket} (captured {self.bucket})")
        padding = padding_name(plan)
        if padding != self.padding:
            problems.append(f"padding {padding} (captured {self.padding})")
        if int(plan.runtime_max_tokens_per_rank) != self.runtime_max_tokens_per_rank:
            problems.append(
                f"runtime_max_tokens_per_rank {plan.runtime_max_tokens_per_rank} "
                f"(captured {self.runtime_max_tokens_per_rank})"
            )
        if not problems:
            return None
        return (f"graph of bucket {self.bucket} was captured with other values than this step's "
                "plan: " + "; ".join(problems))

    def fields_mismatch(self, fields: frozenset[str]) -> str | None:
        """Why a batch providing ``fields`` cannot replay this graph, or None when it can."""
        if fields == self.fields:
            return None
        extra, missing = sorted(fields - self.fields), sorted(self.fields - fields)
        return (
            f"batch inputs differ from the capture of bucket {self.bucket}: "
            f"provided but not captured {extra}, captured but missing {missing}"
        )
