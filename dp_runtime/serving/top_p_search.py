"""The top-p threshold of rows without top-k on CUDA, found without sorting their vocabulary
(``sampling._thresholds``; CPU ranks sort).

A candidate value v of a row is kept by top-p when the mass of the row's tokens strictly above
it (at the row's temperature) is below ``top_p``. That mass only grows as v falls, so the
threshold, the row's smallest kept logit, is found by narrowing an interval (lo, hi) where lo
fails and hi is kept:

- a pass reads the row once and weighs ``PIVOTS`` pivots inside the interval at once (the mass
  above each): half spaced evenly in value (fast where the interval spans exponents), half
  evenly in the floats' ordered bit patterns (which bounds the passes: each cuts the interval's
  patterns at least 8-fold, so ``PASSES`` suffice for any finite row);
- the last pivot sits on the largest logit inside the interval, so a lone logit left there is
  weighed in the next pass rather than bisected towards;
- the search ends as soon as no logit lies strictly inside the interval: the threshold is then
  the row's smallest logit above lo, exactly (ties all kept, as the race keeps ``x >= thr``).

The tail where a nucleus ends is sparse, so a row is done after a few passes. Each row is split
into ``SPLIT`` slices, a program each, so that 64 rows fill an H100 (one program per row left
most of each SM idle); a pass is one launch whose programs first reduce the previous pass's
per-slice sums, in a fixed order (so every program of a row takes the same next interval, and a
row's threshold does not depend on its batch), then weigh their slice. ``PASSES`` launches, no
host sync, a few kilobytes of state; a done row's programs return at once.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: sampling sorts
    triton = None

__all__ = ["PASSES", "top_p_thresholds"]

PIVOTS = 16  # pivots weighed per pass: 8 by value, 8 by bit pattern
# programs per row (set by the vocabulary alone: the sums' order, so the threshold, is the row's
# own)
SPLIT = 8
BLOCK = 512  # columns per load (at most): a program's pivots x columns masses sit in registers
PASSES = 12  # 8-fold cuts of 2**32 patterns, and one pass to see the interval empty
_STATE = 8  # int64 words a row's search state takes: lo, hi, top, done, found (padded)


if triton is not None:

    @triton.jit
    def _key(x):
        """A float32's ordered bit pattern (int32): a < b as floats iff _key(a) < _key(b)."""
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _unkey(k):
        return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _slice(vocab, s, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        width = tl.cdiv(tl.cdiv(vocab, SPLIT), BLOCK) * BLOCK
        return s * width, tl.minimum(s * width + width, vocab)

    @triton.jit
    def _row_max(ext_ptr, r, SPLIT: tl.constexpr):
        return tl.max(tl.load(ext_ptr + (r * SPLIT + tl.arange(0, SPLIT)) * 2), axis=0)

    @triton.jit
    def _pivots(lo, top, hi, PIVOTS: tl.constexpr):
        """Pivots inside (lo, hi) (int32 patterns): PIVOTS / 2 evenly in value over (lo, top],
        the rest evenly in pattern; by pattern alone where lo is not a finite float."""
        half: tl.constexpr = PIVOTS // 2
        j = tl.arange(0, PIVOTS)
        step = (j % half + 1).to(tl.int64)
        lo_f = _unkey(lo)
        by_value = _key(lo_f + (_unkey(top) - lo_f) * (step.to(tl.float32) / half)).to(tl.int64)
        by_bits = lo + (top - lo) * step // half
        finite = ((lo_f > -float("inf")) & (lo_f == lo_f)).to(tl.int32)  # (an int: the interpreter
        # & no scalar with a vector)
        piv = tl.where((j < half).to(tl.int32) * finite != 0, by_value, by_bits)
        return tl.minimum(tl.maximum(piv, lo + 1), hi - 1)

    @triton.jit
    def _advance(state_ptr, mass_ptr, ab_ptr, ext_ptr, top_p_ptr, r, prev, n_rows,
                 FIRST: tl.constexpr, SPLIT: tl.constexpr, PIVOTS: tl.constexpr,
                 STATE: tl.constexpr):
        """The row's interval after pass ``prev`` (its state and per-slice sums), or the first
        one: (lo, hi, top, done, found)."""
        if FIRST:
            sl = tl.arange(0, SPLIT)
            mn = tl.min(tl.load(ext_ptr + (r * SPLIT + sl) * 2 + 1), axis=0)
            hi = _key(_row_max(ext_ptr, r, SPLIT)).to(tl.int64)
            lo = _key(mn).to(tl.int64) - 1  # the whole mass lies above it (-inf logits have none)
            top = hi - 1
            done = hi - hi
            found = hi
        else:
            st = state_ptr + ((prev % 2) * n_rows + r) * STATE
            lo = tl.load(st)
            hi = tl.load(st + 1)
            top = tl.load(st + 2)
            done = tl.load(st + 3)
            found = tl.load(st + 4)
            if done == 0:
                piv = _pivots(lo, top, hi, PIVOTS)
                part = (prev % 2) * n_rows + r
                sl = tl.arange(0, SPLIT)
                cells = (mass_ptr + (part * SPLIT + sl[:, None]) * (PIVOTS + 1)
                         + tl.arange(0, PIVOTS)[None, :])
                mass = tl.sum(tl.load(cells), axis=0)
                total = tl.sum(tl.load(mass_ptr + (part * SPLIT + sl) * (PIVOTS + 1) + PIVOTS),
                               axis=0)
                a = tl.min(tl.load(ab_ptr + (part * SPLIT + sl) * 2), axis=0).to(tl.int64)
                b = tl.max(tl.load(ab_ptr + (part * SPLIT + sl) * 2 + 1), axis=0).to(tl.int64)
                done = (a > b).to(tl.int64)  # no logit strictly inside (lo, hi): a is the threshold
                found = a
                fails = mass >= tl.load(top_p_ptr + r) * total  # monotone in the pivot
                # Nothing lies in (lo, a): the mass above a - 1 is the mass above lo, which fails.
                lo = tl.maximum(tl.maximum(lo, tl.max(tl.where(fails, piv, lo), axis=0)), a - 1)
                hi = tl.minimum(hi, tl.min(tl.where(fails, hi, piv), axis=0))
                top = tl.minimum(b, hi - 1)
        return lo, hi, top, done, found

    @triton.jit
    def _extremes_kernel(logits_ptr, stride_l, rows_ptr, ext_ptr, vocab, SPLIT: tl.constexpr,
                         BLOCK: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        base = logits_ptr + tl.load(rows_ptr + r) * stride_l
        c0, c1 = _slice(vocab, s, SPLIT, BLOCK)
        cols = tl.arange(0, BLOCK)
        mx = tl.full((), -float("inf"), tl.float32)
        mn = tl.full((), float("inf"), tl.float32)
        for start in range(c0, c1, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < c1,
                        other=-float("inf")).to(tl.float32)
            mx = tl.maximum(mx, tl.max(x, axis=0))
            mn = tl.minimum(mn, tl.min(tl.where(x > -float("inf"), x, float("inf")), axis=0))
        tl.store(ext_ptr + (r * SPLIT + s) * 2, mx)
        tl.store(ext_ptr + (r * SPLIT + s) * 2 + 1, mn)

    @triton.jit
    def _pass_kernel(logits_ptr, stride_l, rows_ptr, temp_ptr, top_p_ptr, ext_ptr, state_ptr,
                     mass_ptr, ab_ptr, vocab, n_rows, t, FIRST: tl.constexpr, SPLIT: tl.constexpr,
                     PIVOTS: tl.constexpr, BLOCK: tl.constexpr, STATE: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        lo, hi, top, done, found = _advance(state_ptr, mass_ptr, ab_ptr, ext_ptr, top_p_ptr, r,
                                            t - 1, n_rows, FIRST, SPLIT, PIVOTS, STATE)
        if s == 0:
            st = state_ptr + ((t % 2) * n_rows + r) * STATE
            tl.store(st, lo)
            tl.store(st + 1, hi)
            tl.store(st + 2, top)
            tl.store(st + 3, done)
            tl.store(st + 4, found)
        if done == 0:
            piv = _pivots(lo, top, hi, PIVOTS).to(tl.int32)
            lo32 = lo.to(tl.int32)
            hi32 = hi.to(tl.int32)
            mx = _row_max(ext_ptr, r, SPLIT)
            # exp(z - z_max) = exp2((x - mx) * scale)
            scale = 1.4426950408889634 / tl.load(temp_ptr + r)
            base = logits_ptr + tl.load(rows_ptr + r) * stride_l
            c0, c1 = _slice(vocab, s, SPLIT, BLOCK)
            cols = tl.arange(0, BLOCK)
            mass = tl.zeros((PIVOTS, BLOCK), tl.float32)
            total = tl.zeros((BLOCK,), tl.float32)
            above_lo = tl.full((BLOCK,), 2147483647, tl.int32)
            below_hi = tl.full((BLOCK,), -2147483647 - 1, tl.int32)
            for start in range(c0, c1, BLOCK):
                inside = start + cols < c1
                x = tl.load(base + start + cols, mask=inside, other=-float("inf")).to(tl.float32)
                k = _key(x)
                e = tl.where(inside, tl.exp2((x - mx) * scale), 0.0)
                total += e
                mass += tl.where(k[None, :] > piv[:, None], e[None, :], 0.0)
                above_lo = tl.minimum(above_lo, tl.where(inside & (k > lo32), k, 2147483647))
                below_hi = tl.maximum(below_hi, tl.where(inside & (k < hi32), k, -2147483647 - 1))
            part = (t % 2) * n_rows + r
            out = mass_ptr + (part * SPLIT + s) * (PIVOTS + 1)
            tl.store(out + tl.arange(0, PIVOTS), tl.sum(mass, axis=1))
            tl.store(out + PIVOTS, tl.sum(total, axis=0))
            tl.store(ab_ptr + (part * SPLIT + s) * 2, tl.min(above_lo, axis=0))
            tl.store(ab_ptr + (part * SPLIT + s) * 2 + 1, tl.max(below_hi, axis=0))

    @triton.jit
    def _finish_kernel(top_p_ptr, ext_ptr, state_ptr, mass_ptr, ab_ptr, thr_ptr, n_rows, last,
                       SPLIT: tl.constexpr, PIVOTS: tl.constexpr, STATE: tl.constexpr):
        r = tl.program_id(0)
        _, _, _, _, found = _advance(state_ptr, mass_ptr, ab_ptr, ext_ptr, top_p_ptr, r, last,
                                     n_rows, False, SPLIT, PIVOTS, STATE)
        tl.store(thr_ptr + r, _unkey(found))


def top_p_thresholds(logits_BV: torch.Tensor, rows_R: torch.Tensor, temp_R: torch.Tensor,
                     top_p_R: torch.Tensor) -> torch.Tensor:
    """Each row ``rows_R`` of ``logits_BV``'s top-p threshold (float32, on its raw logits): the
    smallest logit whose tokens strictly above it, at temperature ``temp_R``, hold less than
    ``top_p_R`` (in (0, 1)) of the row's mass, as ``sampling._top_p_threshold`` finds it by a
    sort (the sums round apart: a mass within float32 rounding of ``top_p`` may fall either
    way). ``PASSES + 2`` launches, no host sync."""
    n, vocab, dev = rows_R.shape[0], logits_BV.shape[1], logits_BV.device
    thr_R = torch.empty(n, dtype=torch.float32, device=dev)
    if not n:
        return thr_R
    # A vocabulary of a few blocks takes fewer programs (tests: Triton's interpreter), each a
    # function of the vocabulary alone.
    split = min(SPLIT, triton.next_power_of_2(triton.cdiv(vocab, BLOCK)))
    block = max(16, min(BLOCK, triton.next_power_of_2(triton.cdiv(vocab, split))))
    ext = torch.empty(n, split, 2, dtype=torch.float32, device=dev)
    state = torch.empty(2, n, _STATE, dtype=torch.int64, device=dev)
    mass = torch.empty(2, n, split, PIVOTS + 1, dtype=torch.float32, device=dev)
    ab = torch.empty(2, n, split, 2, dtype=torch.int32, device=dev)
    stride = logits_BV.stride(0)
    _extremes_kernel[(n, split)](logits_BV, stride, rows_R, ext, vocab, SPLIT=split, BLOCK=block,
                                 num_warps=4)
    for t in range(PASSES):
        _pass_kernel[(n, split)](logits_BV, stride, rows_R, temp_R, top_p_R, ext, state, mass, ab,
                                 vocab, n, t, FIRST=t == 0, SPLIT=split, PIVOTS=PIVOTS, BLOCK=block,
                                 STATE=_STATE, num_warps=8)
    _finish_kernel[(n,)](top_p_R, ext, state, mass, ab, thr_R, n, PASSES - 1, SPLIT=split,
                         PIVOTS=PIVOTS, STATE=_STATE, num_warps=1)
    return thr_R
