"""Qwen3's per-head q/k RMSNorm, the rotary embedding and the KV-cache store in one Triton kernel.

Written with separate kernels, the step between the fused QKV projection and attention costs
about nine launches per layer at decode: q and k made contiguous (they are strided views of the
projection's output), a norm for each, the rotary (which wants rows again), and an index copy
each for K and V into the cache. Here one program handles one head of one token (of a block of
16 tokens in large prefill steps) of the projection's output, read in place:

- a q head: RMSNorm with ``q_norm`` (when the model has it), RoPE at the token's position, and
  the result written to the dense ``q`` output ``[T, Hq, D]``;
- a k head: the same with ``k_norm``, written to ``k`` ``[T, Hkv, D]`` and to the cache row
  ``out_cache_loc[t]``; the matching v head is copied to the V cache row.

Rounding follows the unfused ops exactly (torch's and FlashInfer's): the norm computes in fp32
and rounds to the model dtype, the rotary reads those rounded values, computes in fp32 and rounds
again. RoPE is the neox layout (rotate halves) with a ``[positions, D]`` fp32 table of
``cos | sin``, the table ``layers.RotaryEmbedding`` builds (YaRN included).

An FP8 cache (``RuntimeConfig.kv_cache_dtype``) gets the rounded K and V clamped to +-448 and
rounded to e4m3, as ``kv_cache.to_kv_dtype`` does; ``q`` and ``k`` returned stay in the model's
dtype.

Capturable: static shapes, no host sync; padded graph rows carry position 0 and cache slot 0,
the slot reserved for padding.
"""

from __future__ import annotations

import torch

from dp_runtime.serving.kv_cache import FP8_KV_MAX, store_rows

__all__ = ["qk_norm_rope_store", "qk_norm_rope_store_reference"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch reference below serves
    triton = None


if triton is not None:
    from dp_runtime.model.pdl import pdl_entry, pdl_meta, resolve_pdl

    @triton.jit
    def _clamp(x, bound: tl.constexpr):
        return tl.minimum(tl.maximum(x.to(tl.float32), -bound), bound)

    # num_tokens not specialized: Triton would otherwise build a variant per token-count class
    # (== 1, a multiple of 16, other), and a prompt of an unseen class compiled in its TTFT.
    @triton.jit(do_not_specialize=["num_tokens"])
    def _qk_norm_rope_store_kernel(
        qkv_ptr, qkv_row_stride,
        q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr, loc_ptr,
        q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr,
        eps, num_tokens,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
        HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr,
        FP8_MAX: tl.constexpr,  # > 0: the cache is FP8, saturate at it
        PDL: tl.constexpr,  # launched with programmatic dependent launch
    ):
        pdl_entry(PDL)
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # this program's tokens
        h = tl.program_id(1)  # [0, HQ): q heads; [HQ, HQ + HKV): k heads (and their v)
        half = HALF
        t_ok = ts < num_tokens
        m = t_ok[:, None]
        offs = tl.arange(0, HALF)[None, :]
        rows = qkv_ptr + ts.to(tl.int64)[:, None] * qkv_row_stride
        is_q = h < HQ
        col = h * D  # q heads then k heads lie back to back in the projection's output
        x1 = tl.load(rows + col + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(rows + col + half + offs, mask=m, other=0.0).to(tl.float32)
        out_dtype = q_out_ptr.dtype.element_ty
        if HAS_NORM:
            rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
            w_ptr = tl.where(is_q, q_norm_ptr, k_norm_ptr)
            w1 = tl.load(w_ptr + offs).to(tl.float32)
            w2 = tl.load(w_ptr + half + offs).to(tl.float32)
            # round to the model dtype between norm and rotary, as the separate ops do
            x1 = (x1 * rstd * w1).to(out_dtype).to(tl.float32)
            x2 = (x2 * rstd * w2).to(out_dtype).to(tl.float32)
        pos = tl.load(pos_ptr + ts, mask=t_ok, other=0)
        cs = cos_sin_ptr + pos.to(tl.int64)[:, None] * D
        cos = tl.load(cs + offs, mask=m, other=0.0)
        sin = tl.load(cs + half + offs, mask=m, other=0.0)
        y1 = (x1 * cos - x2 * sin).to(out_dtype)
        y2 = (x2 * cos + x1 * sin).to(out_dtype)
        if is_q:
            dst = q_out_ptr + (ts.to(tl.int64)[:, None] * HQ + h) * D
            tl.store(dst + offs, y1, mask=m)
            tl.store(dst + half + offs, y2, mask=m)
        else:
            j = h - HQ
            dst = k_out_ptr + (ts.to(tl.int64)[:, None] * HKV + j) * D
            tl.store(dst + offs, y1, mask=m)
            tl.store(dst + half + offs, y2, mask=m)
            slot = tl.load(loc_ptr + ts, mask=t_ok, other=0).to(tl.int64)[:, None]
            kc = k_cache_ptr + (slot * HKV + j) * D
            full = tl.arange(0, D)[None, :]
            v = tl.load(rows + (HQ + HKV + j) * D + full, mask=m, other=0.0)
            cache_dtype = k_cache_ptr.dtype.element_ty
            if FP8_MAX > 0:  # saturate, then round to e4m3 (kv_cache.to_kv_dtype)
                tl.store(kc + offs, _clamp(y1, FP8_MAX).to(cache_dtype), mask=m)
                tl.store(kc + half + offs, _clamp(y2, FP8_MAX).to(cache_dtype), mask=m)
                tl.store(v_cache_ptr + (slot * HKV + j) * D + full,
                         _clamp(v, FP8_MAX).to(cache_dtype), mask=m)
            else:
                tl.store(kc + offs, y1, mask=m)
                tl.store(kc + half + offs, y2, mask=m)
                tl.store(v_cache_ptr + (slot * HKV + j) * D + full, v, mask=m)


# Tokens per program: one at decode sizes (every (token, head) pair a program of one warp, the
# most parallel); blocks of 16 for prefill, where a program per pair (over 300K of them at 8192
# tokens) spends its time starting and stopping rather than moving bytes. From 64 tokens, not
# 1024: streamed extend steps on an H200 (`run_gpu.sh var8`) went 8.83 -> 8.60 ms at 1 x 256 and
# 7.50 -> 7.42 at 1 x 128 (the spread between two identical trees there: 0.6-0.9%).
_BLOCK_T_FROM = 64


def qk_norm_rope_store(
    qkv_TX: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos_sin_PD: torch.Tensor,
    positions_T: torch.Tensor,
    out_cache_loc_T: torch.Tensor,
    k_cache_SHD: torch.Tensor,
    v_cache_SHD: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm, rotate and store one layer's q/k/v (module docstring); one launch (``pdl``: with
    programmatic dependent launch; None: where the device supports it, ``pdl.resolve_pdl``).

    Takes the fused projection output ``[T, (Hq + 2 Hkv) * D]`` (rows may be strided), the norm
    weights (None: no q/k norm, e.g. Mixtral), the cos|sin table, positions and cache slots, and
    the layer's K/V caches ``[slots, Hkv, D]``. Returns dense ``q`` ``[T, Hq, D]`` and ``k``
    ``[T, Hkv, D]``; K and V are in the cache.
    """
    t = qkv_TX.shape[0]
    q = qkv_TX.new_empty((t, num_heads, head_dim))
    k = qkv_TX.new_empty((t, num_kv_heads, head_dim))
    if t == 0:
        return q, k
    if qkv_TX.stride(1) != 1:
        raise ValueError("qk_norm_rope_store: the projection's rows must be contiguous")
    has_norm = q_norm is not None
    w = q_norm if has_norm else cos_sin_PD  # any pointer: unread without a norm
    block_t = 1 if t < _BLOCK_T_FROM else 16
    _qk_norm_rope_store_kernel[(triton.cdiv(t, block_t), num_heads + num_kv_heads)](
        qkv_TX, qkv_TX.stride(0),
        w, k_norm if has_norm else w, cos_sin_PD, positions_T, out_cache_loc_T,
        q, k, k_cache_SHD, v_cache_SHD,
        eps, t,
        HQ=num_heads, HKV=num_kv_heads, D=head_dim, HALF=head_dim // 2, HAS_NORM=has_norm,
        BLOCK_T=block_t,
        FP8_MAX=FP8_KV_MAX if k_cache_SHD.dtype == torch.float8_e4m3fn else 0.0,
        num_warps=(1 if head_dim <= 128 else 2) if block_t == 1 else 4,
        **pdl_meta(resolve_pdl(pdl, qkv_TX, t)),
    )
    return q, k


def qk_norm_rope_store_reference(
    qkv_TX: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    rotary,
    positions_T: torch.Tensor,
    out_cache_loc_T: torch.Tensor,
    k_cache_SHD: torch.Tensor,
    v_cache_SHD: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same computation with torch ops (the unfused path; what tests compare against)."""
    from dp_runtime.model.layers import rms_norm

    t = qkv_TX.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv_TX.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rotary.apply(q, k, positions_T)
    store_rows(k_cache_SHD, out_cache_loc_T, k)
    store_rows(v_cache_SHD, out_cache_loc_T, v.reshape(t, num_kv_heads, head_dim))
    return q.contiguous(), k.contiguous()
