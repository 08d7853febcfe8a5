"""build_decode_registry / build_prefill_registry (issue: buffers/, builders 16)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from buffers import BufferPool, build_decode_registry, build_prefill_registry


@dataclasses.dataclass
class FB:
    """A ForwardBatch-like dataclass: buffers/ only knows field names."""

    batch_size: int
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    out_cache_loc: torch.Tensor | None = None
    req_pool_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    num_token_non_padded: torch.Tensor | None = None
    global_num_tokens_cpu: list[int] | None = None
    global_num_tokens_gpu: torch.Tensor | None = None
    global_num_tokens_for_logprob_cpu: list[int] | None = None
    global_num_tokens_for_logprob_gpu: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    input_embeds: torch.Tensor | None = None


def decode_batch(bs, dp=2):
    return FB(
        batch_size=bs,
        input_ids=torch.arange(100, 100 + bs),
        positions=torch.arange(10, 10 + bs),
        out_cache_loc=torch.arange(50, 50 + bs),
        req_pool_indices=torch.arange(1, 1 + bs),
        seq_lens=torch.arange(11, 11 + bs),
        seq_lens_cpu=torch.arange(11, 11 + bs),
        mrope_positions=torch.arange(3 * bs).view(3, bs),
        global_num_tokens_cpu=[bs, 7][:dp],
        global_num_tokens_for_logprob_cpu=[bs, 2][:dp],
    )


def test_decode_registry_policies():
    reg = build_decode_registry(8, "cpu", BufferPool(), dp_size=2, seq_len_fill_value=1, mrope=True,
                                register_global_num_tokens=True)
    for name in reg.names():
        reg.buffer(name).fill_(-5)
    b = decode_batch(3)
    reg.fill(b, 3, 4)
    v = reg.view(b, 4)
    assert v.input_ids.tolist() == [100, 101, 102, -5]  # keep
    assert v.positions.tolist() == [10, 11, 12, 0]
    assert v.out_cache_loc.tolist() == [50, 51, 52, 0]
    assert v.req_pool_indices.tolist() == [1, 2, 3, 0]
    assert v.seq_lens.dtype == torch.int64 and v.seq_lens.tolist() == [11, 12, 13, 1]
    assert v.seq_lens_cpu.device.type == "cpu" and v.seq_lens_cpu.tolist() == [11, 12, 13, 1]
    assert v.mrope_positions.tolist() == [[0, 1, 2, 0], [3, 4, 5, 0], [6, 7, 8, 0]]
    assert v.num_token_non_padded.tolist() == [3]
    assert v.global_num_tokens_gpu.tolist() == [3, 7]
    assert v.global_num_tokens_for_logprob_gpu.tolist() == [3, 2]
    assert v.batch_size == 4


def test_decode_without_global_num_tokens_passes_batch_tensors_by_identity():
    reg = build_decode_registry(8, "cpu", BufferPool(), dp_size=2, register_global_num_tokens=False)
    assert "global_num_tokens_gpu" not in reg.names()
    b = decode_batch(3)
    b.global_num_tokens_gpu = torch.tensor([3, 7])
    b.global_num_tokens_for_logprob_gpu = torch.tensor([3, 2])
    reg.fill(b, 3, 4)
    v = reg.view(b, 4)
    assert v.global_num_tokens_gpu is b.global_num_tokens_gpu
    assert v.global_num_tokens_for_logprob_gpu is b.global_num_tokens_for_logprob_gpu


def test_global_num_tokens_of_wrong_length_is_refused():
    reg = build_decode_registry(8, "cpu", BufferPool(), dp_size=2, register_global_num_tokens=True)
    b = decode_batch(3, dp=1)
    with pytest.raises(ValueError, match="has 1 entries, dp_size is 2"):
        reg.fill(b, 3, 4)


def prefill_batch(bs, ntok, hidden):
    return FB(
        batch_size=bs,
        input_ids=torch.arange(ntok),
        positions=torch.arange(ntok),
        out_cache_loc=torch.arange(1, ntok + 1),
        req_pool_indices=torch.arange(1, bs + 1),
        seq_lens=torch.full((bs,), 5),
        seq_lens_cpu=torch.full((bs,), 5),
        extend_seq_lens=torch.full((bs,), ntok // bs),
        extend_prefix_lens=torch.zeros(bs, dtype=torch.int64),
        input_embeds=torch.ones(ntok, hidden, dtype=torch.bfloat16),
        global_num_tokens_cpu=[ntok],
        global_num_tokens_for_logprob_cpu=[bs],
    )


def test_prefill_registry_zero_pads_tokens_and_never_copies_input_embeds():
    reg = build_prefill_registry(4, 16, "cpu", BufferPool(), hidden_size=8)
    for name in reg.names():
        reg.buffer(name).fill_(-5)
    b = prefill_batch(2, 6, 8)
    reg.fill(b, 2, 4, 6, 8)
    v = reg.view(b, 4, 8)
    assert v.input_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert v.out_cache_loc.tolist()[6:] == [0, 0] and v.positions.tolist()[6:] == [0, 0]
    assert v.extend_seq_lens.tolist() == [3, 3, 0, 0]
    # input_embeds: the batch's ones were not copied (rows 0..5 keep what was there), tail zeroed
    assert v.input_embeds.shape == (8, 8) and v.input_embeds is not b.input_embeds
    assert (v.input_embeds[:6] == -5).all() and (v.input_embeds[6:] == 0).all()
    assert (reg.buffer("input_embeds")[8:] == -5).all()


def test_prefill_without_input_embeds_passes_batch_tensor():
    reg = build_prefill_registry(4, 16, "cpu", BufferPool(), register_input_embeds=False)
    b = prefill_batch(2, 6, 8)
    reg.fill(b, 2, 4, 6, 8)
    assert reg.view(b, 4, 8).input_embeds is b.input_embeds


def test_prefill_with_input_embeds_needs_hidden_size():
    with pytest.raises(ValueError, match="needs hidden_size"):
        build_prefill_registry(4, 16, "cpu", BufferPool())


def test_source_binds_existing_attributes_and_missing_one_raises():
    pool = BufferPool()
    owner = build_decode_registry(8, "cpu", pool, dp_size=1, user="owner")
    src = SimpleNamespace(**{n: owner.buffer(n) for n in owner.names()})
    bound = build_decode_registry(8, "cpu", BufferPool(), dp_size=1, source=src, user="bound")
    for n in owner.names():
        assert bound.buffer(n).data_ptr() == owner.buffer(n).data_ptr()
    del src.seq_lens_cpu
    with pytest.raises(AttributeError, match="no attribute 'seq_lens_cpu'"):
        build_decode_registry(8, "cpu", BufferPool(), dp_size=1, source=src)


def test_decode_and_prefill_share_the_pool():
    pool = BufferPool()
    prefill = build_prefill_registry(16, 64, "cpu", pool, hidden_size=4)
    decode = build_decode_registry(16, "cpu", pool)
    assert decode.buffer("input_ids").data_ptr() == prefill.buffer("input_ids").data_ptr()
    ids = next(e for e in pool.report() if e.name == "input_ids")
    assert ids.users == ("prefill", "decode") and ids.numel == 64
