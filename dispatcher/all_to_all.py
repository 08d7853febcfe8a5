"""All-to-all dispatcher: variable-split ``all_to_all_single`` over torch.distributed.

Dispatch: each token goes ONCE to each distinct rank that owns one of its top-k experts (not once
per expert). The per-destination row counts are exchanged first (one small all-to-all of an
``[R]`` int64 tensor, read back to the host for the splits), then one all-to-all carries packed
rows (hidden + ids + weights, see ``packing``). Combine sends each received row's weighted partial
sum (this rank's experts only) back to the token's rank, which adds the partials in fp32.

The host read of the counts makes this backend eager-only (not CUDA-graph capturable).

Legend: ``T`` local tokens, ``R`` EP ranks, ``S`` rows sent (token, destination) pairs,
``N`` rows received, ``K`` top-k, ``D`` hidden size, ``B`` packed row bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatcher.collectives import all_to_all_rows, exchange_counts
from dispatcher.config import DispatcherConfig
from dispatcher.experts import ExpertInputs
from dispatcher.groups import EPGroup, default_device
from dispatcher.packing import RowLayout
from dispatcher.partition import ExpertPartition
from dispatcher.plan import StepPlanLike
from dispatcher.protocol import DispatchResult
from dispatcher.sizing import all_to_all_buffer_bytes
from dispatcher.startup import FirstStepGuard, warmup_round
from dispatcher.validate import check_combine_input, check_step

__all__ = ["AllToAllDispatcher", "AllToAllHandle"]


@dataclass(frozen=True)
class AllToAllHandle:
    """What combine needs from an all-to-all dispatch: where each sent row came from and the
    split sizes of both directions."""

    dispatcher_id: int
    num_tokens: int
    send_token_idx_S: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    fingerprint: int

    @property
    def num_recv_rows(self) -> int:
        return sum(self.recv_counts)


class AllToAllDispatcher:
    """Dispatch and combine by variable-split all-to-all (see the module docstring)."""

    kind = "all_to_all"

    def __init__(self, config: DispatcherConfig, ep: EPGroup | None = None, *,
                 device: torch.device | str | None = None) -> None:
        """Takes the config, the EP group (default: world size 1) and the device of the hidden
        states (default: CUDA's current device if available, else CPU)."""
        self.config = config
        self.ep = ep if ep is not None else EPGroup.local()
        self.partition = ExpertPartition(config.num_experts, self.ep.size)
        self.device = torch.device(device) if device is not None else default_device()
        self._layout = RowLayout(config.hidden_size, config.top_k, config.dtype)
        self._guard = FirstStepGuard(self.ep, f"{self.kind} dispatcher")

    def workspace_bytes_per_rank(self) -> int:
        c = self.config
        return all_to_all_buffer_bytes(self.ep.size, c.max_tokens_per_rank, c.hidden_size, c.top_k, c.dtype)

    def warmup(self) -> None:
        warmup_round(self, self._guard, self.config.first_step_timeout_s)

    def close(self) -> None:
        pass

    def dispatch(self, hidden_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 plan: StepPlanLike) -> DispatchResult:
        cfg, ep = self.config, self.ep
        check_step(hidden_TD, topk_ids_TK, topk_weights_TK, plan, config=cfg, ep=ep, backend=self.kind)
        self._guard.before_step(plan, self.warmup)
        t, device = hidden_TD.shape[0], hidden_TD.device

        # Distinct destination ranks of each token; nonzero() of the [R, T] mask lists the
        # (rank, token) pairs rank-major, which is the order all_to_all_single sends them in.
        dest_TR = torch.zeros((t, ep.size), dtype=torch.bool, device=device)
        if t > 0:
            dest_TR.scatter_(1, self.partition.owner_of(topk_ids_TK.long()), True)
        _, send_token_idx_S = dest_TR.T.nonzero(as_tuple=True)
        send_counts_R = dest_TR.sum(dim=0)
        recv_counts_R = exchange_counts(send_counts_R, ep)
        send_counts, recv_counts = (tuple(c) for c in torch.stack([send_counts_R, recv_counts_R]).tolist())

        send_SB = self._layout.pack(hidden_TD[send_token_idx_S], topk_ids_TK[send_token_idx_S],
                                    topk_weights_TK[send_token_idx_S])
        recv_NB = self._layout.empty(sum(recv_counts), device)
        all_to_all_rows(recv_NB, send_SB, recv_counts, send_counts, ep)
        hidden_ND, ids_NK, weights_NK = self._layout.views(recv_NB)

        handle = AllToAllHandle(id(self), t, send_token_idx_S, send_counts, recv_counts, int(plan.fingerprint))
        inputs = ExpertInputs(
            hidden_ND=hidden_ND,
            expert_ids_NK=ids_NK,
            weights_NK=weights_NK,
            num_local_experts=self.partition.num_local(ep.rank),
            first_expert=self.partition.first(ep.rank),
        )
        return DispatchResult(handle, inputs)

    def expert_output_buffer(self, handle: AllToAllHandle) -> torch.Tensor:
        self._check_handle(handle)
        return torch.empty((handle.num_recv_rows, self.config.hidden_size), dtype=self.config.dtype,
                           device=self.device)

    def combine(self, expert_out_ND: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        self._check_handle(handle)
        check_combine_input(expert_out_ND, handle.num_recv_rows, self.config)
        d = self.config.hidden_size
        back_SD = expert_out_ND.new_empty((len(handle.send_token_idx_S), d))
        all_to_all_rows(back_SD, expert_out_ND, handle.send_counts, handle.recv_counts, self.ep)
        out_TD = torch.zeros((handle.num_tokens, d), dtype=torch.float32, device=expert_out_ND.device)
        out_TD.index_add_(0, handle.send_token_idx_S, back_SD.float())
        return out_TD.to(self.config.dtype)

    def _check_handle(self, handle: AllToAllHandle) -> None:
        if not isinstance(handle, AllToAllHandle) or handle.dispatcher_id != id(self):
            raise ValueError("combine got a handle that this AllToAllDispatcher did not return")
