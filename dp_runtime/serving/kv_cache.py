"""The paged KV cache of one rank (page size 1): a request-to-token table and per-layer pools.

    req_to_token (max_reqs + 1, max_context_len) int32: row r, column i is the KV slot of token
        i of the request in row r.
    k[layer], v[layer] (num_slots + 1, num_kv_heads, head_dim): the K/V of each slot.

Row 0 and slot 0 are reserved as padding targets: padded rows of a graph bucket point at row
0 (whose entries are all slot 0) and write their K/V to slot 0, so they never touch a live
request. The allocator (kv_allocator.py) hands out rows and slots from 1.

The pools hold the model's dtype or FP8 e4m3 (``RuntimeConfig.kv_cache_dtype``). FP8 stores K/V
at scale 1, saturated to the format's largest finite value (+-448): no calibrated scales, as
vLLM and SGLang do for a checkpoint that has none. Readers upcast to the query's dtype.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_KV_MAX", "KVCache", "store_rows", "to_kv_dtype"]

FP8_KV_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: cast to ``dtype``; to FP8, clamped to +-448 first, so an
    outlier saturates (torch's cast would make it NaN on some devices) instead of poisoning
    every later query that reads it."""
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)
    return x.to(dtype)


def store_rows(pool: torch.Tensor, loc: torch.Tensor, x: torch.Tensor) -> None:
    """``pool[loc] = x`` in the pool's dtype (``to_kv_dtype``); ``loc`` int64 slots."""
    x = to_kv_dtype(x, pool.dtype)
    if x.element_size() == 1:  # index_copy_ has no FP8 kernel on CPU: copy the bytes
        pool, x = pool.view(torch.uint8), x.view(torch.uint8)
    pool.index_copy_(0, loc, x)


class KVCache:
    """Storage of the paged KV cache (see the module docstring)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_reqs: int,
        max_context_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_slots", num_slots),
            ("max_reqs", max_reqs),
            ("max_context_len", max_context_len),
        ):
            if value < 1:
                raise ValueError(f"KVCache: {name} must be >= 1, got {value}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_slots = num_slots
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        with torch.inference_mode(False):
            self.req_to_token = torch.zeros(
                (max_reqs + 1, max_context_len), dtype=torch.int32, device=self.device
            )
            shape = (num_slots + 1, num_kv_heads, head_dim)
            self.k = [
                torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
            ]
            self.v = [
                torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
            ]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (T, kv_heads, head_dim) of ``layer`` at slots ``loc`` (T,) int64,
        in the cache's dtype (``to_kv_dtype``)."""
        store_rows(self.k[layer], loc, k)
        store_rows(self.v[layer], loc, v)

    def paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``layer`` as (num_pages, page_size=1, kv_heads, head_dim) views (NHD)."""
        h, d = self.num_kv_heads, self.head_dim
        return self.k[layer].view(-1, 1, h, d), self.v[layer].view(-1, 1, h, d)

    def nbytes(self) -> int:
        per_layer = self.k[0].numel() * self.k[0].element_size() * 2
        return per_layer * self.num_layers + self.req_to_token.numel() * 4
