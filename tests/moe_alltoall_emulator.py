"""A CPU/gloo emulator of flashinfer 0.7.2.post1 ``MoeAlltoAll``'s observable semantics.

It lets the FlashInfer dispatcher's own logic (receive layout, local ids, padded rows, in-workspace
combine, idle ranks, handles) run in the CPU dist tests. What it reproduces, from the library's
``moeA2ADispatchKernel`` / ``moeA2ACombineKernel`` / ``moe_a2a_sanitize_expert_ids`` and the
``MoeAlltoAll`` Python class:

- expert ``e`` lives on rank ``compute_target_rank_id(e)`` (contiguous ceil/floor partition);
- each token goes once to each distinct target rank; at the target it lands in row
  ``[source_rank, slot]`` of every payload's ``[ep_size, runtime_max_tokens_per_rank, *]`` receive
  view, slots ``0..recv_count-1`` per source (the kernel takes slots with atomicAdd: any order);
- rows past a source's count are garbage (NaN here) except the sanitized expert ids;
- combine sums, for each local token, the payload rows at its (target rank, slot), unweighted;
  ``payload_in_workspace=True`` requires the workspace view's pointer, like the C++ check;
- the asserts of ``MoeAlltoAll.dispatch`` / ``combine`` (phase, ``runtime_max <= max_num_tokens``,
  ``runtime_max > 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Mapping:
    world_size: int
    rank: int
    gpus_per_node: int
    tp_size: int
    moe_ep_size: int

    @property
    def moe_ep_rank(self) -> int:
        return self.rank


@dataclass
class MnnvlConfig:
    comm_backend: Any


class TorchDistBackend:
    def __init__(self, group=None):
        self.group = group


def _owner(ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    base, rem = num_experts // ep_size, num_experts % ep_size
    split = rem * (base + 1)
    return torch.where(ids < split, ids // (base + 1), rem + (ids - split) // max(base, 1))


class MoeAlltoAll:
    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                 hidden_size=None, mnnvl_config=None):
        self.ep_size, self.ep_rank = mapping.moe_ep_size, mapping.moe_ep_rank
        self.max_num_tokens, self.top_k, self.num_experts = max_num_tokens, top_k, num_experts
        self.workspace_size_per_rank = workspace_size_per_rank
        self.group = mnnvl_config.comm_backend.group
        self._combine_region = None
        self.phase = "idle"
        self.last_in_workspace = None

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.ep_size)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                 invalid_token_expert_id=None, expert_id_payload_index=None):
        assert self.phase == "idle", "dispatch called twice without combine"
        assert 0 < runtime_max_tokens_per_rank <= self.max_num_tokens
        assert token_selected_experts.dtype == torch.int32
        r, p = self.ep_size, runtime_max_tokens_per_rank
        t = token_selected_experts.shape[0]
        owner_TK = _owner(token_selected_experts.long(), self.num_experts, r)
        # slot of token t at target rank j (-1 if j is not a target); token order, first pick wins
        slot_TR = torch.full((t, r), -1, dtype=torch.long)
        counts = [0] * r
        for i in range(t):
            for j in owner_TK[i].tolist():
                if slot_TR[i, j] < 0:
                    slot_TR[i, j] = counts[j]
                    counts[j] += 1
        self._slot_TR = slot_TR
        self._local_num_tokens = t
        sent = self._all_gather(torch.tensor(counts))  # sent[s][j]: rows rank s sends rank j
        recv_counts = [int(sent[s][self.ep_rank]) for s in range(r)]
        outs = []
        for idx, payload in enumerate(input_payloads):
            assert payload.dim() == 2 and payload.shape[0] == t
            garbage = float("nan") if payload.dtype.is_floating_point else 12345
            send = torch.full((r, p, payload.shape[1]), garbage, dtype=payload.dtype)
            for j in range(r):
                rows = (slot_TR[:, j] >= 0).nonzero(as_tuple=True)[0]
                send[j, slot_TR[rows, j]] = payload[rows]
            gathered = self._all_gather(send)
            recv = torch.stack([gathered[s][self.ep_rank] for s in range(r)])
            if invalid_token_expert_id is not None and idx == expert_id_payload_index:
                for s in range(r):
                    recv[s, recv_counts[s]:] = invalid_token_expert_id
            outs.append(recv)
        self._combine_region = torch.empty((r, self.max_num_tokens, input_payloads[0].shape[1]),
                                           dtype=input_payloads[0].dtype)
        self.phase = "dispatched"
        return outs

    def get_combine_payload_tensor_in_workspace(self, runtime_max_tokens_per_rank, hidden_size, dtype):
        assert self.phase == "dispatched"
        n = self.ep_size * runtime_max_tokens_per_rank * hidden_size
        return self._combine_region.view(-1)[:n].view(self.ep_size, runtime_max_tokens_per_rank, hidden_size)

    def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False, output=None):
        assert self.phase == "dispatched", "combine called before successful dispatch"
        r, p = self.ep_size, runtime_max_tokens_per_rank
        assert payload.shape[:2] == (r, p)
        if payload_in_workspace:
            assert payload.data_ptr() == self._combine_region.data_ptr(), "payload_in_workspace pointer mismatch"
        gathered = self._all_gather(payload)
        t, d = self._local_num_tokens, payload.shape[2]
        acc = torch.zeros((t, d), dtype=torch.float32)
        for j in range(r):
            rows = (self._slot_TR[:, j] >= 0).nonzero(as_tuple=True)[0]
            acc[rows] += gathered[j][self.ep_rank, self._slot_TR[rows, j]].float()
        result = acc.to(payload.dtype)
        self.phase = "idle"
        self.last_in_workspace = payload_in_workspace
        if output is not None:
            assert output.shape == (t, d) and output.dtype == payload.dtype
            output.copy_(result)
            return output
        return result
