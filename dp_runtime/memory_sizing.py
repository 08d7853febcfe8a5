"""Bytes a rank allocates, as pure functions: the runtime sizes with them, the planner predicts
with them (launch/planner.py), so a plan cannot drift from what is allocated.

No function here touches a GPU or reads a file; each takes shapes and returns bytes or counts.
"""

from __future__ import annotations

import torch

from dp_runtime.model.model_config import ModelConfig
from dp_runtime.model.weights import expected_shapes

__all__ = [
    "dtype_bytes",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "kv_slots_for_budget",
    "weight_bytes_per_rank",
]


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes_per_rank(cfg: ModelConfig, dtype: torch.dtype, ep_rank: int = 0, ep_size: int = 1) -> int:
    """Bytes of the weights EP rank ``ep_rank`` holds: every shared tensor plus its experts."""
    total = 0
    for shape in expected_shapes(cfg, ep_rank, ep_size).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total * dtype_bytes(dtype)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


def kv_cache_bytes(cfg: ModelConfig, dtype: torch.dtype, num_slots: int, max_reqs: int, max_context_len: int) -> int:
    """What ``KVCache`` allocates: ``num_slots + 1`` token slots per layer (slot 0 is the padding
    target) and an int32 ``req_to_token`` table of ``max_reqs + 1`` rows (row 0 likewise)."""
    return (num_slots + 1) * kv_bytes_per_token(cfg, dtype) + (max_reqs + 1) * max_context_len * 4


def kv_slots_for_budget(cfg: ModelConfig, dtype: torch.dtype, budget_bytes: int, max_reqs: int,
                        max_context_len: int) -> int:
    """The most token slots whose ``kv_cache_bytes`` fits ``budget_bytes`` (0 when nothing fits)."""
    table = (max_reqs + 1) * max_context_len * 4
    slots = (budget_bytes - table) // kv_bytes_per_token(cfg, dtype) - 1
    return max(0, int(slots))
