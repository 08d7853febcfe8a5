"""DPRankStep: one DP step of one rank, in the order every rank must follow.

    sync  ->  plan  ->  set_dp_buffer_len  ->  gather  ->  compute  ->  scatter

1. ``sync``: the one exchange of counts and flags (``DPStepSync.sync``), which returns
2. the ``StepPlan`` (the same on every rank);
3. ``set_dp_buffer_len``: the rank's DPBufferService sizes the gathered buffers from the plan;
4. ``gather``: every rank's rows into the global buffer (a collective);
5. ``compute(global_GD, plan) -> out_GD``: the work on the gathered rows (in the model: the MoE
   layer; it may run its own collectives, which every rank also joins);
6. ``scatter`` (or ``reduce_scatter`` when ``compute`` returns per-rank partial sums, as an
   expert-parallel MoE does): this rank's rows back.

An IDLE rank (no tokens while another rank has some) runs the same sequence with zero rows:
it joins the gather, the compute's collectives and the scatter. When every rank is empty the
plan says ``skip`` and every rank returns right after the sync, together.

Shapes: ``T`` = this rank's tokens, ``G`` = global_dp_buffer_len, ``D`` = hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dp_runtime.sync.dp_buffer import DPBufferService
from dp_runtime.sync.step_plan import StepPlan
from dp_runtime.sync.step_sync import DPStepSync
from dp_runtime.sync.step_table import LocalStepInfo

__all__ = ["DPRankStep", "RankStepResult"]


@dataclass(frozen=True)
class RankStepResult:
    """The plan of the step and this rank's output rows ([T, D], a view of the local buffer,
    valid until the next step; None when the step was skipped)."""

    plan: StepPlan
    out_TD: torch.Tensor | None


class DPRankStep:
    """Runs one DP step for one rank (see the module docstring).

    Args:
        sync: the rank's DPStepSync.
        buffers: the rank's DPBufferService (same rank, same config).
    """

    def __init__(self, sync: DPStepSync, buffers: DPBufferService) -> None:
        if sync.rank != buffers.rank:
            raise ValueError(
                f"DPRankStep: sync is rank {sync.rank}, buffers are rank {buffers.rank}"
            )
        self.sync, self.buffers = sync, buffers

    def run(
        self,
        local: LocalStepInfo,
        hidden_TD: torch.Tensor | None,
        compute: Callable[[torch.Tensor, StepPlan], torch.Tensor],
        *,
        reduce: bool = False,
    ) -> RankStepResult:
        """One step: takes this rank's report, its [T, D] rows (None or 0 rows when idle; T ==
        ``local.num_tokens``), and ``compute``; returns the plan and this rank's output rows.

        ``reduce=True``: ``compute`` returns per-rank partial results that are summed over ranks
        before this rank takes its rows (the MoE combine). Every call is a collective.
        """
        t = 0 if hidden_TD is None else hidden_TD.shape[0]
        if t != local.num_tokens:
            raise ValueError(
                f"DPRankStep: hidden_TD has {t} rows, local.num_tokens is {local.num_tokens}"
            )
        plan = self.sync.sync(local)
        if plan.skip:
            return RankStepResult(plan, None)
        buffers = self.buffers
        buffers.set_from_plan(plan)
        if hidden_TD is None:
            hidden_TD = buffers.get_local_buffer()[:0]
        global_GD = buffers.gather(hidden_TD)
        out_GD = compute(global_GD, plan)
        if reduce:
            out_TD = buffers.reduce_scatter(out_GD, num_rows=t)
        else:
            out_TD = buffers.scatter(out_GD, num_rows=t)
        return RankStepResult(plan, out_TD)
