"""All-gather dispatcher: every rank sees every token, runs its experts, reduce-scatters back.

The gathered storage is not the dispatcher's: it is the rank's DP buffer service
(``dp_runtime.sync.dp_buffer.DPBufferService``, seen here through the ``GatherBuffers``
protocol), whose one user this dispatcher is. Dispatch lays the buffers out from the plan it is
handed (``set_from_plan``: the plan's counts, ``runtime_max_tokens_per_rank`` and
``is_max_len``), so nobody else has to lay them out before a forward; then it gathers the hidden
rows and the routing (ids and fp32 weights, bit-cast into one int32 row) into them. The padding
mode decides what moves (MAX_LEN: each rank's slot padded to the agreed length, padding rows
carrying invalid expert ids; SUM_LEN: live rows only). Each rank
runs its experts on the gathered rows routed to them, writing the partial sums in place over the
gathered hidden rows (every expert path reads all of its input before it writes its output), and
combine reduce-scatters those partials back through the service.

A CUDA graph captures the gathers with the layout of its capture plan (the bucket's MAX_LEN, laid
out while the capture ran): the same shapes, offsets and pool addresses at every replay, and no
host code runs at a replay. Laying out takes views of storage allocated once, never memory.

Legend: ``T`` local tokens, ``G`` gathered rows, ``K`` top-k, ``D`` hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dispatcher.config import DispatcherConfig
from dispatcher.experts import ExpertInputs
from dispatcher.groups import EPGroup, default_device
from dispatcher.kind import DispatcherKind
from dispatcher.partition import INVALID_EXPERT_ID, ExpertPartition
from dispatcher.plan import StepPlanLike
from dispatcher.protocol import DispatchResult
from dispatcher.startup import FirstStepGuard, warmup_round
from dispatcher.validate import check_combine_input, check_step

__all__ = ["AllGatherDispatcher", "AllGatherHandle", "GatherBuffers"]


class GatherBuffers(Protocol):
    """What the dispatcher uses of the rank's DP buffer service."""

    @property
    def layout(self) -> Any:
        """The step's layout: ``global_num_tokens``, ``global_dp_buffer_len`` among others."""
        ...

    def gather(self, local_TD: torch.Tensor) -> torch.Tensor: ...

    def gather_routing(self, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                       invalid_id: int) -> torch.Tensor: ...

    def reduce_scatter(self, global_GD: torch.Tensor, *,
                       num_rows: int | None = None) -> torch.Tensor: ...

    def set_from_plan(self, plan: StepPlanLike) -> Any:
        """Lay the buffers out for ``plan``; returns the layout."""
        ...


@dataclass(frozen=True)
class AllGatherHandle:
    """What combine needs from an all-gather dispatch."""

    dispatcher_id: int
    num_tokens: int
    gathered: torch.Tensor  # the [G, D] rows dispatch gathered into (and experts write over)
    fingerprint: int


class AllGatherDispatcher(DispatcherKind):
    """Dispatch by all-gather, combine by reduce-scatter, through the DP buffer service. Its
    gathered storage is the service's (counted with the DP buffers): no workspace of its own,
    and the experts write over the gathered rows."""

    kind = "all_gather"
    combine_is_identity = False
    gathers = True
    auto_order = 2

    @classmethod
    def auto_reason(cls, world_size: int, flashinfer_dispatch: tuple[bool, str],
                    graphs_on_cuda: bool) -> str | None:
        if not graphs_on_cuda:
            return None
        return f"auto: {flashinfer_dispatch[1]}; all_to_all is eager-only, graphs take all_gather"

    @classmethod
    def expert_rows(cls, dp_size: int, ep_size: int, num_tokens: int) -> int:
        return int(num_tokens) * dp_size  # every DP rank's: the gathered buffer

    def __init__(self, config: DispatcherConfig, ep: EPGroup | None = None, *,
                 buffers: GatherBuffers, device: torch.device | str | None = None) -> None:
        """Takes the config, the EP group (default: world size 1), the rank's DP buffer service
        (built with ``routing_top_k=config.top_k``; its group is the EP group) and the device of
        the hidden states (default: CUDA's current device if available, else CPU)."""
        self.config = config
        self.ep = ep if ep is not None else EPGroup.local()
        self.partition = ExpertPartition(config.num_experts, self.ep.size)
        self.device = torch.device(device) if device is not None else default_device()
        self.buffers = buffers
        self._guard = FirstStepGuard(self.ep, f"{self.kind} dispatcher")

    def workspace_bytes_per_rank(self) -> int:
        return 0  # the gathered storage is the DP buffer service's, counted as dp_buffers

    def warmup(self) -> None:
        # The tiny round's dispatch lays the buffers out for its own plan (one token per rank);
        # a step that triggered this warm-up lays out for its plan after it.
        warmup_round(self, self._guard, self.config.first_step_timeout_s)

    def close(self) -> None:
        self.buffers = None

    def dispatch(self, hidden_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, plan: StepPlanLike) -> DispatchResult:
        cfg, ep = self.config, self.ep
        check_step(hidden_TD, topk_ids_TK, topk_weights_TK, plan, config=cfg, ep=ep,
                   backend=self.kind)
        self._guard.before_step(plan, self.warmup)
        # The one place the buffers are laid out: from the plan of this forward (a graph capture
        # records this layout; the same plan in the next layer costs an identity check).
        self.buffers.set_from_plan(plan)
        gathered_GD = self.buffers.gather(hidden_TD)
        routing_GK2 = self.buffers.gather_routing(topk_ids_TK, topk_weights_TK, INVALID_EXPERT_ID)
        k = cfg.top_k
        inputs = ExpertInputs(
            hidden_ND=gathered_GD,
            expert_ids_NK=routing_GK2[:, :k],
            weights_NK=routing_GK2[:, k:].view(torch.float32),
            num_local_experts=self.partition.num_local(ep.rank),
            first_expert=self.partition.first(ep.rank),
        )
        return DispatchResult(AllGatherHandle(id(self), hidden_TD.shape[0], gathered_GD,
                                              int(plan.fingerprint)), inputs)

    def expert_output_buffer(self, handle: AllGatherHandle) -> torch.Tensor:
        """The gathered hidden rows themselves: the experts' partial sums overwrite their input."""
        self._check_handle(handle)
        return handle.gathered

    def combine(self, expert_out_GD: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        self._check_handle(handle)
        check_combine_input(expert_out_GD, handle.gathered.shape[0], self.config)
        return self.buffers.reduce_scatter(expert_out_GD, num_rows=handle.num_tokens)

    def _check_handle(self, handle: AllGatherHandle) -> None:
        if not isinstance(handle, AllGatherHandle) or handle.dispatcher_id != id(self):
            raise ValueError("combine got a handle that this AllGatherDispatcher did not return")
