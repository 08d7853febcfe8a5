"""TorchSDPABackend against a dense reference; the KV index builder; the ragged/paged choice."""

from __future__ import annotations

import math

import pytest
import torch
from _graph_fixtures import make_stack

from dp_runtime.attention import KVLayout, build_kv_indices, choose_kv_layout, host_indptr
from dp_runtime.forward_mode import ForwardMode
from tests.support.synthetic_batch import add_requests, decode_batch, extend_batch

HQ, HKV, D = 4, 2, 8


def reference(q_TQD, k_LKD, v_LKD, q_positions, scale):
    """Dense attention of q rows at ``q_positions`` over keys 0..L-1, causal by position (float64)."""
    g = q_TQD.shape[1] // k_LKD.shape[1]
    k = k_LKD.double().repeat_interleave(g, dim=1)
    v = v_LKD.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("tqd,lqd->qtl", q_TQD.double(), k) * scale
    keys = torch.arange(k.shape[0])
    scores = scores.masked_fill(keys[None, None, :] > q_positions[None, :, None], -math.inf)
    return torch.einsum("qtl,lqd->tqd", scores.softmax(-1), v).reshape(q_TQD.shape[0], -1)


def _kv_of(stack, req, layer):
    idx = stack.cache.req_to_token[req.row, : req.seq_len].long()
    return stack.cache.k[layer][idx], stack.cache.v[layer][idx]


def _qkv(t, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, HQ, D, generator=gen), torch.randn(t, HKV, D, generator=gen), torch.randn(t, HKV, D, generator=gen))


def _store(stack, layer, batch, k, v):
    """This step's K/V into the cache, as the model's attention block does before attending."""
    stack.cache.set_kv(layer, batch.out_cache_loc, k, v)


def test_decode_equals_dense_reference():
    stack = make_stack()
    backend = stack.backend
    reqs = add_requests(stack.allocator, [1, 7, 30, 64, 12])
    batch = decode_batch(stack.allocator, reqs, [1] * 5)
    q, k, v = _qkv(5, 0)
    _store(stack, 1, batch, k, v)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 1, batch)
    for i, req in enumerate(reqs):
        kk, vv = _kv_of(stack, req, 1)
        ref = reference(q[i : i + 1], kk, vv, torch.tensor([req.seq_len - 1]), backend.scale)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_graph_metadata_path_equals_eager_path():
    stack = make_stack()
    backend = stack.backend
    reqs = add_requests(stack.allocator, [3, 40, 9])
    batch = decode_batch(stack.allocator, reqs, [1, 2, 3])
    q, k, v = _qkv(3, 1)
    _store(stack, 0, batch, k, v)
    backend.init_forward_metadata(batch)
    eager = backend.forward(q, k, v, 0, batch)
    backend.init_capture(max_bs=8, max_num_tokens=8)
    backend.init_forward_metadata_capture(
        bs=4, num_tokens=4, req_pool_indices=torch.zeros(4, dtype=torch.int64), seq_lens=torch.ones(4, dtype=torch.int64),
        forward_mode=ForwardMode.DECODE,
    )
    pad = torch.zeros(1, dtype=torch.int64)
    rows = torch.cat([batch.req_pool_indices, pad])
    lens = torch.cat([batch.seq_lens, pad + 1])
    backend.init_forward_metadata_replay(
        bs=4, raw_bs=3, req_pool_indices=rows, seq_lens=lens, seq_lens_sum=int(lens.sum()),
        forward_mode=ForwardMode.DECODE, seq_lens_cpu=lens,
    )
    padded = torch.cat([q, q[:1]]), torch.cat([k, k[:1]]), torch.cat([v, v[:1]])
    batch.out_cache_loc = torch.cat([batch.out_cache_loc, pad])
    _store(stack, 0, batch, *padded[1:])  # the padding row into slot 0, as in a graph
    graph = backend.forward(*padded, 0, batch)
    torch.testing.assert_close(graph[:3], eager)
    with pytest.raises(KeyError, match="no captured metadata for bucket 8"):
        backend.init_forward_metadata_replay(
            bs=8, raw_bs=3, req_pool_indices=rows, seq_lens=lens, seq_lens_sum=0,
            forward_mode=ForwardMode.DECODE, seq_lens_cpu=None,
        )
    with pytest.raises(NotImplementedError, match="DECODE only"):
        backend.init_forward_metadata_capture(
            bs=4, num_tokens=4, req_pool_indices=rows, seq_lens=lens, forward_mode=ForwardMode.EXTEND
        )


def test_decode_ignores_garbage_in_masked_window_positions():
    stack = make_stack()
    backend = stack.backend
    reqs = add_requests(stack.allocator, [5, 9])
    batch = decode_batch(stack.allocator, reqs, [1, 2])
    q, k, v = _qkv(2, 2)
    _store(stack, 0, batch, k, v)
    backend.init_forward_metadata(batch)
    clean = backend.forward(q, k, v, 0, batch)
    stack.cache.k[0][0] = float("nan")  # slot 0: what padded rows write; masked positions point there
    stack.cache.v[0][0] = float("inf")
    dirty = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(dirty, clean)


def test_extend_with_prefix_equals_dense_reference():
    stack = make_stack()
    backend = stack.backend
    reqs = add_requests(stack.allocator, [0, 10, 3])
    ext = [5, 2, 7]
    batch = extend_batch(stack.allocator, reqs, ext, list(range(14)))
    q, k, v = _qkv(14, 3)
    _store(stack, 0, batch, k, v)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch)
    start = 0
    for req, e in zip(reqs, ext, strict=True):
        kk, vv = _kv_of(stack, req, 0)
        positions = torch.arange(req.seq_len - e, req.seq_len)
        ref = reference(q[start : start + e], kk, vv, positions, backend.scale)
        torch.testing.assert_close(out[start : start + e].double(), ref, atol=1e-5, rtol=1e-5)
        start += e


def test_attention_reads_the_cache_and_never_writes_it():
    """One writer of K/V: the model's attention block. The backend attends over what the cache
    holds, whatever k/v it is handed."""
    stack = make_stack()
    backend = stack.backend
    reqs = add_requests(stack.allocator, [0, 6])
    for batch in (extend_batch(stack.allocator, reqs, [4, 3], list(range(7))),
                  decode_batch(stack.allocator, reqs, [1, 2])):
        q, k, v = _qkv(batch.num_tokens, 4)
        _store(stack, 0, batch, k, v)
        before = stack.cache.k[0].clone(), stack.cache.v[0].clone()
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k, v, 0, batch)
        assert torch.equal(stack.cache.k[0], before[0]) and torch.equal(stack.cache.v[0], before[1])
        # other k/v handed over change nothing: the cache is what is read
        torch.testing.assert_close(backend.forward(q, k + 1, v - 1, 0, batch), out, atol=0, rtol=0)


def test_zero_tokens_and_idle_metadata():
    stack = make_stack()
    backend = stack.backend
    empty = torch.empty(0, HQ, D)
    assert backend.forward(empty, empty[:, :HKV], empty[:, :HKV], 0, None).shape == (0, HQ * D)


def test_host_indptr_and_kv_indices_match_a_loop():
    stack = make_stack()
    reqs = add_requests(stack.allocator, [3, 0, 5, 1])
    rows = torch.tensor([r.row for r in reqs])
    lens = torch.tensor([r.seq_len for r in reqs])
    indptr = host_indptr(lens)
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0, 3, 3, 8, 9]
    got = build_kv_indices(stack.cache.req_to_token, rows, lens, int(indptr[-1]))
    want = torch.cat([stack.cache.req_to_token[r.row, : r.seq_len] for r in reqs])
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert build_kv_indices(stack.cache.req_to_token, rows[:0], lens[:0], 0).shape == (0,)


@pytest.mark.parametrize(
    ("mode", "deterministic", "layout"),
    [
        (ForwardMode.DECODE, False, KVLayout.PAGED),
        (ForwardMode.DECODE, True, KVLayout.PAGED),
        (ForwardMode.IDLE, False, KVLayout.PAGED),
        (ForwardMode.EXTEND, False, KVLayout.RAGGED),
        (ForwardMode.EXTEND, True, KVLayout.PAGED),
    ],
)
def test_ragged_or_paged_is_one_pure_choice(mode, deterministic, layout):
    # The FlashInfer backend calls this one function at capture, replay and eager (checked with
    # FlashInfer itself in test_graph_gpu.py); its answer depends on nothing else.
    assert choose_kv_layout(mode, deterministic=deterministic) is layout
    assert choose_kv_layout(mode, deterministic=deterministic) is choose_kv_layout(mode, deterministic=deterministic)


def test_flashinfer_backend_module_imports_without_flashinfer():
    from dp_runtime.attention import FlashInferBackend

    stack = make_stack()
    with pytest.raises((ValueError, ImportError)):
        FlashInferBackend(stack.cache, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
