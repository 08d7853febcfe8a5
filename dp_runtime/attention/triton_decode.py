"""Decode attention over the paged KV cache (page size 1) in one Triton launch, for large
decode batches of short-to-medium contexts, where FlashInfer's tensor-core decode spends about
3x the bytes floor (bs 256 x 100 tokens, 32/4 heads of 128 on an H200: 35 us against 12;
``bench/decode_attention.py``).

One program per (request, KV head): the GQA group's query heads (padded to 16 rows, the
smallest tensor-core tile) walk the request's KV slots ``indices[indptr[b]:indptr[b+1]]`` in
blocks of ``BLOCK_N`` tokens (128: the fastest of 32/64/128 at every measured shape) with an
online softmax, so each K/V row is read once for the whole
group. No split of a request's KV: the batch gives the parallelism, which is why the backend
takes this path only for buckets of ``TRITON_DECODE_MIN_BS`` requests and more.

An FP8 e4m3 cache (scale 1) is read at half the bytes and its blocks upcast to fp16, with q, for
both dots: e4m3 -> fp16 is one conversion on sm89+, while e4m3 -> bf16 goes through fp32 and
left the kernel at about twice its bytes floor. fp16 holds every e4m3 value and a normed query
exactly enough (11 significant bits, range 65504), and rounds P finer than bf16 does.

Shapes: q (B, Hq, D); k, v caches (slots, Hk, D), in q's dtype or FP8 e4m3; indptr (B + 1,)
int32; indices int32 slots; out (B, Hq, D) in q's dtype. Lengths must be >= 1 (a decode row
always has its own token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from dp_runtime.model.pdl import pdl_entry, pdl_meta, resolve_pdl

__all__ = ["TRITON_DECODE_MIN_BS", "triton_decode_attention"]

# Decode graph buckets with at least this many requests attend with this kernel (measured on an
# H200, bench/decode_attention.py; smaller batches have too few (request, head) programs to fill
# the GPU without a KV split, and FlashInfer's split kernels win there).
TRITON_DECODE_MIN_BS = 64

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, indptr_ptr, indices_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ob, stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a tensor-core tile (>= 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # Triton's CPU interpreter only: it has no bf16 matmul
    KV_FP8: tl.constexpr,  # an FP8 cache: the dots run in fp16 (module docstring)
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    pdl_entry(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(indptr_ptr + b)
    end = tl.load(indptr_ptr + b + 1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < GROUP
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + g)[:, None] * stride_qh
                + d[None, :], mask=g_ok[:, None], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    if KV_FP8:
        q = q.to(tl.float16)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        ok = offs < end
        slot = tl.load(indices_ptr + offs, mask=ok, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * stride_kt + h * stride_kh + d[None, :],
                    mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + h * stride_vh + d[None, :],
                    mask=ok[:, None], other=0.0)
        if KV_FP8:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l_sum[:, None]
    o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])


def triton_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_n: int = 128,
    pdl: bool | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over its cached KV (module docstring).

    ``q`` (B, Hq, D); ``k_cache``/``v_cache`` (slots, Hk, D) or (slots, 1, Hk, D) (page size 1);
    ``indptr`` (B + 1,) and ``indices`` int32 on the device. Returns ``out`` (B, Hq, D). No host
    sync: capturable in a CUDA graph, where indptr/indices are the graph's fixed buffers.
    ``pdl``: programmatic dependent launch (None: where the device supports it, ``resolve_pdl``)."""
    if k_cache.dim() == 4:
        k_cache, v_cache = k_cache.squeeze(1), v_cache.squeeze(1)
    bs, hq, d = q.shape
    hk = k_cache.shape[1]
    if k_cache.dtype not in (q.dtype, torch.float8_e4m3fn) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"triton_decode_attention: caches {k_cache.dtype} / {v_cache.dtype} for "
                         f"q {q.dtype}: need q's dtype or float8_e4m3fn, both alike")
    if hq % hk or k_cache.shape[2] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"triton_decode_attention: q {tuple(q.shape)} against caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}: need Hq a multiple of "
                         "Hk and one head dim")
    if d & (d - 1) or d < 16:
        raise ValueError(f"triton_decode_attention: head dim {d} must be a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError(
            "triton_decode_attention: q and the caches need a unit stride along the head dim")
    if out is None:
        out = torch.empty_like(q)
    if bs == 0:
        return out
    group = hq // hk
    upcast = isinstance(_decode_kernel, InterpretedFunction)
    _decode_kernel[(bs, hk)](
        q, k_cache, v_cache, out, indptr, indices, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_N=block_n,
        UPCAST_DOT=upcast, KV_FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=4, num_stages=2,
        **pdl_meta(resolve_pdl(pdl, q, bs)),
    )
    return out
