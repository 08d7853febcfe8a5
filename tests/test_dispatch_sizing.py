"""Sizing arithmetic of dispatcher/sizing.py (pure, CPU, no process group)."""

from __future__ import annotations

import pytest
import torch

from dispatcher.sizing import (
    all_to_all_buffer_bytes,
    flashinfer_aux_bytes,
    flashinfer_combine_bytes_per_token,
    flashinfer_dispatch_bytes_per_token,
    flashinfer_workspace_bytes_per_rank,
    flashinfer_workspace_bytes_total,
    max_tokens_per_rank,
)


def test_max_tokens_per_rank_is_the_larger_limit():
    assert max_tokens_per_rank(8192, 256) == 8192
    assert max_tokens_per_rank(512, 1024) == 1024
    assert max_tokens_per_rank(64, 64) == 64
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        max_tokens_per_rank(-1, 4)


def test_one_max_tokens_per_rank_for_runtime_and_dispatcher():
    """The runtime's per-rank token limit is the dispatcher sizing's, never times ep_size, and
    aligned to attn_tp_size in one place."""
    from dp_runtime.config import RuntimeConfig

    assert max_tokens_per_rank(4096, 512) == 4096 and max_tokens_per_rank(100, 300, 4) == 300
    assert max_tokens_per_rank(4098, 512, 4) == 4100
    rt = RuntimeConfig(dp_size=4, attn_tp_size=2, max_running_requests=64, chunked_prefill_size=4097,
                       hidden_size=64, device="cpu")
    assert rt.max_tokens_per_rank == max_tokens_per_rank(4097, 64, 2) == 4098


def test_aux_region_by_hand():
    # ep=4, P=256: counters 4+4+16+16=40 -> 128; +16 -> 256; +16 -> 384;
    # + 256*22*4=22528 -> 22912; + 22528 -> 45440 (all multiples of 128 from here).
    assert flashinfer_aux_bytes(4, 256) == 45440
    # EPLB stats: + ep * experts * 4 bytes, padded to 128.
    assert flashinfer_aux_bytes(4, 256, eplb_stats_num_experts=256) == 45440 + 4 * 256 * 4


def test_workspace_per_rank_pinned_value():
    # bf16, hidden 4096, top-8: dispatch = 8192 + 32 + 32 = 8256 B/token, combine = 8192 B/token.
    assert flashinfer_dispatch_bytes_per_token(4096, 8, torch.bfloat16) == 8256
    assert flashinfer_combine_bytes_per_token(4096, torch.bfloat16) == 8192
    expected = 45440 + 4 * 256 * 8256 + 4 * 256 * 8192
    assert flashinfer_workspace_bytes_per_rank(4, 256, 4096, 8, torch.bfloat16) == expected


@pytest.mark.parametrize("ep_size", [1, 2, 4, 8])
def test_ep_size_is_applied_exactly_once(ep_size):
    p, d, k, dt = 512, 7168, 8, torch.bfloat16
    per_rank = flashinfer_workspace_bytes_per_rank(ep_size, p, d, k, dt)
    payload = per_rank - flashinfer_aux_bytes(ep_size, p)
    per_token = flashinfer_dispatch_bytes_per_token(d, k, dt) + flashinfer_combine_bytes_per_token(d, dt)
    # Each rank receives up to P rows from each of ep_size ranks: exactly one factor of ep_size.
    assert payload == ep_size * p * per_token
    assert flashinfer_workspace_bytes_total(ep_size, p, d, k, dt) == ep_size * per_rank
    if ep_size > 1:
        # Upstream's bug: passing ep_size * P as the per-rank maximum squares ep_size.
        doubled = flashinfer_workspace_bytes_per_rank(ep_size, ep_size * p, d, k, dt)
        assert doubled - flashinfer_aux_bytes(ep_size, ep_size * p) == ep_size * ep_size * p * per_token


def test_workspace_alignment_and_extra_payload():
    base = flashinfer_workspace_bytes_per_rank(3, 7, 33, 1, torch.float16)
    assert base % 128 == 0
    more = flashinfer_workspace_bytes_per_rank(3, 7, 33, 1, torch.float16, extra_payload_bytes_per_token=16)
    assert more > base and more % 128 == 0


def test_fp32_hidden_sizes_four_bytes_per_element():
    # flashinfer's get_moe_workspace_size_per_rank assumes 2-byte hidden states; ours follows dtype.
    assert flashinfer_dispatch_bytes_per_token(1024, 8, torch.float32) == 4096 + 64
    assert flashinfer_combine_bytes_per_token(1024, torch.float32) == 4096


def test_workspace_rejects_nonsense():
    with pytest.raises(ValueError, match="ep_size"):
        flashinfer_workspace_bytes_per_rank(0, 16, 64, 2, torch.bfloat16)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        flashinfer_workspace_bytes_per_rank(2, 0, 64, 2, torch.bfloat16)


def test_torch_backend_buffer_bytes():
    a2a = all_to_all_buffer_bytes(4, 128, 1024, 8, torch.bfloat16)
    assert a2a >= 4 * 128 * (1024 * 2 + 64)
    # it grows with the token budget
    assert all_to_all_buffer_bytes(4, 256, 1024, 8, torch.bfloat16) > a2a
