"""MoE routing in one Triton kernel: router logits -> fp32 softmax -> top-k ids and weights
(-> renormalised), the arithmetic of ``routing.softmax_topk``. Needs triton.

Shapes: T tokens, E experts, K experts per token.

Ties: among equal probabilities the lowest expert id is taken first (``torch.topk`` leaves the
order of ties unspecified), so ids may differ from torch's where probabilities tie exactly; the
weights, sorted largest first, are the same either way. Ids are always distinct and in [0, E).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dp_runtime.model.pdl import pdl_entry, pdl_meta, resolve_pdl
from dp_runtime.model.routing import PADDING_ID, check_top_k

__all__ = ["softmax_topk_triton"]


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,
    stride_lt,
    weights_ptr,  # (T, TOP_K) fp32 out
    ids_ptr,  # (T, TOP_K) int32 out
    live_ptr,  # (1,) int: rows from it on are padding (HAS_LIVE only)
    num_experts,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next power of two >= num_experts
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    ROUND_BF16: tl.constexpr,  # round the weights through bf16 (what Hugging Face's models do)
    HAS_LIVE: tl.constexpr,
    PADDING_ID: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    pdl_entry(PDL)
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    is_expert = experts < num_experts
    x = tl.load(logits_ptr + t * stride_lt + experts, mask=is_expert,
                other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    # Lanes past E get probability 0; they also have the highest indices, so the lowest-index
    # tie-break never takes one while an expert (even one whose probability underflowed) is left.
    p = p / tl.sum(p, axis=0)

    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best, idx = tl.max(p, axis=0, return_indices=True, return_indices_tie_break_left=True)
        top_w = tl.where(slots == k, best, top_w)
        top_i = tl.where(slots == k, idx, top_i)
        p = tl.where(experts == idx, -2.0, p)  # taken: below every lane still in the running
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)  # slots >= TOP_K hold 0
    if ROUND_BF16:
        top_w = top_w.to(tl.bfloat16).to(tl.float32)
    if HAS_LIVE:  # a padding row: no expert computes it
        live = t < tl.load(live_ptr).to(tl.int64)
        top_w = tl.where(live, top_w, 0.0)
        top_i = tl.where(live, top_i, PADDING_ID)
    out = t * TOP_K + slots
    tl.store(weights_ptr + out, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + out, top_i, mask=slots < TOP_K)


def softmax_topk_triton(logits_TE: torch.Tensor, top_k: int, *, renormalize: bool,
                        round_bf16: bool = False, live_rows: torch.Tensor | None = None,
                        pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing.softmax_topk`` in one launch: logits (T, E) in bf16, fp16 or fp32 to
    ``(weights_TK fp32, ids_TK int32)``, largest weight first, rounded through bf16 when
    ``round_bf16`` (a bf16 model's weights, as transformers rounds them). T = 0 launches nothing;
    no host sync. Weights match torch's within fp32 rounding (tens of ulp at most: the order of the
    sum differs, and on GPUs Triton's exp is the hardware's approximate exp2). ``live_rows``:
    as ``softmax_topk``'s (rows from it on get ``PADDING_ID`` and weight 0). ``pdl``: launch with
    programmatic dependent launch (None: where the device supports it, ``pdl.resolve_pdl``)."""
    check_top_k(logits_TE, top_k)
    t, e = logits_TE.shape
    weights_TK = torch.empty((t, top_k), dtype=torch.float32, device=logits_TE.device)
    ids_TK = torch.empty((t, top_k), dtype=torch.int32, device=logits_TE.device)
    if t == 0:
        return weights_TK, ids_TK
    if logits_TE.stride(1) != 1:
        logits_TE = logits_TE.contiguous()
    block_e = triton.next_power_of_2(e)
    _softmax_topk_kernel[(t,)](
        logits_TE, logits_TE.stride(0), weights_TK, ids_TK,
        ids_TK if live_rows is None else live_rows, e,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), ROUND_BF16=round_bf16,
        HAS_LIVE=live_rows is not None, PADDING_ID=PADDING_ID,
        # A row of up to 1024 experts fits one warp's registers (32 per thread): the reductions
        # stay within the warp, with no shared-memory round trips.
        num_warps=1 if block_e <= 1024 else 4, **pdl_meta(resolve_pdl(pdl, logits_TE, t)),
    )
    return weights_TK, ids_TK
