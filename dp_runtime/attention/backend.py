"""The attention backend a model calls: graph's metadata protocol plus the forward itself."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from graph.attention_protocol import AttentionMetadataBackend

__all__ = ["FLASHINFER_HEAD_DIMS", "AttentionBackend", "flashinfer_unsupported",
           "import_flashinfer"]

# FlashInfer builds its attention kernels for 16-bit K/V and these head dims only.
FLASHINFER_HEAD_DIMS = (64, 128, 256)


@runtime_checkable
class AttentionBackend(AttentionMetadataBackend, Protocol):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend ``q`` (T, q_heads, D) with the metadata of the last ``init_forward_metadata*``
        call, over the backend's ``kv_cache``, which already holds this step's ``k``/``v``
        (T, kv_heads, D) at ``batch.out_cache_loc``: the model wrote them (its attention block
        is the cache's one writer); a ragged pass may read ``k``/``v`` as given. Never writes the
        cache. Returns (T, q_heads * D): ``out`` when given (contiguous, q's dtype), written in
        place."""
        ...


def flashinfer_unsupported(device_type: str, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Why FlashInfer attention cannot run this geometry (empty when it can). Shared by the rank
    worker's "auto" choice and the planner, so both pick the same backend."""
    reasons = []
    if device_type != "cuda":
        reasons.append(f"device {device_type} is not CUDA")
    if dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"dtype {dtype} is not bf16/fp16")
    if head_dim not in FLASHINFER_HEAD_DIMS:
        reasons.append(f"head_dim {head_dim} is not one of {FLASHINFER_HEAD_DIMS}")
    return reasons


def import_flashinfer() -> Any:
    """The flashinfer module, or an ImportError saying which package provides it."""
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "FlashInferBackend needs flashinfer-python (pip install 'dp-runtime[gpu]')") from e
    return flashinfer
