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
]
