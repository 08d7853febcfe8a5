"""Byte sizes of the dispatchers' buffers: pure functions, importable without a GPU or FlashInfer.

The runtime (which allocates) and the capacity planner (which predicts) call the same functions,
so the plan cannot drift from what is allocated.

Names: ``R`` = ep_size (ranks in the EP group), ``P`` = max tokens per rank, ``D`` = hidden size,
``K`` = top_k.

FlashInfer MoeAlltoAll workspace (flashinfer-python 0.7.2.post1), mirrored exactly from
``flashinfer/comm/trtllm_moe_alltoall.py::moe_a2a_get_workspace_size_per_rank``::

    pad_up(aux_data_size, 128)
    + pad_up(ep_size * max_num_tokens * total_dispatch_payload_size_per_token, 128)
    + pad_up(ep_size * max_num_tokens * combine_payload_size_per_token, 128)

where ``aux_data_size`` is ``getMoeA2AAuxDataSize`` -> ``calculateOffsets(...)
[PAYLOAD_DATA_OFFSET_INDEX]`` in ``csrc/trtllm_moe_alltoall.cu`` (mirrored by
``flashinfer_aux_bytes``). ``max_num_tokens`` there is the per-rank maximum: the library multiplies
by ``ep_size`` itself, so the caller must NOT pass ``ep_size * max_tokens_per_rank`` (upstream once
did, and allocated ``ep_size``-squared workspaces).
"""

from __future__ import annotations

import torch

__all__ = [
    "FLASHINFER_ALIGNMENT",
    "FLASHINFER_MAX_RANKS",
    "FLASHINFER_MAX_TOP_K",
    "all_to_all_buffer_bytes",
    "dtype_bytes",
    "flashinfer_aux_bytes",
    "flashinfer_combine_bytes_per_token",
    "flashinfer_dispatch_bytes_per_token",
    "flashinfer_workspace_bytes_per_rank",
    "flashinfer_workspace_bytes_total",
    "max_tokens_per_rank",
    "routing_bytes_per_token",
]

# csrc/trtllm_moe_alltoall.cu: kCachelineAlignment; the Python size function pads with 128 too.
FLASHINFER_ALIGNMENT = 128
# moeAlltoAllKernels.h: kMaxTopK (the aux region reserves this many slots per token, whatever K is).
FLASHINFER_MAX_TOP_K = 22
# moeAlltoAllKernels.h: kMaxRanks.
FLASHINFER_MAX_RANKS = 64
_INT32 = 4


def _pad_up(x: int, align: int) -> int:
    return (x + align - 1) // align * align


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def max_tokens_per_rank(chunked_prefill_size: int, max_running_requests: int,
                        attn_tp_size: int = 1) -> int:
    """The largest step one rank can issue: a prefill chunk or one decode token per request.

    Takes the runtime's limits and returns ``max(chunked_prefill_size, max_running_requests)``
    aligned up to ``attn_tp_size``: the ``max_num_tokens`` every dispatcher workspace and the DP
    buffers are sized for, per rank. The one definition (RuntimeConfig's property calls it).
    """
    _check_positive(chunked_prefill_size=chunked_prefill_size,
                    max_running_requests=max_running_requests, attn_tp_size=attn_tp_size)
    most = max(chunked_prefill_size, max_running_requests)
    return -(-most // attn_tp_size) * attn_tp_size


def routing_bytes_per_token(top_k: int) -> int:
    """Bytes of one token's routing as the dispatchers send it: int32 expert ids + fp32 weights."""
    return top_k * _INT32 + top_k * _INT32


def flashinfer_aux_bytes(ep_size: int, max_tokens_per_rank: int,
                         eplb_stats_num_experts: int = 0) -> int:
    """FlashInfer's aux region per rank (counters, flags, per-token top-k bookkeeping), in bytes.

    Mirrors ``calculateOffsets(epSize, maxNumTokens, eplbStatsNumExperts)
    [PAYLOAD_DATA_OFFSET_INDEX]`` of flashinfer 0.7.2.post1 ``csrc/trtllm_moe_alltoall.cu``
    field by field (each ``alignOffset`` is a pad to 128 bytes).
    """
    _check_positive(ep_size=ep_size, max_tokens_per_rank=max_tokens_per_rank,
                    eplb_stats_num_experts=eplb_stats_num_experts)
    offset = 0
    offset += _INT32  # FLAG_VAL
    offset += _INT32  # LOCAL_TOKEN_COUNTER
    offset += ep_size * _INT32  # SEND_COUNTERS
    offset += ep_size * _INT32  # RECV_COUNTERS
    offset = _pad_up(offset, FLASHINFER_ALIGNMENT)
    offset += ep_size * _INT32  # DISPATCH_COMPLETION_FLAGS
    offset = _pad_up(offset, FLASHINFER_ALIGNMENT)
    offset += ep_size * _INT32  # COMBINE_COMPLETION_FLAGS
    offset = _pad_up(offset, FLASHINFER_ALIGNMENT)
    offset += max_tokens_per_rank * FLASHINFER_MAX_TOP_K * _INT32  # TOPK_TARGET_RANKS
    offset = _pad_up(offset, FLASHINFER_ALIGNMENT)
    offset += max_tokens_per_rank * FLASHINFER_MAX_TOP_K * _INT32  # TOPK_SEND_INDICES
    offset = _pad_up(offset, FLASHINFER_ALIGNMENT)
    offset += ep_size * eplb_stats_num_experts * _INT32  # EPLB_GATHERED_STATS
    offset = _pad_up(offset, FLASHINFER_ALIGNMENT)
    return offset  # PAYLOAD_DATA_OFFSET


def flashinfer_dispatch_bytes_per_token(hidden_size: int, top_k: int, dtype: torch.dtype,
                                        extra_payload_bytes_per_token: int = 0) -> int:
    """Dispatch payload bytes per token: hidden states in ``dtype``, int32 ids, fp32 weights, extra.

    This is what ``FlashInferDispatcher`` sends. For bf16/fp16 and no extra payload it equals
    ``MoeAlltoAll.get_moe_workspace_size_per_rank``'s ``total_dispatch_payload_size_per_token``
    (which assumes 2-byte hidden states; for fp32 hidden states that helper under-sizes).
    """
    _check_positive(hidden_size=hidden_size, top_k=top_k,
                    extra_payload_bytes_per_token=extra_payload_bytes_per_token)
    return (hidden_size * dtype_bytes(dtype) + routing_bytes_per_token(top_k)
            + extra_payload_bytes_per_token)


def flashinfer_combine_bytes_per_token(hidden_size: int, dtype: torch.dtype) -> int:
    """Combine payload bytes per token: one expert-output row in ``dtype``."""
    _check_positive(hidden_size=hidden_size)
    return hidden_size * dtype_bytes(dtype)


def flashinfer_workspace_bytes_per_rank(ep_size: int, max_tokens_per_rank: int, hidden_size: int,
                                        top_k: int, dtype: torch.dtype,
                                        extra_payload_bytes_per_token: int = 0,
                                        eplb_stats_num_experts: int = 0) -> int:
    """Bytes of one rank's MoeAlltoAll workspace; ``ep_size`` is applied exactly once.

    Takes the EP size, the per-rank token maximum (``max_tokens_per_rank(...)``, NOT multiplied by
    ``ep_size``), the hidden size, top-k, the hidden dtype, extra dispatch bytes per token and the
    EPLB stats width; returns ``moe_a2a_get_workspace_size_per_rank(ep_size, max_tokens_per_rank,
    dispatch_bytes, combine_bytes, eplb_stats_num_experts)`` of flashinfer 0.7.2.post1, computed
    without FlashInfer. Each rank receives up to ``max_tokens_per_rank`` rows from each of the
    ``ep_size`` ranks, hence the single ``ep_size *`` in the payload regions.
    """
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if max_tokens_per_rank < 1:
        raise ValueError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
    dispatch = flashinfer_dispatch_bytes_per_token(hidden_size, top_k, dtype,
                                                   extra_payload_bytes_per_token)
    combine = flashinfer_combine_bytes_per_token(hidden_size, dtype)
    aux = flashinfer_aux_bytes(ep_size, max_tokens_per_rank, eplb_stats_num_experts)
    return (
        _pad_up(aux, FLASHINFER_ALIGNMENT)
        + _pad_up(ep_size * max_tokens_per_rank * dispatch, FLASHINFER_ALIGNMENT)
        + _pad_up(ep_size * max_tokens_per_rank * combine, FLASHINFER_ALIGNMENT)
    )


def flashinfer_workspace_bytes_total(ep_size: int, max_tokens_per_rank: int, hidden_size: int,
                                     top_k: int, dtype: torch.dtype,
                                     extra_payload_bytes_per_token: int = 0,
                                     eplb_stats_num_experts: int = 0) -> int:
    """Bytes of the whole EP group's workspaces: ``per rank x ep_size`` (one workspace per GPU)."""
    return ep_size * flashinfer_workspace_bytes_per_rank(
        ep_size, max_tokens_per_rank, hidden_size, top_k, dtype,
        extra_payload_bytes_per_token, eplb_stats_num_experts,
    )


def all_to_all_buffer_bytes(ep_size: int, max_tokens_per_rank: int, hidden_size: int, top_k: int,
                            dtype: torch.dtype) -> int:
    """Worst-case bytes one rank allocates for an all-to-all dispatch + combine.

    A token goes once to each distinct destination rank, so a rank sends at most
    ``P * min(K, R)`` rows and receives at most ``R * P`` rows (each peer sends each of its tokens
    here at most once). Sent and received rows are packed (hidden + routing, padded to 16 bytes);
    the expert outputs with their fp32 accumulator, the returned rows, and the fp32 sum of the
    returned rows are counted too.
    """
    _check_positive(ep_size=ep_size, max_tokens_per_rank=max_tokens_per_rank,
                    hidden_size=hidden_size, top_k=top_k)
    elt = dtype_bytes(dtype)
    row = _pad_up(hidden_size * elt + routing_bytes_per_token(top_k), 16)
    send_rows = max_tokens_per_rank * min(top_k, ep_size)
    recv_rows = ep_size * max_tokens_per_rank
    send = send_rows * row
    recv = recv_rows * row
    expert_out = recv_rows * hidden_size * elt + recv_rows * hidden_size * 4
    back = send_rows * hidden_size * elt + max_tokens_per_rank * hidden_size * 4
    return send + recv + expert_out + back
