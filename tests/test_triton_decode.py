"""The Triton decode attention kernel (dp_runtime/attention/triton_decode.py) against attention
computed in float64 from the same bf16 cache rows, and against FlashInfer's decode on a GPU.

Tolerance. The kernel rounds the softmax probabilities to bf16 before the P @ V product (as
FlashInfer's tensor-core kernels do): each weight then errs by up to 2^-8 relative, so the
output errs by at most 2^-8 * sum_t p_t |v_t| <= 2^-8 * max |v|, plus the final rounding of the
output to bf16 (2^-8 relative; twice that in Triton's CPU interpreter, whose fp32 -> bf16 casts
truncate). The scores are fp32 dot products of bf16 values (exact products, fp32 sums) and
contribute far less. So each element must satisfy |o - ref| <= 2^-8 * max|v| + 2u * |ref| + 1e-3
* max|v|; a missed block, a wrong slot or a wrong head moves outputs by a sizeable fraction of
max|v|, far above that.

GPU tests carry ``@pytest.mark.gpu``; the interpreter tests run on CPU machines only.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from dp_runtime.attention.triton_decode import triton_decode_attention

HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not HAS_TRITON,
    reason="Triton's CPU interpreter: CPU machines with triton (gpu tests cover GPUs)")


def _case(lens, hq=8, hk=2, d=16, slots=None, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    slots = slots or total + 7
    k = torch.randn(slots, hk, d, generator=g).bfloat16()
    v = torch.randn(slots, hk, d, generator=g).bfloat16()
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
    indices = torch.randperm(slots, generator=g)[:total].to(torch.int32)  # scattered, as a used cache
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    return [t.to(device) for t in (q, k, v, indptr, indices)]


def _reference(q, k, v, indptr, indices, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        rows = indices[indptr[b]:indptr[b + 1]].long().cpu()
        kb = k.cpu().double()[rows].repeat_interleave(group, dim=1)  # (T, Hq, D)
        vb = v.cpu().double()[rows].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].cpu().double(), kb) * scale
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), vb)
    return out


def _check(o, q, k, v, indptr, indices, scale, truncating):
    ref = _reference(q, k, v, indptr, indices, scale)
    vmax = v.abs().max().item()
    bound = (2.0**-8 + 1e-3) * vmax + (2 if truncating else 1) * 2.0**-8 * ref.abs()
    excess = (o.cpu().double() - ref).abs() - bound
    assert excess.max().item() <= 0, f"worst element exceeds its bound by {excess.max().item():.3g}"


LENS = [[1], [5, 1, 130], [64, 65, 3, 128]]  # a single token, block edges, several blocks


@interpreter
@pytest.mark.parametrize("lens", LENS)
def test_matches_float64_reference_interpreter(lens):
    q, k, v, indptr, indices = _case(lens)
    scale = 1 / math.sqrt(q.shape[-1])
    o = triton_decode_attention(q, k, v, indptr, indices, scale, block_n=32)
    assert o.shape == q.shape and o.dtype == q.dtype
    _check(o, q, k, v, indptr, indices, scale, truncating=True)


@interpreter
def test_paged_view_out_buffer_and_empty_batch_interpreter():
    q, k, v, indptr, indices = _case([3, 40], hq=4, hk=4)  # GQA group 1
    out = torch.full_like(q, float("nan"))
    got = triton_decode_attention(q, k.unsqueeze(1), v.unsqueeze(1), indptr, indices, 0.3, out=out, block_n=16)
    assert got.data_ptr() == out.data_ptr()
    _check(out, q, k, v, indptr, indices, 0.3, truncating=True)
    empty = triton_decode_attention(q[:0], k, v, indptr[:1], indices, 0.3)
    assert empty.shape == (0, 4, 16)


def test_rejects_mismatched_heads():
    q, k, v, indptr, indices = _case([2], hq=6, hk=4)
    with pytest.raises(ValueError, match="multiple of Hk"):
        triton_decode_attention(q, k, v, indptr, indices, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [*LENS, [100] * 64, list(range(1, 257))])
def test_matches_float64_reference_gpu(lens):
    q, k, v, indptr, indices = _case(lens, hq=32, hk=4, d=128, device="cuda")
    scale = 1 / math.sqrt(128)
    _check(triton_decode_attention(q, k, v, indptr, indices, scale), q, k, v, indptr, indices, scale,
           truncating=False)


@pytest.mark.gpu
def test_matches_flashinfer_decode_gpu():
    flashinfer = pytest.importorskip("flashinfer")
    lens = [(i * 37) % 300 + 1 for i in range(64)]
    q, k, v, indptr, indices = _case(lens, hq=32, hk=4, d=128, device="cuda", seed=3)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(indptr.cpu(), indices, torch.ones(len(lens), dtype=torch.int32), 32, 4, 128, 1,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    ref = w.run(q, (k.unsqueeze(1), v.unsqueeze(1)))
    got = triton_decode_attention(q, k, v, indptr, indices, 1 / math.sqrt(128))
    # Both round P to bf16 and the output to bf16, in different orders: a few bf16 ulps apart.
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_cuda_graph_replay_reads_new_lengths():
    q, k, v, indptr, indices = _case([10, 20, 30], hq=32, hk=4, d=128, slots=4096, device="cuda")
    scale = 1 / math.sqrt(128)
    big = torch.zeros(4096, dtype=torch.int32, device="cuda")
    big[: indices.numel()] = indices
    triton_decode_attention(q, k, v, indptr, big, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_decode_attention(q, k, v, indptr, big, scale)
    indptr.copy_(torch.tensor([0, 300, 301, 1000], dtype=torch.int32))
    big.copy_(torch.randperm(4096, dtype=torch.int32).cuda())
    graph.replay()
    torch.cuda.synchronize()
    _check(out, q, k, v, indptr, big[:1000], scale, truncating=False)
