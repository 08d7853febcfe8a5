"""The dispatcher protocol every backend implements, and ``moe_forward`` built on it.

One MoE layer on one rank::

    handle, inputs = dispatcher.dispatch(hidden_TD, topk_ids_TK, topk_weights_TK, plan)
    out_ND = run_local_experts(inputs, expert_fn, out_ND=dispatcher.expert_output_buffer(handle))
    hidden_TD = dispatcher.combine(out_ND, handle)

``dispatch`` sends each token to the ranks that own its top-k experts and returns an immutable
handle (what combine needs) plus this rank's ``ExpertInputs``. ``combine`` sends each row's
weighted partial sum back to the token's rank and adds the partials: the result is
``sum_k w[t,k] * expert_{id[t,k]}(x[t])`` for every local token. Every EP rank calls both every
step, in the same order, including ranks with zero tokens.

Legend: ``T`` local tokens, ``K`` top-k, ``D`` hidden size, ``N`` expert rows on this rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from dispatcher.config import DispatcherConfig
from dispatcher.experts import ExpertFn, ExpertInputs, run_local_experts
from dispatcher.groups import EPGroup
from dispatcher.partition import ExpertPartition
from dispatcher.plan import StepPlanLike

__all__ = ["DispatchResult", "Dispatcher", "moe_forward"]


class DispatchResult(NamedTuple):
    """What ``dispatch`` returns: the handle for ``combine`` and this rank's expert inputs."""

    handle: Any
    experts: ExpertInputs


@runtime_checkable
class Dispatcher(Protocol):
    """Token dispatch and combine over an EP group (see the module docstring)."""

    kind: str
    # combine returns its input unchanged (one rank): the expert sum's rows are the local
    # tokens' outputs, so a caller may fold the work after combine into the sum's launch.
    combine_is_identity: bool
    config: DispatcherConfig
    ep: EPGroup
    partition: ExpertPartition
    device: torch.device

    def dispatch(self, hidden_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, plan: StepPlanLike) -> DispatchResult:
        """Send tokens to their experts' ranks; returns ``(handle, ExpertInputs)``."""
        ...

    def expert_output_buffer(self, handle: Any) -> torch.Tensor:
        """An ``N x D`` buffer for the expert outputs of this dispatch (FlashInfer: in its
        workspace, so combine skips a copy); valid until ``combine``."""
        ...

    def combine(self, expert_out_ND: torch.Tensor, handle: Any) -> torch.Tensor:
        """Return each local token's summed expert outputs, ``T x D``."""
        ...

    def warmup(self) -> None:
        """Run one tiny dispatch + combine on every rank, with host barriers around it."""
        ...

    def workspace_bytes_per_rank(self) -> int:
        """Bytes this backend needs per rank at ``config.max_tokens_per_rank`` (see sizing)."""
        ...

    def close(self) -> None:
        """Release communication resources (before the process group is destroyed)."""
        ...


def moe_forward(dispatcher: Dispatcher, hidden_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                topk_weights_TK: torch.Tensor, plan: StepPlanLike, expert_fn: ExpertFn, *,
                dense: bool = False) -> torch.Tensor:
    """One MoE layer through ``dispatcher``: dispatch, run this rank's experts, combine.

    Takes the local tokens, their routing, the step plan, this rank's ``expert_fn`` (local ids)
    and the ``run_local_experts`` mode; returns ``T x D``.
    """
    handle, inputs = dispatcher.dispatch(hidden_TD, topk_ids_TK, topk_weights_TK, plan)
    out_ND = run_local_experts(inputs, expert_fn, out_ND=dispatcher.expert_output_buffer(handle),
                               dense=dense)
    return dispatcher.combine(out_ND, handle)
