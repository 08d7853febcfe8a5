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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dispatcher.config import DispatcherConfig
from dispatcher.experts import ExpertInputs
from dispatcher.groups import EPGroup, default_device
from dispatcher.kind import DispatcherKind
from dispatcher.partition import ExpertPartition
from dispatcher.plan import StepPlanLike
from dispatcher.protocol import DispatchResult
from dispatcher.sizing import all_to_all_buffer_bytes, dtype_bytes
from dispatcher.startup import FirstStepGuard, warmup_round
from dispatcher.validate import check_combine_input, check_step

__all__ = ["AllToAllDispatcher", "AllToAllHandle", "RowLayout"]


# -- packed rows: a token's hidden row and routing in one byte row, so one collective carries both.
# Row layout (bytes): [ids: K x int32 | weights: K x fp32 | hidden: D x dtype | pad to 16]. Routing
# goes first so every field starts at an offset its dtype divides, whatever D; the row length is a
# multiple of 16 so dtype views of a [S, B] byte tensor are legal.
_ROW_ALIGN = 16


@dataclass(frozen=True)
class RowLayout:
    """Byte layout of a packed row for ``hidden_size`` in ``dtype`` and ``top_k`` picks."""

    hidden_size: int
    top_k: int
    dtype: torch.dtype

    @property
    def hidden_offset(self) -> int:
        return 8 * self.top_k

    @property
    def row_bytes(self) -> int:
        raw = self.hidden_offset + self.hidden_size * dtype_bytes(self.dtype)
        return (raw + _ROW_ALIGN - 1) // _ROW_ALIGN * _ROW_ALIGN

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        """An uninitialized ``[rows, B]`` uint8 buffer."""
        return torch.empty((rows, self.row_bytes), dtype=torch.uint8, device=device)

    def views(self, rows_SB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Typed views ``(hidden_SD, ids_SK int32, weights_SK fp32)`` into packed rows."""
        k, off = self.top_k, self.hidden_offset
        end = off + self.hidden_size * dtype_bytes(self.dtype)
        ids_SK = rows_SB[:, : 4 * k].view(torch.int32)
        weights_SK = rows_SB[:, 4 * k: off].view(torch.float32)
        hidden_SD = rows_SB[:, off:end].view(self.dtype)
        return hidden_SD, ids_SK, weights_SK

    def pack(self, hidden_SD: torch.Tensor, ids_SK: torch.Tensor,
             weights_SK: torch.Tensor) -> torch.Tensor:
        """New ``[S, B]`` uint8 rows holding the given hidden rows, ids and weights."""
        rows_SB = self.empty(hidden_SD.shape[0], hidden_SD.device)
        h, i, w = self.views(rows_SB)
        h.copy_(hidden_SD)
        i.copy_(ids_SK)
        w.copy_(weights_SK)
        return rows_SB


# -- row collectives over the EP group (world size 1: a copy)
def all_to_all_rows(out_NX: torch.Tensor, src_SX: torch.Tensor, out_splits: Sequence[int],
                    in_splits: Sequence[int], ep: EPGroup) -> None:
    """Variable-split all-to-all of rows: ``in_splits[r]`` rows of ``src_SX`` go to rank ``r``,
    ``out_splits[r]`` rows arrive from rank ``r`` (both rank-major)."""
    if not ep.distributed:
        out_NX.copy_(src_SX)
        return
    dist.all_to_all_single(out_NX, src_SX.contiguous(), list(out_splits), list(in_splits),
                           group=ep.group)


def exchange_counts(send_counts_R: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """Each rank's row count for this rank: one small all-to-all of an int64 ``[R]`` tensor."""
    if not ep.distributed:
        return send_counts_R.clone()
    recv_counts_R = torch.empty_like(send_counts_R)
    dist.all_to_all_single(recv_counts_R, send_counts_R.contiguous(), group=ep.group)
    return recv_counts_R


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


class AllToAllDispatcher(DispatcherKind):
    """Dispatch and combine by variable-split all-to-all (see the module docstring)."""

    kind = "all_to_all"
    combine_is_identity = False
    capturable = False  # it reads its split sizes on the host: no CUDA graph can hold it
    separate_expert_output = True
    transient_workspace = True  # its buffers are allocated per step, at the step's size
    auto_order = 3

    @classmethod
    def auto_reason(cls, world_size: int, flashinfer_dispatch: tuple[bool, str],
                    graphs_on_cuda: bool) -> str | None:
        return f"auto: {flashinfer_dispatch[1]}"  # the last resort: runs anywhere, eagerly

    @classmethod
    def workspace_bytes(cls, ep_size: int, max_tokens_per_rank: int, hidden_size: int, top_k: int,
                        dtype: torch.dtype) -> int:
        return all_to_all_buffer_bytes(ep_size, max_tokens_per_rank, hidden_size, top_k, dtype)

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
        return all_to_all_buffer_bytes(self.ep.size, c.max_tokens_per_rank, c.hidden_size, c.top_k,
                                       c.dtype)

    def warmup(self) -> None:
        warmup_round(self, self._guard, self.config.first_step_timeout_s)

    def close(self) -> None:
        pass

    def dispatch(self, hidden_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, plan: StepPlanLike) -> DispatchResult:
        cfg, ep = self.config, self.ep
        check_step(hidden_TD, topk_ids_TK, topk_weights_TK, plan, config=cfg, ep=ep,
                   backend=self.kind)
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
        send_counts, recv_counts = (tuple(c)
                                    for c in torch.stack([send_counts_R, recv_counts_R]).tolist())

        send_SB = self._layout.pack(hidden_TD[send_token_idx_S], topk_ids_TK[send_token_idx_S],
                                    topk_weights_TK[send_token_idx_S])
        recv_NB = self._layout.empty(sum(recv_counts), device)
        all_to_all_rows(recv_NB, send_SB, recv_counts, send_counts, ep)
        hidden_ND, ids_NK, weights_NK = self._layout.views(recv_NB)

        handle = AllToAllHandle(id(self), t, send_token_idx_S, send_counts, recv_counts,
                                int(plan.fingerprint))
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
        out_TD = torch.zeros((handle.num_tokens, d), dtype=torch.float32,
                             device=expert_out_ND.device)
        out_TD.index_add_(0, handle.send_token_idx_S, back_SD.float())
        return out_TD.to(self.config.dtype)

    def _check_handle(self, handle: AllToAllHandle) -> None:
        if not isinstance(handle, AllToAllHandle) or handle.dispatcher_id != id(self):
            raise ValueError("combine got a handle that this AllToAllDispatcher did not return")
