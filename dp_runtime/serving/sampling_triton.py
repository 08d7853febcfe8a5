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

The top-p threshold of a row without top-k (``top_p_triton``) is found without sorting its
vocabulary: a search over the row's values, one program per row. A candidate value v is kept
by top-p when the mass of the tokens strictly above it is below ``top_p`` (at the row's
temperature); that mass only grows as v falls, so the threshold (the smallest kept value of the
row) is found by narrowing an interval (lo, hi) with lo failing and hi kept. Each pass reads the
row once and weighs ``_PIVOTS`` pivots inside the interval at once (the mass above each), spaced
evenly in value while the interval spans exponents, then evenly in the floats' ordered bit
patterns, so the search ends exactly on a logit of the row. It stops as soon as no logit of the
row lies strictly inside the interval: the threshold is then the row's smallest logit above lo.
The row's tokens lie sparse in the tail where a nucleus ends, so a few passes suffice; with a
rows x vocabulary sort gone, so is its memory (memory_estimates.draw_phase_bytes).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: sampling draws with torch
    triton = None

__all__ = ["race_triton", "top_p_triton"]

_BLOCK = 2048
# A constant third Philox counter word: the draw's stream is not any other Philox use of the seed.
_DOMAIN = 0x5A4D
_PIVOTS = 16  # pivots weighed per pass of the top-p search (a power of two): ~4 bits of the interval
_SEARCH_BLOCK = 512  # columns per load of the search: its pivots x columns masses sit in registers
_MAX_PASSES = 48  # bounds a row of NaNs (flagged by the race); a finite row ends in at most ~10


if triton is not None:

    @triton.jit
    def _race_kernel(logits_ptr, stride_l, rows_ptr, temp_ptr, thr_ptr, seed_ptr, index_ptr, tok_ptr, bad_ptr,
                     vocab, DOMAIN: tl.constexpr, BLOCK: tl.constexpr):
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
            x = tl.load(logits_ptr + row * stride_l + cols, mask=inside, other=-float("inf")).to(tl.float32)
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


    @triton.jit
    def _key(x):
        """A float32's ordered bit pattern (int32): a < b as floats iff _key(a) < _key(b)."""
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _unkey(k):
        return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _top_p_kernel(logits_ptr, stride_l, rows_ptr, temp_ptr, top_p_ptr, thr_ptr, vocab,
                      PIVOTS: tl.constexpr, BLOCK: tl.constexpr, MAX_PASSES: tl.constexpr):
        r = tl.program_id(0)
        base = logits_ptr + tl.load(rows_ptr + r) * stride_l
        scale = 1.4426950408889634 / tl.load(temp_ptr + r)  # exp(z) = exp2(x * scale)
        top_p = tl.load(top_p_ptr + r)
        cols0 = tl.arange(0, BLOCK)
        mx = tl.full((), -float("inf"), tl.float32)
        mn = tl.full((), float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            inside = start + cols0 < vocab
            x = tl.load(base + start + cols0, mask=inside, other=-float("inf")).to(tl.float32)
            mx = tl.maximum(mx, tl.max(x, axis=0))
            mn = tl.minimum(mn, tl.min(tl.where(x > -float("inf"), x, float("inf")), axis=0))
        # lo fails (the row's whole mass lies above it: -inf logits have none), hi is kept.
        lo = _key(mn).to(tl.int64) - 1
        hi = _key(mx).to(tl.int64)
        top = hi - 1  # the largest logit below hi, or above it: where the pivots end
        big = tl.full((), 1 << 40, tl.int64)
        found = hi
        done = tl.full((), 0, tl.int32)
        passes = tl.full((), 0, tl.int32)
        steps = (tl.arange(0, PIVOTS) + 1).to(tl.int64)
        while (done == 0) & (passes < MAX_PASSES):
            # PIVOTS pivots over (lo, top], the last one on top: a lone logit left in the
            # interval is weighed in the next pass, never bisected towards.
            lo_f = _unkey(lo)
            by_value = lo_f + (_unkey(top) - lo_f) * (steps.to(tl.float32) / PIVOTS)
            by_bits = lo + (top - lo) * steps // PIVOTS
            wide = (top - lo > (1 << 23)) & (lo_f > -float("inf"))
            piv = tl.where(wide, _key(by_value).to(tl.int64), by_bits)
            piv = tl.minimum(tl.maximum(piv, lo + 1), hi - 1).to(tl.int32)  # ascending, inside
            lo32 = lo.to(tl.int32)
            hi32 = hi.to(tl.int32)
            mass = tl.zeros((PIVOTS, BLOCK), tl.float32)
            total = tl.zeros((BLOCK,), tl.float32)
            above_lo = tl.full((BLOCK,), 2147483647, tl.int32)
            below_hi = tl.full((BLOCK,), -2147483647 - 1, tl.int32)
            for start in range(0, vocab, BLOCK):
                inside = start + cols0 < vocab
                x = tl.load(base + start + cols0, mask=inside, other=-float("inf")).to(tl.float32)
                k = _key(x)
                e = tl.where(inside, tl.exp2((x - mx) * scale), 0.0)
                total += e
                mass += tl.where(k[None, :] > piv[:, None], e[None, :], 0.0)
                above_lo = tl.minimum(above_lo, tl.where(inside & (k > lo32), k, 2147483647))
                below_hi = tl.maximum(below_hi, tl.where(inside & (k < hi32), k, -2147483647 - 1))
            a = tl.min(above_lo, axis=0).to(tl.int64)
            b = tl.max(below_hi, axis=0).to(tl.int64)
            done = (a > b).to(tl.int32)  # no logit strictly inside (lo, hi): a is the threshold
            found = a
            fails = tl.sum(mass, axis=1) >= top_p * tl.sum(total, axis=0)  # a prefix of the pivots
            piv64 = piv.to(tl.int64)
            # Nothing lies in (lo, a): the mass above a - 1 is the mass above lo, which fails.
            lo = tl.maximum(tl.maximum(lo, tl.max(tl.where(fails, piv64, lo), axis=0)), a - 1)
            hi = tl.minimum(hi, tl.min(tl.where(fails, big, piv64), axis=0))
            top = tl.minimum(b, hi - 1)
            passes += 1
        tl.store(thr_ptr + r, _unkey(found))


def race_triton(logits_BV: torch.Tensor, rows_R: torch.Tensor, temp_R: torch.Tensor, thr_R: torch.Tensor,
                seed_R: torch.Tensor, index_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drawn token (int64) and the undefined-draw flag (bool) of each row ``rows_R`` of
    ``logits_BV`` (float32, unit column stride): temperature ``temp_R``, raw-logit threshold
    ``thr_R``, the request's ``seed_R`` (int64, the seed's 64 bits) and the token's output
    ``index_R``. One launch, no host sync: capturable and overlap-safe."""
    n = rows_R.shape[0]
    tok_R = torch.empty(n, dtype=torch.int64, device=logits_BV.device)
    bad_R = torch.empty(n, dtype=torch.bool, device=logits_BV.device)
    if n:
        _race_kernel[(n,)](logits_BV, logits_BV.stride(0), rows_R, temp_R, thr_R, seed_R, index_R, tok_R, bad_R,
                           logits_BV.shape[1], DOMAIN=_DOMAIN, BLOCK=_BLOCK, num_warps=8)
    return tok_R, bad_R


def top_p_triton(logits_BV: torch.Tensor, rows_R: torch.Tensor, temp_R: torch.Tensor,
                 top_p_R: torch.Tensor) -> torch.Tensor:
    """Each row ``rows_R`` of ``logits_BV``'s top-p threshold (float32, on its raw logits): the
    smallest logit whose tokens strictly above it, at temperature ``temp_R``, hold less than
    ``top_p_R`` (in (0, 1)) of the row's mass; ``sampling._top_p_threshold``'s value without its
    sort. One launch, no host sync."""
    n = rows_R.shape[0]
    thr_R = torch.empty(n, dtype=torch.float32, device=logits_BV.device)
    if n:
        _top_p_kernel[(n,)](logits_BV, logits_BV.stride(0), rows_R, temp_R, top_p_R, thr_R, logits_BV.shape[1],
                            PIVOTS=_PIVOTS, BLOCK=_SEARCH_BLOCK, MAX_PASSES=_MAX_PASSES, num_warps=8)
    return thr_R
