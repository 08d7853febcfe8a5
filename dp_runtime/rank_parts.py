"""Parts a RankWorker is built from, each from the spec and the rank's groups alone: the MoE
exchange (the dispatcher, with the DP buffer service it gathers through when it gathers) and the
model with this EP rank's experts."""

from __future__ import annotations

from typing import Any

import torch

from buffers import BufferPool
from dispatcher import DispatcherConfig, EPGroup, make_dispatcher
from dp_runtime import memory_sizing
from dp_runtime.model.qwen3_moe import Qwen3MoeModel
from dp_runtime.model.weights import iter_checkpoint, iter_random
from dp_runtime.sync.dp_buffer import DPBufferService

__all__ = ["build_moe_exchange", "load_model"]


def build_moe_exchange(spec: Any, rank: int, device_group: Any, ep: EPGroup, kind: str,
                       pool: BufferPool, device: torch.device) -> Any:
    """The dispatcher of ``kind`` (resolved). One that gathers (all_gather) gets the rank's DP
    buffer service, storage from ``pool``, as its own: it is the service's one user and lays it
    out from each forward's plan. The others have no gathered storage and no layout to keep."""
    cfg, mc = spec.runtime, spec.model_config()
    dcfg = DispatcherConfig(
        num_experts=mc.num_experts, top_k=mc.top_k, hidden_size=mc.hidden_size, dtype=cfg.dtype,
        max_tokens_per_rank=cfg.max_tokens_per_rank,
        check_expert_ids=False,  # the router's top-k ids are in range by construction
    )
    extra = {}
    if memory_sizing.dispatcher_gathers(kind):
        extra["buffers"] = DPBufferService(cfg, pool, rank, group=device_group, device=device,
                                           routing_top_k=mc.top_k)
    return make_dispatcher(kind, dcfg, ep=ep, device=device, **extra)


def load_model(spec: Any, ep: EPGroup, dispatcher: Any, device: torch.device) -> Qwen3MoeModel:
    """The model with EP rank ``ep.rank``'s experts: random weights for a preset (seeded by
    ``spec.seed``), else the checkpoint's (each rank reads only its experts)."""
    cfg, mc = spec.runtime, spec.model_config()
    if spec.is_preset:
        weights = iter_random(mc, ep.rank, ep.size, cfg.dtype, device, spec.seed)
    else:
        weights = iter_checkpoint(spec.model, mc, ep.rank, ep.size, cfg.dtype, device)
    return Qwen3MoeModel(mc, weights, attention=None, dispatcher=dispatcher, dtype=cfg.dtype,
                         device=device)
