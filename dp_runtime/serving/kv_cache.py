"""The paged KV cache of one rank (page size 1): a request-to-token table and per-layer pools.

    req_to_token (max_reqs + 1, max_context_len) int32: row r, column i is the KV slot of token
        i of the request in row r.
    k[layer], v[layer] (num_slots + 1, num_kv_heads, head_dim): the K/V of each slot.

Row 0 and slot 0 are reserved as padding targets: padded rows of a graph bucket point at row
0 (whose entries are all slot 0) and write their K/V to slot 0, so they never touch a live
request. The allocator (kv_allocator.py) hands out rows and slots from 1.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


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
        """Write ``k``/``v`` (T, kv_heads, head_dim) of ``layer`` at slots ``loc`` (T,) int64."""
        self.k[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v[layer].index_copy_(0, loc, v.to(self.dtype))

    def paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``layer`` as (num_pages, page_size=1, kv_heads, head_dim) views (NHD)."""
        h, d = self.num_kv_heads, self.head_dim
        return self.k[layer].view(-1, 1, h, d), self.v[layer].view(-1, 1, h, d)

    def nbytes(self) -> int:
        per_layer = self.k[0].numel() * self.k[0].element_size() * 2
        return per_layer * self.num_layers + self.req_to_token.numel() * 4
