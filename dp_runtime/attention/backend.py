"""The attention backend a model calls: graph's metadata protocol plus the forward itself."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from graph.attention_protocol import AttentionMetadataBackend

__all__ = ["AttentionBackend"]


@runtime_checkable
class AttentionBackend(AttentionMetadataBackend, Protocol):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Any
    ) -> torch.Tensor:
        """Write this step's ``k``/``v`` (T, kv_heads, D) at ``batch.out_cache_loc`` and attend
        ``q`` (T, q_heads, D) with the metadata of the last ``init_forward_metadata*`` call.
        Returns (T, q_heads * D)."""
        ...
