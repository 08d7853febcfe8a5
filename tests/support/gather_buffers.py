"""A rank's DP buffer service for dispatcher tests and benchmarks, sized from a DispatcherConfig,
and the MAX_LEN / SUM_LEN layout of a step, as the rank worker's set_dp_buffer_len gives it."""

from __future__ import annotations

from typing import Any

import torch

from buffers import BufferPool
from dispatcher import DispatcherConfig, EPGroup
from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.dp_buffer import DPBufferService


def gather_buffers(cfg: DispatcherConfig, ep: EPGroup, device: torch.device | str = "cpu") -> DPBufferService:
    """The service an all-gather dispatcher of ``cfg`` on ``ep`` gathers through."""
    rt = RuntimeConfig(dp_size=ep.size, ep_size=ep.size, hidden_size=cfg.hidden_size, dtype=cfg.dtype,
                       device=str(device), chunked_prefill_size=cfg.max_tokens_per_rank,
                       max_running_requests=min(cfg.max_tokens_per_rank, 256), cuda_graph_max_bs=0,
                       cuda_graph_bs=())
    return DPBufferService(rt, BufferPool(), ep.rank, group=ep.group if ep.distributed else None,
                           device=device, routing_top_k=cfg.top_k)


def lay_out(buffers: Any, plan: Any, *, sum_len: bool = False) -> None:
    """``set_dp_buffer_len`` for a dispatcher plan: MAX_LEN slots of
    ``plan.runtime_max_tokens_per_rank`` rows, or SUM_LEN live rows."""
    counts = tuple(plan.global_num_tokens_cpu)
    if sum_len:
        buffers.set_dp_buffer_len(sum(counts), counts[buffers.rank], False, counts)
    else:
        p = int(plan.runtime_max_tokens_per_rank)
        buffers.set_dp_buffer_len(p * len(counts), p, True, counts)
