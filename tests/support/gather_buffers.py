"""A rank's DP buffer service for dispatcher tests and benchmarks, sized from a DispatcherConfig.
The all-gather dispatcher lays it out from the plan of each dispatch (``FixedPlan.is_max_len``
picks MAX_LEN or SUM_LEN)."""

from __future__ import annotations

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

