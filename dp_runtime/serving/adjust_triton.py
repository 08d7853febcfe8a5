"""A chunk of adjusted rows (``adjusted_rows``) in one Triton launch on CUDA: the float32 copy
of each row's logits with its repetition, frequency and presence penalties applied, read once
from the logits, the count table and the marks table, written once.

The torch form takes about a dozen passes over each C x V chunk (the copy, gathering the counts
and the marks, masks, factors, two ``addcmul_``, a ``sign_``): at 256 penalized rows of a
151,936-token vocabulary ~2 GB a step, 0.7 ms of an H100. Here a program reads its columns of
one row's logits, counts and marks and writes the result: ~0.3 GB.

The same arithmetic as the torch form, element by element: ``x / r`` where marked and
positive (correctly rounded, ``div_rn``: Triton's plain float32 division is not), ``x * r``
where marked and not, then ``x - f * c`` and ``x - p`` where ``c > 0``. A row without a
repetition penalty has r = 1 and one without the others f = p = 0, which change nothing, as in
the torch form. The bias is added after, by ``adjusted_rows`` (a few entries).

Legend: C the chunk's rows, V the vocabulary, R the tables' request rows.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: adjusted rows are built with torch
    triton = None

__all__ = ["adjusted_rows_triton"]

_BLOCK = 2048

if triton is not None:

    @triton.jit
    def _adjust_kernel(logits_ptr, stride_l, rows_ptr, table_rows_ptr, counts_ptr, seen_ptr,
                       stride_t, rep_ptr, freq_ptr, pres_ptr, out_ptr, vocab,
                       HAS_REP: tl.constexpr, HAS_PEN: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < vocab
        row = tl.load(rows_ptr + c)
        x = tl.load(logits_ptr + row * stride_l + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_REP or HAS_PEN:
            at = tl.load(table_rows_ptr + c) * stride_t + cols
        if HAS_REP:
            r = tl.load(rep_ptr + c)
            seen = tl.load(seen_ptr + at, mask=in_row, other=0) != 0
            x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, r), x * r), x)
        if HAS_PEN:
            f = tl.load(freq_ptr + c)
            p = tl.load(pres_ptr + c)
            n = tl.load(counts_ptr + at, mask=in_row, other=0.0)
            x = x - n * f
            x = x - tl.where(n > 0, p, 0.0)
        tl.store(out_ptr + c.to(tl.int64) * vocab + cols, x, mask=in_row)


def adjusted_rows_triton(logits_BV: torch.Tensor, rows_C: torch.Tensor,
                         table_rows_C: torch.Tensor | None, counts_RV: torch.Tensor | None,
                         seen_RV: torch.Tensor | None, rep_C: torch.Tensor | None,
                         pen_2C: torch.Tensor | None) -> torch.Tensor:
    """``x_CV``: rows ``rows_C`` of ``logits_BV`` as float32 with the penalties applied (module
    docstring). ``table_rows_C``: each row's request row in ``counts_RV`` / ``seen_RV`` (same
    shape, contiguous); ``rep_C``: repetition penalties (None: none in the chunk); ``pen_2C``:
    frequency then presence penalties (None: none). Needs triton; no sync, one launch."""
    if triton is None:
        raise RuntimeError("adjusted_rows_triton: needs triton")
    if logits_BV.stride(1) != 1:
        raise ValueError("adjusted_rows_triton: logits must be unit-stride along the vocabulary, "
                         f"got strides {logits_BV.stride()}")
    vocab, c = logits_BV.shape[1], rows_C.shape[0]
    out_CV = torch.empty((c, vocab), dtype=torch.float32, device=logits_BV.device)
    if c == 0:
        return out_CV
    tables = [t for t in (counts_RV, seen_RV) if t is not None]
    for t in tables:
        if t.shape[1] != vocab or not t.is_contiguous():
            raise ValueError(f"adjusted_rows_triton: a table of shape {tuple(t.shape)} "
                             f"(contiguous: {t.is_contiguous()}) for a vocabulary of {vocab}")
    stride_t = tables[0].stride(0) if tables else 0
    unused = rows_C  # a pointer for what a constexpr branch never reads
    freq_C, pres_C = (pen_2C[0], pen_2C[1]) if pen_2C is not None else (unused, unused)
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    _adjust_kernel[(c, triton.cdiv(vocab, block))](
        logits_BV, logits_BV.stride(0), rows_C,
        table_rows_C if table_rows_C is not None else unused,
        counts_RV if counts_RV is not None else unused, seen_RV if seen_RV is not None else unused,
        stride_t, rep_C if rep_C is not None else unused, freq_C, pres_C, out_CV, vocab,
        HAS_REP=rep_C is not None, HAS_PEN=pen_2C is not None, BLOCK=block, num_warps=4,
    )
    return out_CV
