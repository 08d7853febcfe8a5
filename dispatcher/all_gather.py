"""All-gather dispatcher: every rank sees every token, runs its experts, reduce-scatters back.

Dispatch gathers each DP rank's hidden rows and routing into a rank-major buffer of
``R * P`` rows (rank ``r``'s tokens at rows ``[r*P, r*P + n_r)``, padded to
``P = plan.runtime_max_tokens_per_rank``; padded rows carry invalid expert ids). Each rank runs its
experts on the rows routed to them; other rows contribute zero. Combine sums the ranks' partial
outputs and gives each rank its own rows back.

The gathered hidden buffer can come from the caller (``gathered_buffer``, e.g. the DP buffer
service's), and the gather itself too (``gather_fn(local_TD, out_ND, plan)``, which must produce the
rank-major layout above). Routing is gathered separately as packed int32 rows.

Combine on CUDA is one ``reduce_scatter`` over the padded ``R*P`` rows (fixed shape, CUDA-graph
capturable). On CPU it is an all-to-all that sends rank ``r`` only its ``n_r`` live rows of the
partial output, followed by a local fp32 sum over the ``R`` received blocks. Why all-to-all rather
than all-reduce + slice: gloo has no reduce-scatter in older torch releases; all-reduce would move
about twice the whole ``R*P x D`` buffer per rank (and sum padding), while the all-to-all moves only
the live rows each peer needs, and the local sum runs in a fixed rank order (deterministic).

Legend: ``T`` local tokens, ``P`` padded rows per rank, ``R`` EP ranks, ``N = R*P`` gathered rows,
``K`` top-k, ``D`` hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dispatcher.collectives import all_gather_rows, all_to_all_rows, reduce_scatter_rows
from dispatcher.config import DispatcherConfig
from dispatcher.experts import ExpertInputs
from dispatcher.groups import EPGroup, default_device
from dispatcher.partition import INVALID_EXPERT_ID, ExpertPartition
from dispatcher.plan import StepPlanLike
from dispatcher.protocol import DispatchResult
from dispatcher.sizing import all_gather_buffer_bytes
from dispatcher.startup import FirstStepGuard, warmup_round
from dispatcher.validate import check_combine_input, check_step

__all__ = ["AllGatherDispatcher", "AllGatherHandle", "GatherFn"]

GatherFn = Callable[[torch.Tensor, torch.Tensor, StepPlanLike], None]
"""``gather_fn(local_TD, out_ND, plan)``: write every rank's rows into ``out_ND`` rank-major,
rank ``r`` at rows ``[r*P, r*P + n_r)`` with ``P = plan.runtime_max_tokens_per_rank``."""


@dataclass(frozen=True)
class AllGatherHandle:
    """What combine needs from an all-gather dispatch."""

    dispatcher_id: int
    num_tokens: int
    padded_tokens: int
    global_num_tokens: tuple[int, ...]
    fingerprint: int


class AllGatherDispatcher:
    """Dispatch by all-gather, combine by reduce-scatter (see the module docstring)."""

    kind = "all_gather"

    def __init__(self, config: DispatcherConfig, ep: EPGroup | None = None, *,
                 device: torch.device | str | None = None, gathered_buffer: torch.Tensor | None = None,
                 gather_fn: GatherFn | None = None) -> None:
        """Takes the config, the EP group (default: world size 1), the device of the hidden states
        (default: CUDA's current device if available, else CPU), an optional caller-owned gathered
        buffer (``>= ep_size * max_tokens_per_rank`` rows of ``hidden_size``, config dtype) and an
        optional gather function."""
        self.config = config
        self.ep = ep if ep is not None else EPGroup.local()
        self.partition = ExpertPartition(config.num_experts, self.ep.size)
        self.device = torch.device(device) if device is not None else default_device()
        rows = self.ep.size * config.max_tokens_per_rank
        if gathered_buffer is not None and (
                gathered_buffer.dim() != 2 or gathered_buffer.shape[0] < rows
                or gathered_buffer.shape[1] != config.hidden_size or gathered_buffer.dtype != config.dtype
                or gathered_buffer.device != self.device):
            raise ValueError(
                f"gathered_buffer must be [>= {rows}, {config.hidden_size}] {config.dtype} on {self.device} "
                f"(ep_size x max_tokens_per_rank rows), got {tuple(gathered_buffer.shape)} "
                f"{gathered_buffer.dtype} on {gathered_buffer.device}"
            )
        self._gathered_buffer = gathered_buffer
        self._gather_fn = gather_fn
        self._guard = FirstStepGuard(self.ep, f"{self.kind} dispatcher")

    def workspace_bytes_per_rank(self) -> int:
        c = self.config
        return all_gather_buffer_bytes(self.ep.size, c.max_tokens_per_rank, c.hidden_size, c.top_k, c.dtype)

    def warmup(self) -> None:
        warmup_round(self, self._guard, self.config.first_step_timeout_s)

    def close(self) -> None:
        self._gathered_buffer = None

    def dispatch(self, hidden_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 plan: StepPlanLike) -> DispatchResult:
        cfg, ep = self.config, self.ep
        check_step(hidden_TD, topk_ids_TK, topk_weights_TK, plan, config=cfg, ep=ep, backend=self.kind)
        self._guard.before_step(plan, self.warmup)
        t, p, k = hidden_TD.shape[0], int(plan.runtime_max_tokens_per_rank), cfg.top_k
        n = ep.size * p
        handle = AllGatherHandle(id(self), t, p, tuple(plan.global_num_tokens_cpu), int(plan.fingerprint))

        gathered_ND = (self._gathered_buffer[:n] if self._gathered_buffer is not None
                       else torch.empty((n, cfg.hidden_size), dtype=cfg.dtype, device=hidden_TD.device))
        if n > 0 and self._gather_fn is not None:
            self._gather_fn(hidden_TD, gathered_ND, plan)
        elif n > 0:
            all_gather_rows(gathered_ND, _pad_rows(hidden_TD, p, 0), ep)

        # Routing travels as int32 rows [ids | weights bit-cast]; padded rows get invalid ids.
        routing_PK2 = torch.empty((p, 2 * k), dtype=torch.int32, device=hidden_TD.device)
        routing_PK2[:t, :k] = topk_ids_TK
        routing_PK2[:t, k:] = topk_weights_TK.float().view(torch.int32)
        routing_PK2[t:, :k] = INVALID_EXPERT_ID
        routing_PK2[t:, k:] = 0
        routing_NK2 = torch.empty((n, 2 * k), dtype=torch.int32, device=hidden_TD.device)
        if n > 0:
            all_gather_rows(routing_NK2, routing_PK2, ep)
        ids_NK = routing_NK2[:, :k]
        inputs = ExpertInputs(
            hidden_ND=gathered_ND,
            expert_ids_NK=ids_NK,
            weights_NK=routing_NK2[:, k:].view(torch.float32),
            num_local_experts=self.partition.num_local(ep.rank),
            first_expert=self.partition.first(ep.rank),
        )
        return DispatchResult(handle, inputs)

    def expert_output_buffer(self, handle: AllGatherHandle) -> torch.Tensor:
        self._check_handle(handle)
        n = self.ep.size * handle.padded_tokens
        return torch.empty((n, self.config.hidden_size), dtype=self.config.dtype, device=self.device)

    def combine(self, expert_out_ND: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        self._check_handle(handle)
        ep, p, t = self.ep, handle.padded_tokens, handle.num_tokens
        check_combine_input(expert_out_ND, ep.size * p, self.config)
        d = self.config.hidden_size
        if p == 0:
            return expert_out_ND.new_empty((0, d))
        if not ep.distributed:
            return expert_out_ND[:t].clone()
        if expert_out_ND.is_cuda:
            out_PD = expert_out_ND.new_empty((p, d))
            reduce_scatter_rows(out_PD, expert_out_ND, ep)
            return out_PD[:t]
        # CPU: send rank r its n_r live rows of my partial outputs; sum what the ranks send me.
        counts = handle.global_num_tokens
        send_SD = torch.cat([expert_out_ND[r * p: r * p + counts[r]] for r in range(ep.size)])
        recv_RTD = expert_out_ND.new_empty((ep.size, t, d))
        all_to_all_rows(recv_RTD.view(ep.size * t, d), send_SD, [t] * ep.size, counts, ep)
        return recv_RTD.float().sum(dim=0).to(self.config.dtype)

    def _check_handle(self, handle: AllGatherHandle) -> None:
        if not isinstance(handle, AllGatherHandle) or handle.dispatcher_id != id(self):
            raise ValueError("combine got a handle that this AllGatherDispatcher did not return")


def _pad_rows(x_TD: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """``x_TD`` padded to ``rows`` rows with ``fill`` (no copy when it already has them)."""
    if x_TD.shape[0] == rows:
        return x_TD.contiguous()
    out = x_TD.new_empty((rows, *x_TD.shape[1:]))
    out[: x_TD.shape[0]] = x_TD
    out[x_TD.shape[0]:] = fill
    return out
