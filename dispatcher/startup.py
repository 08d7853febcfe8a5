"""Host-side checks before the first real step: a barrier with a timeout, and plan agreement.

Why: FlashInfer's one-sided kernels wait for every peer's completion flag on the GPU. A peer that
is late (still compiling, crashed, stuck) makes them spin for minutes and then ``trap``, which kills
the CUDA context. A gloo ``monitored_barrier`` with a timeout before the first step turns that into
a prompt host-side error naming the missing ranks. Ranks that disagree on the step geometry
(``runtime_max_tokens_per_rank``) write outside each other's buffers (NaN, illegal memory access),
so the first step also compares the plan across ranks.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dispatcher.groups import EPGroup
from dispatcher.plan import FixedPlan, StepPlanLike
from dispatcher.protocol import moe_forward

__all__ = [
    "DispatcherStartupError",
    "FirstStepGuard",
    "barrier_with_timeout",
    "verify_plan_agreement",
    "warmup_round",
]


class DispatcherStartupError(RuntimeError):
    """A peer did not reach the dispatcher's startup barrier in time."""


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def barrier_with_timeout(ep: EPGroup, timeout_s: float, what: str) -> None:
    """Wait until every EP rank reaches this point, at most ``timeout_s`` seconds.

    Takes the EP group, the timeout, and a phrase naming the phase for the error; returns nothing
    or raises ``DispatcherStartupError`` naming the phase, the timeout and torch's report of the
    missing ranks (rank 0 lists them; other ranks report that rank 0 did not answer).
    """
    if not ep.distributed or ep.size == 1:
        return
    try:
        dist.monitored_barrier(group=ep.cpu_group, timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except RuntimeError as exc:
        raise DispatcherStartupError(
            f"{what}: not every EP rank reached the startup barrier within {timeout_s:g} s (seen "
            f"from EP rank {ep.rank} of {ep.size}). A peer is slow (still compiling "
            "kernels?), stuck or dead; the step is refused on the host because FlashInfer's "
            "all-to-all kernels would spin on the GPU waiting for it and then kill the CUDA "
            "context. Raise DispatcherConfig.first_step_timeout_s if the peer is only slow. torch "
            f"said: {exc}"
        ) from exc


def verify_plan_agreement(ep: EPGroup, plan: StepPlanLike) -> None:
    """Raise ``ValueError`` unless every EP rank holds the same plan geometry.

    Compares ``(fingerprint, runtime_max_tokens_per_rank, global_num_tokens_cpu)`` across ranks
    with one object all-gather over the CPU group (host only, allowed during CUDA graph capture).
    """
    mine = (int(plan.fingerprint), int(plan.runtime_max_tokens_per_rank),
            tuple(int(n) for n in plan.global_num_tokens_cpu))
    everyone = ep.all_gather_object(mine)
    if any(other != mine for other in everyone):
        rows = "; ".join(
            f"rank {r}: fingerprint={fp} runtime_max_tokens_per_rank={rm} global_num_tokens_cpu={g}"
            for r, (fp, rm, g) in enumerate(everyone)
        )
        raise ValueError(
            "EP ranks disagree on the step plan (the dispatch geometry must come from the gathered "
            f"table, never from local counts): {rows}"
        )


@dataclass
class FirstStepGuard:
    """Makes sure a dispatcher is warmed up (with its host barriers) before its first real step,
    and checks plan agreement at that step and at every CUDA graph capture.

    Mutable per-dispatcher state (whether warmup ran); the forwards of one rank are serialized, so
    no lock is needed.
    """

    ep: EPGroup
    what: str
    warmed: bool = field(default=False)

    def before_step(self, plan: StepPlanLike, warmup: Callable[[], None]) -> None:
        """Before a real step: the first time, run ``warmup`` (barriers with timeout) and compare
        plans across ranks; while capturing a CUDA graph, compare plans (a captured geometry must
        agree across ranks, and must never come from local counts)."""
        if not self.warmed:
            if _capturing():
                raise RuntimeError(
                    f"{self.what}: the first step is being captured into a CUDA graph; call the "
                    "dispatcher's warmup() on every rank before capturing"
                )
            warmup()
            verify_plan_agreement(self.ep, plan)
        elif _capturing():
            verify_plan_agreement(self.ep, plan)


def warmup_round(dispatcher: Any, guard: FirstStepGuard, timeout_s: float) -> None:
    """Barrier, one tiny dispatch + combine (one token per rank, routed to other ranks' experts,
    identity experts), device sync, barrier. Raises ``DispatcherStartupError`` if a peer misses a
    barrier and ``RuntimeError`` if the round's output is wrong. Idempotent; every rank must call
    it.
    """
    if guard.warmed:
        return
    what = f"{dispatcher.kind} dispatcher warmup"
    barrier_with_timeout(guard.ep, timeout_s, f"{what} (before the first dispatch)")
    guard.warmed = True  # the round below is a real dispatch: it must not re-enter warmup
    try:
        _tiny_round(dispatcher)
    except BaseException:
        guard.warmed = False
        raise
    barrier_with_timeout(guard.ep, timeout_s, f"{what} (after the first dispatch + combine)")


def _tiny_round(dispatcher: Any) -> None:
    cfg, ep, part = dispatcher.config, dispatcher.ep, dispatcher.partition
    device = dispatcher.device
    plan = FixedPlan.uniform(ep.size, 1)
    x_TD = (torch.arange(cfg.hidden_size, device=device, dtype=torch.float32) % 7
            + ep.rank).to(cfg.dtype)[None]
    # Pick k goes to rank (rank + 1 + k) % R, so tokens cross ranks whenever R > 1.
    owners = [(ep.rank + 1 + k) % ep.size for k in range(cfg.top_k)]
    ids_TK = torch.tensor([[part.first(r) + (k // ep.size) % part.num_local(r)
                            for k, r in enumerate(owners)]],
                          dtype=torch.int32, device=device)
    w_TK = torch.full((1, cfg.top_k), 1.0 / cfg.top_k, dtype=torch.float32, device=device)
    out_TD = moe_forward(dispatcher, x_TD, ids_TK, w_TK, plan, lambda x, e: x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not torch.allclose(out_TD.float(), x_TD.float(), rtol=1e-2, atol=1e-2):
        raise RuntimeError(
            f"{dispatcher.kind} dispatcher warmup: a dispatch + combine of identity experts "
            f"changed the tokens on EP rank {ep.rank} (max "
            f"error {(out_TD.float() - x_TD.float()).abs().max().item():.3g})"
        )
