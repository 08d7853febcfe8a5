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

Shapes: q (B, Hq, D); k, v caches (slots, Hk, D); indptr (B + 1,) int32; indices int32 slots;
out (B, Hq, D) in q's dtype. Lengths must be >= 1 (a decode row always has its own token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["TRITON_DECODE_MIN_BS", "triton_decode_attention"]

# Decode graph buckets with at least this many requests attend with this kernel (measured on an
# H200, bench/decode_attention.py; smaller batches have too few (request, head) programs to fill
# the GPU without a KV split, and FlashInfer's split kernels win there).
TRITON_DECODE_MIN_BS = 64

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, indptr_ptr, indices_ptr,
    part_ptr,  # (B, Hq, SPLITS, HEAD_DIM + 1) fp32: each split's output and its log2-sum-exp
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ob, stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a tensor-core tile (>= 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,  # programs per (request, KV head), each over a share of the KV
    UPCAST_DOT: tl.constexpr,  # Triton's CPU interpreter only: it has no bf16 matmul
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(indptr_ptr + b)
    end = tl.load(indptr_ptr + b + 1)
    if SPLITS > 1:  # split s takes whole BLOCK_N blocks: [start + s * share, ... + share)
        share = tl.cdiv(tl.cdiv(end - start, SPLITS), BLOCK_N) * BLOCK_N
        start = start + tl.program_id(2) * share
        end = tl.minimum(end, start + share)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < GROUP
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        ok = offs < end
        slot = tl.load(indices_ptr + offs, mask=ok, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * stride_kt + h * stride_kh + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + h * stride_vh + d[None, :], mask=ok[:, None], other=0.0)
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
    heads = h * GROUP + g
    if SPLITS == 1:
        out = acc / l_sum[:, None]
        o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:  # an empty split (a short request) leaves lse -inf: the merge gives it weight 0
        row = ((b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * SPLITS + tl.program_id(2)) * (HEAD_DIM + 1)
        tl.store(part_ptr + row[:, None] + d[None, :], acc / tl.maximum(l_sum, 1e-30)[:, None], mask=g_ok[:, None])
        lse = tl.where(l_sum > 0, m + tl.log2(l_sum), float("-inf"))
        tl.store(part_ptr + row + HEAD_DIM, lse, mask=g_ok)


@triton.jit
def _merge_kernel(part_ptr, o_ptr, stride_ob, stride_oh, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per (request, query head): the splits' outputs weighted by their share of the
    softmax sum (every request has a token, so some split is not empty)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    rows = ((b.to(tl.int64) * tl.num_programs(1) + h) * SPLITS + sp) * (HEAD_DIM + 1)
    lse = tl.load(part_ptr + rows + HEAD_DIM)
    w = tl.exp2(lse - tl.max(lse, axis=0))
    parts = tl.load(part_ptr + rows[:, None] + d[None, :])
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


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
    splits: int = 1,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of one new token per request over its cached KV (module docstring).

    ``q`` (B, Hq, D); ``k_cache``/``v_cache`` (slots, Hk, D) or (slots, 1, Hk, D) (page size 1);
    ``indptr`` (B + 1,) and ``indices`` int32 on the device. Returns ``out`` (B, Hq, D). No host
    sync: capturable in a CUDA graph, where indptr/indices are the graph's fixed buffers.
    ``splits`` > 1 (a power of two): that many programs per (request, KV head), each over a
    share of the request's KV, then a merge launch (module docstring)."""
    if k_cache.dim() == 4:
        k_cache, v_cache = k_cache.squeeze(1), v_cache.squeeze(1)
    bs, hq, d = q.shape
    hk = k_cache.shape[1]
    if hq % hk or k_cache.shape[2] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"triton_decode_attention: q {tuple(q.shape)} against caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}: need Hq a multiple of Hk and one head dim")
    if d & (d - 1) or d < 16:
        raise ValueError(f"triton_decode_attention: head dim {d} must be a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("triton_decode_attention: q and the caches need a unit stride along the head dim")
    if out is None:
        out = torch.empty_like(q)
    if bs == 0:
        return out
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"triton_decode_attention: splits={splits} must be a power of two >= 1")
    group = hq // hk
    upcast = isinstance(_decode_kernel, InterpretedFunction)
    # Graph memory when captured: rewritten by every replay, read only by the merge after it.
    part = (torch.empty((bs, hq, splits, d + 1), dtype=torch.float32, device=q.device) if splits > 1 else out)
    _decode_kernel[(bs, hk, splits)](
        q, k_cache, v_cache, out, indptr, indices, part, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_N=block_n,
        SPLITS=splits, UPCAST_DOT=upcast, num_warps=4, num_stages=num_stages,
    )
    if splits > 1:
        _merge_kernel[(bs, hq)](part, out, out.stride(0), out.stride(1), SPLITS=splits, HEAD_DIM=d, num_warps=4)
    return out
