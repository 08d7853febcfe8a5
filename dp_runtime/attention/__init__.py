"""Attention backends implementing graph's metadata protocol over the paged KV cache."""

from dp_runtime.attention.backend import AttentionBackend
from dp_runtime.attention.flashinfer_backend import FlashInferBackend, FlashInferMetadata
from dp_runtime.attention.kv_indices import (
    ExtendPlanInputs,
    build_kv_indices,
    extend_plan_inputs,
    host_indptr,
    last_page_len,
)
from dp_runtime.attention.kv_layout import KVLayout, choose_kv_layout
from dp_runtime.attention.torch_sdpa import TorchSDPABackend

__all__ = [
    "AttentionBackend",
    "ExtendPlanInputs",
    "FlashInferBackend",
    "FlashInferMetadata",
    "KVLayout",
    "TorchSDPABackend",
    "build_kv_indices",
    "choose_kv_layout",
    "extend_plan_inputs",
    "host_indptr",
    "last_page_len",
    "make_attention_backend",
]


def make_attention_backend(kind: str, kv_cache, model_config, *, q_dtype=None,
                           check_indices: bool = False):
    """The backend ``kind`` names (``flashinfer`` or ``sdpa``, as ``dp_runtime.choices``
    resolved it) over ``kv_cache``, with the model's head geometry; ``q_dtype``: the model's
    dtype, which FlashInfer plans for (the cache's when None; SDPA reads it off the query)."""
    heads = dict(num_q_heads=model_config.num_heads, num_kv_heads=model_config.num_kv_heads,
                 head_dim=model_config.head_dim)
    if kind == "flashinfer":
        return FlashInferBackend(kv_cache, q_dtype=q_dtype, check_indices=check_indices, **heads)
    return TorchSDPABackend(kv_cache, **heads)
