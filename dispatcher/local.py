"""Local dispatcher: world size 1, every expert on this rank, nothing to exchange.

Dispatch hands the tokens and their routing to the experts as they are (the global ids are the
local ids); combine returns the experts' output. No copy, no collective, no kernel: at DP 1 the
MoE layer is the expert path alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatcher.config import DispatcherConfig
from dispatcher.experts import ExpertInputs
from dispatcher.groups import EPGroup, default_device
from dispatcher.kind import DispatcherKind
from dispatcher.partition import ExpertPartition
from dispatcher.plan import StepPlanLike
from dispatcher.protocol import DispatchResult
from dispatcher.validate import check_combine_input, check_step

__all__ = ["LocalDispatcher", "LocalHandle"]


@dataclass(frozen=True)
class LocalHandle:
    dispatcher_id: int
    num_tokens: int


class LocalDispatcher(DispatcherKind):
    """The identity dispatch of a single rank (see the module docstring)."""

    kind = "local"
    combine_is_identity = True  # combine returns the expert sum it is given
    single_rank = True
    auto_order = 0
    separate_expert_output = True

    @classmethod
    def auto_reason(cls, world_size: int, flashinfer_dispatch: tuple[bool, str],
                    graphs_on_cuda: bool) -> str | None:
        return "auto: world size 1, nothing to exchange" if world_size == 1 else None

    @classmethod
    def expert_rows(cls, dp_size: int, ep_size: int, num_tokens: int) -> int:
        return int(num_tokens)  # its own rows

    def __init__(self, config: DispatcherConfig, ep: EPGroup | None = None, *,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self.ep = ep if ep is not None else EPGroup.local()
        if self.ep.size != 1:
            raise ValueError("the local dispatcher serves one rank; the EP group "
                             f"has {self.ep.size}")
        self.partition = ExpertPartition(config.num_experts, 1)
        self.device = torch.device(device) if device is not None else default_device()

    def workspace_bytes_per_rank(self) -> int:
        return 0

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        pass

    def dispatch(self, hidden_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, plan: StepPlanLike) -> DispatchResult:
        check_step(hidden_TD, topk_ids_TK, topk_weights_TK, plan, config=self.config, ep=self.ep,
                   backend=self.kind, padding_ids=True)
        # Every id is local: the conversion the other backends need is the identity here.
        inputs = ExpertInputs(hidden_ND=hidden_TD, expert_ids_NK=topk_ids_TK,
                              weights_NK=topk_weights_TK, num_local_experts=self.config.num_experts,
                              first_expert=0, given_local_ids_NK=topk_ids_TK)
        return DispatchResult(LocalHandle(id(self), hidden_TD.shape[0]), inputs)

    def expert_output_buffer(self, handle: LocalHandle) -> torch.Tensor:
        self._check_handle(handle)
        return torch.empty((handle.num_tokens, self.config.hidden_size), dtype=self.config.dtype,
                           device=self.device)

    def combine(self, expert_out_TD: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        self._check_handle(handle)
        check_combine_input(expert_out_TD, handle.num_tokens, self.config)
        return expert_out_TD

    def _check_handle(self, handle: LocalHandle) -> None:
        if not isinstance(handle, LocalHandle) or handle.dispatcher_id != id(self):
            raise ValueError("combine got a handle that this LocalDispatcher did not return")
