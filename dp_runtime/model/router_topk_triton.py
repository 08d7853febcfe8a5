"""The MoE router in one Triton kernel: ``x @ w.T`` -> logits rounded to x's dtype -> fp32 softmax
-> top-k ids and weights (-> renormalised, -> rounded through bf16). Replaces
``F.linear(x_TH, w_router_EH)`` followed by ``routing_triton.softmax_topk_triton(logits, top_k,
renormalize=..., round_bf16=True)``. Needs triton.

Why: at 3-256 rows the router is a tiny GEMM against a 0.5 MB weight (Qwen3-30B-A3B: E = 128
experts, H = 2048), yet on an H200 cuBLAS runs it as a split-K GEMM of about 5.5 us and the top-k
is a second launch of 2.4 us. One launch that keeps the logits in registers removes the second
launch, the (T, E) logits round trip and the split-K reduction.

- Grid ``(cdiv(T, BLOCK_T),)``: each program takes BLOCK_T tokens and every expert, so the
  softmax and the top-k need no communication between programs. It accumulates the
  [BLOCK_T, BLOCK_E] logits in fp32 with ``tl.dot`` over H in BLOCK_K chunks (BLOCK_T = 16, the
  smallest tensor-core tile; BLOCK_E the next power of two >= E, lanes past E masked).
- The logits are rounded to x's dtype and back before the softmax: the unfused path's logits are
  a bf16 (or fp16) tensor, and the routing must not change with the fusion. The fp32 sums are
  taken in another order than cuBLAS's, so a logit whose exact value lies within a few fp32 ulp
  of a rounding boundary of x's dtype may come out one unit in its last place away.
- Then, per row, the arithmetic of ``routing_triton._softmax_topk_kernel`` along axis 1:
  ``exp(x - max) / sum`` in fp32 (lanes past E are -inf: probability 0), ``TOP_K`` rounds of a
  row max whose ties go to the lowest expert id (``torch.topk`` leaves the order of ties
  unspecified; the weights, largest first, are the same either way), optional renormalisation,
  optional rounding of the weights through bf16 (what Hugging Face's bf16 models do).

Outputs: ``weights_TK`` fp32 and ``ids_TK`` int32, largest weight first; ids distinct, in [0, E).
T = 0 launches nothing. No host sync, the only allocations are the outputs, and the token count
is not specialized on (one build serves every step size): capturable in a CUDA graph. CUDA
tensors (Triton's CPU interpreter, ``TRITON_INTERPRET=1``, runs it on CPU ones for the tests).

Shapes: T tokens, H hidden, E experts, K experts per token.
"""

from __future__ import annotations

import os

import torch

__all__ = ["ROUTER_MAX_EXPERTS", "check_router_args", "router_softmax_topk"]

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU installs: the unfused torch routing is used
    triton = None

# A program holds a [BLOCK_T, BLOCK_E] fp32 accumulator and the probabilities of the same shape
# in registers: at 1024 experts that is 128 + 128 per thread at 4 warps, the most that fits.
ROUTER_MAX_EXPERTS = 1024
_DTYPES = (torch.bfloat16, torch.float16)
_BLOCK_T = 16
# Elements of one [BLOCK_K, BLOCK_E] weight tile: 32 KB of bf16, so that num_stages = 3 tiles in
# flight stay well inside shared memory. E = 128 gets BLOCK_K = 128; larger E a shorter chunk.
_W_TILE = 128 * 128
_NUM_WARPS = 4
_NUM_STAGES = 3


if triton is not None:

    @triton.jit(do_not_specialize=["num_tokens"])
    def _router_topk_kernel(
        x_ptr,  # (T, H), unit stride along H
        stride_xt,
        w_ptr,  # (E, H), unit stride along H
        stride_we,
        weights_ptr,  # (T, TOP_K) fp32 out
        ids_ptr,  # (T, TOP_K) int32 out
        num_tokens,
        num_experts,
        hidden,
        TOP_K: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        ROUND_BF16: tl.constexpr,  # round the weights through bf16 (what Hugging Face's models do)
        EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0: no mask along H
        UPCAST_DOT: tl.constexpr,  # Triton's CPU interpreter only: it has no bf16 matmul
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,  # next power of two >= num_experts, at least 16 (tl.dot's minimum)
        BLOCK_K: tl.constexpr,
        BLOCK_TOPK: tl.constexpr,  # next power of two >= TOP_K
    ):
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        is_token = tokens < num_tokens
        experts = tl.arange(0, BLOCK_E)
        is_expert = experts < num_experts
        offs_k = tl.arange(0, BLOCK_K)
        # int64: T * stride and E * H may pass 2^31
        x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
        # The (E, H) weight read as [BLOCK_K, BLOCK_E]: the B operand of tl.dot, contiguous along K.
        w_ptrs = w_ptr + experts.to(tl.int64)[None, :] * stride_we + offs_k[:, None]

        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for kk in range(0, tl.cdiv(hidden, BLOCK_K)):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=is_token[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=is_expert[None, :], other=0.0)
            else:
                k_ok = offs_k < hidden - kk * BLOCK_K
                x = tl.load(x_ptrs, mask=is_token[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & is_expert[None, :], other=0.0)
            if UPCAST_DOT:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc=acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

        # The unfused path's logits are a tensor of x's dtype: round as cuBLAS's epilogue does.
        logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        logits = tl.where(is_expert[None, :], logits, float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        # Lanes past E get probability 0; they also have the highest indices, so the lowest-index
        # tie-break never takes one while an expert (even one whose probability underflowed) is
        # left. Rows past T compute on zeros (no NaN) and are never stored.
        p = p / tl.sum(p, axis=1)[:, None]

        slots = tl.arange(0, BLOCK_TOPK)[None, :]
        top_w = tl.zeros((BLOCK_T, BLOCK_TOPK), dtype=tl.float32)
        top_i = tl.zeros((BLOCK_T, BLOCK_TOPK), dtype=tl.int32)
        for k in tl.static_range(TOP_K):
            best, idx = tl.max(p, axis=1, return_indices=True, return_indices_tie_break_left=True)
            top_w = tl.where(slots == k, best[:, None], top_w)
            top_i = tl.where(slots == k, idx[:, None], top_i)
            p = tl.where(experts[None, :] == idx[:, None], -2.0, p)  # taken: below every lane left
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=1)[:, None]  # slots >= TOP_K hold 0
        if ROUND_BF16:
            top_w = top_w.to(tl.bfloat16).to(tl.float32)
        out = tokens.to(tl.int64)[:, None] * TOP_K + slots
        out_ok = is_token[:, None] & (slots < TOP_K)
        tl.store(weights_ptr + out, top_w, mask=out_ok)
        tl.store(ids_ptr + out, top_i, mask=out_ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _tiles(num_experts: int, hidden: int) -> tuple[int, int]:
    """``(BLOCK_E, BLOCK_K)``: every expert in one block (at least 16, tl.dot's minimum), and a
    K chunk of 128 cut to the weight-tile budget for large E, or to H's next power of two when H
    is small (at least 16)."""
    block_e = max(16, _next_pow2(num_experts))
    block_k = max(16, min(128, _W_TILE // block_e, _next_pow2(hidden)))
    return block_e, block_k


def check_router_args(x_TH: torch.Tensor, w_EH: torch.Tensor, top_k: int, block_t: int | None = None) -> None:
    """Raise ValueError, naming the value and the limit, where ``router_softmax_topk`` cannot
    take its arguments. Reads only shapes, strides and dtypes: no device work."""
    if x_TH.dim() != 2 or w_EH.dim() != 2:
        raise ValueError(f"router_softmax_topk: x and w must be 2-D, got x {tuple(x_TH.shape)} and "
                         f"w {tuple(w_EH.shape)}")
    h = x_TH.shape[1]
    e = w_EH.shape[0]
    if w_EH.shape[1] != h:
        raise ValueError(f"router_softmax_topk: x has H={h} columns but w has H={w_EH.shape[1]}")
    if e > ROUTER_MAX_EXPERTS:
        raise ValueError(f"router_softmax_topk: w has E={e} experts, more than "
                         f"ROUTER_MAX_EXPERTS={ROUTER_MAX_EXPERTS}")
    if not 1 <= top_k <= e:  # routing.check_top_k's rule and message
        raise ValueError(f"top_k={top_k}: must be in [1, E={e}]")
    if x_TH.dtype not in _DTYPES or w_EH.dtype != x_TH.dtype:
        raise ValueError(f"router_softmax_topk: x and w must share a dtype of bfloat16/float16, got "
                         f"x {x_TH.dtype} and w {w_EH.dtype}")
    if x_TH.stride(1) != 1 or w_EH.stride(1) != 1:
        raise ValueError(f"router_softmax_topk: x and w must be contiguous along H (stride 1), got "
                         f"strides x {x_TH.stride()} and w {w_EH.stride()}")
    if x_TH.device != w_EH.device:
        raise ValueError(f"router_softmax_topk: x is on {x_TH.device} but w on {w_EH.device}")
    if block_t is not None and (block_t < 16 or block_t & (block_t - 1)):
        raise ValueError(f"router_softmax_topk: block_t={block_t} must be a power of two >= 16")
    if not x_TH.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"router_softmax_topk: needs CUDA tensors, got {x_TH.device} "
                         "(TRITON_INTERPRET=1 runs it on CPU ones)")


def router_softmax_topk(x_TH: torch.Tensor, w_EH: torch.Tensor, top_k: int, *, renormalize: bool,
                        round_bf16: bool = True, block_t: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax_topk_triton(F.linear(x_TH, w_EH), top_k, renormalize=..., round_bf16=...)`` in
    one launch: ``(weights_TK fp32, ids_TK int32)``, largest weight first. ``x_TH`` (T, H) and
    ``w_EH`` (E, H) in bf16 or fp16, unit stride along H (x's rows may be strided), E <=
    ROUTER_MAX_EXPERTS. ``block_t`` overrides BLOCK_T = 16 (a power of two >= 16; benchmarks).
    T = 0 launches nothing; no host sync. Raises ValueError for arguments it cannot take
    (``check_router_args``)."""
    check_router_args(x_TH, w_EH, top_k, block_t)
    if triton is None:
        raise RuntimeError("router_softmax_topk: needs triton")
    t, h = x_TH.shape
    e = w_EH.shape[0]
    weights_TK = torch.empty((t, top_k), dtype=torch.float32, device=x_TH.device)
    ids_TK = torch.empty((t, top_k), dtype=torch.int32, device=x_TH.device)
    if t == 0:
        return weights_TK, ids_TK
    block_t = block_t or _BLOCK_T
    block_e, block_k = _tiles(e, h)
    _router_topk_kernel[(triton.cdiv(t, block_t),)](
        x_TH, x_TH.stride(0), w_EH, w_EH.stride(0), weights_TK, ids_TK, t, e, h,
        TOP_K=top_k, RENORMALIZE=renormalize, ROUND_BF16=round_bf16, EVEN_K=h % block_k == 0,
        UPCAST_DOT=isinstance(_router_topk_kernel, InterpretedFunction),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, BLOCK_TOPK=_next_pow2(top_k),
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    return weights_TK, ids_TK
