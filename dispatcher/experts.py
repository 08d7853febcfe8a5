"""The local experts' side of a dispatch: their inputs, a reference runner, and a SwiGLU expert.

The dispatcher knows no model: the caller supplies an expert function
``expert_fn(x_MD, local_expert_id) -> y_MD`` (``SwiGLUExperts`` is one), and
``run_local_experts`` applies it to the rows routed to this rank and returns, per row, the
weighted sum over the row's top-k picks that this rank serves. Combine then adds the partial sums
of all ranks.

Legend: ``T`` local tokens, ``N`` rows received for this rank's experts, ``M`` rows routed to one
expert, ``K`` top-k, ``D`` hidden size, ``I`` expert intermediate size, ``E`` experts (global),
``L`` experts on this rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dispatcher.partition import ExpertPartition

__all__ = ["ExpertFn", "ExpertInputs", "SwiGLUExperts", "reference_moe", "run_local_experts"]

ExpertFn = Callable[[torch.Tensor, int], torch.Tensor]
"""``expert_fn(x_MD, local_expert_id) -> y_MD``: one expert applied to the rows routed to it."""


@dataclass(frozen=True)
class ExpertInputs:
    """What a dispatch hands to this rank's experts.

    - ``hidden_ND``: received rows (may be a view into a communication workspace; may include
      padded rows, whose picks are all invalid).
    - ``expert_ids_NK``: the global expert id of each pick as received (padded rows carry
      ``partition.INVALID_EXPERT_ID``).
    - ``local_expert_ids_NK`` (computed on first use, then cached): int32 rank-local expert id of
      each pick, or ``INVALID_EXPERT_ID`` (-1, never a local id) where the pick is another rank's
      expert or the row is padding. Lazy because dispatch itself never needs it: the conversion
      is the experts' work, as with a raw MoeAlltoAll, and costs five small kernels.
    - ``shifted_expert_ids_NK``: ``expert_ids_NK - first_expert`` (the given local ids where a
      dispatcher has them): the local id of each own pick and some id outside [0, L) for every
      other, for expert kernels that skip such ids themselves (the model's): no remap kernels.
    - ``weights_NK``: fp32 routing weight of each pick (meaningless where the id is invalid).
    - ``num_local_experts``: ``L``; ``first_expert``: global id of local expert 0.

    Valid until the matching ``combine``: FlashInfer's tensors are views into its workspace, which
    the next dispatch overwrites.
    """

    hidden_ND: torch.Tensor
    expert_ids_NK: torch.Tensor
    weights_NK: torch.Tensor
    num_local_experts: int
    first_expert: int
    # Set by a dispatcher that already holds the local ids (the local one: they are the ids).
    given_local_ids_NK: torch.Tensor | None = None

    @functools.cached_property
    def local_expert_ids_NK(self) -> torch.Tensor:
        if self.given_local_ids_NK is not None:
            return self.given_local_ids_NK
        return ExpertPartition.local_ids_of(self.expert_ids_NK, self.first_expert,
                                            self.num_local_experts)

    @property
    def shifted_expert_ids_NK(self) -> torch.Tensor:
        if self.given_local_ids_NK is not None:
            return self.given_local_ids_NK
        return (self.expert_ids_NK if self.first_expert == 0
                else self.expert_ids_NK - self.first_expert)

    @property
    def num_rows(self) -> int:
        return self.hidden_ND.shape[0]


def run_local_experts(inputs: ExpertInputs, expert_fn: ExpertFn, *,
                      out_ND: torch.Tensor | None = None, dense: bool = False) -> torch.Tensor:
    """Weighted sum of this rank's experts over each received row.

    Takes the dispatch's ``ExpertInputs``, an expert function, an optional output buffer (e.g. the
    dispatcher's ``expert_output_buffer(handle)``, which for FlashInfer lies in the workspace and
    saves a copy at combine) and the mode; returns ``out_ND`` (``N x D``, hidden dtype) with
    ``out[n] = sum_k w[n,k] * expert_fn(x[n], id[n,k])`` over the valid picks and zeros elsewhere.
    Accumulates in fp32.

    ``dense=False`` runs each expert on its routed rows only (reads the routing to the host: not
    capturable in a CUDA graph). ``dense=True`` runs every local expert on every row and masks the
    weights: ``L`` times the compute, no host sync, capturable if ``expert_fn`` is.
    """
    x_ND = inputs.hidden_ND
    n, d = x_ND.shape
    if out_ND is None:
        out_ND = torch.empty((n, d), dtype=x_ND.dtype, device=x_ND.device)
    elif out_ND.shape != (n, d) or out_ND.dtype != x_ND.dtype:
        raise ValueError(f"out_ND must be {(n, d)} {x_ND.dtype}, "
                         f"got {tuple(out_ND.shape)} {out_ND.dtype}")
    acc_ND = torch.zeros((n, d), dtype=torch.float32, device=x_ND.device)
    ids_NK = inputs.local_expert_ids_NK
    w_NK = inputs.weights_NK.float()
    for e in range(inputs.num_local_experts):
        hit_NK = ids_NK == e
        if dense:
            w_N = torch.where(hit_NK, w_NK, 0.0).sum(dim=1)
            y_ND = expert_fn(x_ND, e).float()
            # where, not multiply: padded rows may hold garbage (NaN) that 0 * NaN would spread.
            acc_ND += torch.where(hit_NK.any(dim=1, keepdim=True), w_N[:, None] * y_ND, 0.0)
        else:
            rows_M, slots_M = hit_NK.nonzero(as_tuple=True)
            if rows_M.numel() == 0:
                continue
            y_MD = expert_fn(x_ND[rows_M], e).float()
            acc_ND.index_add_(0, rows_M, y_MD * w_NK[rows_M, slots_M][:, None])
    out_ND.copy_(acc_ND)
    return out_ND


@dataclass(frozen=True)
class SwiGLUExperts:
    """A stack of SwiGLU experts, ``y = (silu(x @ gate.T) * (x @ up.T)) @ down.T``.

    ``gate_up_E2ID`` holds gate rows ``[:I]`` and up rows ``[I:]``; ``down_EDI`` the down
    projections. Callable as an ``ExpertFn`` (the expert id indexes the stack).
    """

    gate_up_E2ID: torch.Tensor
    down_EDI: torch.Tensor

    @classmethod
    def random(cls, num_experts: int, hidden_size: int, intermediate_size: int, *,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               seed: int = 0) -> SwiGLUExperts:
        """Experts with seeded random weights (the same on every rank for the same seed)."""
        g = torch.Generator().manual_seed(seed)
        gate_up = (torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=g)
                   / hidden_size**0.5)
        down = (torch.randn(num_experts, hidden_size, intermediate_size, generator=g)
                / intermediate_size**0.5)
        return cls(gate_up.to(device=device, dtype=dtype), down.to(device=device, dtype=dtype))

    @property
    def num_experts(self) -> int:
        return self.gate_up_E2ID.shape[0]

    def local(self, partition: ExpertPartition, rank: int) -> SwiGLUExperts:
        """The experts rank ``rank`` owns (views, local ids ``0..L-1``)."""
        first, count = partition.first(rank), partition.num_local(rank)
        return SwiGLUExperts(self.gate_up_E2ID[first:first + count],
                             self.down_EDI[first:first + count])

    def __call__(self, x_MD: torch.Tensor, expert_id: int) -> torch.Tensor:
        gate_up_MI2 = x_MD @ self.gate_up_E2ID[expert_id].T
        gate_MI, up_MI = gate_up_MI2.chunk(2, dim=-1)
        return (F.silu(gate_MI) * up_MI) @ self.down_EDI[expert_id].T


def reference_moe(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  expert_fn: ExpertFn, num_experts: int) -> torch.Tensor:
    """The MoE output computed locally, for tests: every expert on every token, then the weighted
    gather. Takes global expert ids and an ``expert_fn`` over global ids; returns ``T x D`` in
    ``x_TD``'s dtype (accumulated in fp32)."""
    t, d = x_TD.shape
    if t == 0:
        return x_TD.new_zeros((0, d))
    y_ETD = torch.stack([expert_fn(x_TD, e).float() for e in range(num_experts)])
    ids_TK = topk_ids_TK.long()
    if ((ids_TK < 0) | (ids_TK >= num_experts)).any():
        raise ValueError("reference_moe: expert ids out of range")
    picked_TKD = y_ETD[ids_TK, torch.arange(t, device=x_TD.device)[:, None]]
    out_TD = (picked_TKD * topk_weights_TK.float()[:, :, None]).sum(dim=1)
    return out_TD.to(x_TD.dtype)

