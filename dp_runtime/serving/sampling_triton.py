"""The exponential race of ``sampling.draw_tokens`` on CUDA: every sampled row's draw in one
Triton launch, its noise counter-based (Philox keyed by the request's seed, counted by the
token's index in the output and the vocabulary column), so a draw needs no generator object,
no per-row launch and no rows x vocabulary temporary.

One program per sampled row walks the vocabulary in ``BLOCK`` columns: ``z = x / T`` (x the raw
logit), ``score = z - log(E)`` with ``E = -log(u)`` and ``u`` Philox's uniform for (seed; column,
index), tokens whose raw logit is below the row's threshold (top-k / top-p, found by
``sampling``; -inf keeps all) dropped, and a running argmax (the first column wins a tie). It
also flags the row where a ``z`` is NaN or +inf: the draw is then undefined.

The threshold is compared against the raw logits, never against ``z``: Triton's float32
division is not the correctly rounded one torch uses, so a ``z`` recomputed here could fall an
ulp below a threshold torch found, and drop the very token that set it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: sampling draws with torch
    triton = None

__all__ = ["race_triton"]

_BLOCK = 2048
# A constant third Philox counter word: the draw's stream is not any other Philox use of the seed.
_DOMAIN = 0x5A4D


if triton is not None:

    @triton.jit
    def _race_kernel(logits_ptr, stride_l, rows_ptr, temp_ptr, thr_ptr, seed_ptr, index_ptr,
                     tok_ptr, bad_ptr, vocab, DOMAIN: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        row = tl.load(rows_ptr + r)
        t = tl.load(temp_ptr + r)
        thr = tl.load(thr_ptr + r)
        seed = tl.load(seed_ptr + r)
        index = tl.load(index_ptr + r)
        c1 = (index & 0xFFFFFFFF).to(tl.uint32)
        c2 = ((index >> 32) & 0xFFFFFFFF).to(tl.uint32)
        best = tl.full((), -float("inf"), tl.float32)
        best_col = tl.full((), 0, tl.int64)
        bad = tl.full((), 0, tl.int32)
        cols0 = tl.arange(0, BLOCK)
        for start in range(0, vocab, BLOCK):
            cols = start + cols0
            inside = cols < vocab
            x = tl.load(logits_ptr + row * stride_l + cols, mask=inside,
                        other=-float("inf")).to(tl.float32)
            z = x / t
            bad |= tl.max(((z != z) | (z == float("inf"))).to(tl.int32), axis=0)
            zero = tl.zeros_like(cols0).to(tl.uint32)
            u, _, _, _ = tl.philox(seed, cols.to(tl.uint32), c1 + zero, c2 + zero, zero + DOMAIN)
            e = -tl.log(tl.uint_to_uniform_float(u))
            score = tl.where(inside & (x >= thr), z - tl.log(e), -float("inf"))
            blk = tl.max(score, axis=0)
            col = start + tl.argmax(score, axis=0).to(tl.int64)
            best_col = tl.where(blk > best, col, best_col)
            best = tl.maximum(best, blk)
        tl.store(tok_ptr + r, best_col)
        tl.store(bad_ptr + r, bad != 0)


def race_triton(logits_BV: torch.Tensor, rows_R: torch.Tensor, temp_R: torch.Tensor,
                thr_R: torch.Tensor, seed_R: torch.Tensor,
                index_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drawn token (int64) and the undefined-draw flag (bool) of each row ``rows_R`` of
    ``logits_BV`` (float32, unit column stride): temperature ``temp_R``, raw-logit threshold
    ``thr_R``, the request's ``seed_R`` (int64, the seed's 64 bits) and the token's output
    ``index_R``. One launch, no host sync: capturable and overlap-safe."""
    n = rows_R.shape[0]
    tok_R = torch.empty(n, dtype=torch.int64, device=logits_BV.device)
    bad_R = torch.empty(n, dtype=torch.bool, device=logits_BV.device)
    if n:
        _race_kernel[(n,)](logits_BV, logits_BV.stride(0), rows_R, temp_R, thr_R, seed_R, index_R,
                           tok_R, bad_R, logits_BV.shape[1], DOMAIN=_DOMAIN, BLOCK=_BLOCK,
                           num_warps=8)
    return tok_R, bad_R
