"""The rows of a step chosen from adjusted logits: a request's repetition, presence and
frequency penalties, its ``logit_bias`` and the ids it may not take yet (``min_tokens``: the
step's ``bans``), applied on the device to a float32 copy of its row,
``chunk`` rows at a time (``sampling.draw_tokens`` then takes the argmax or draws from the copy;
the logits the logprobs read are never written, so they stay raw).

Per row, with ``seen`` the token ids in the request's prompt or output so far, ``r`` its
repetition penalty and ``c`` the count of each token id in its output so far (not its prompt)::

    x = logits / r  where seen and logits > 0;  logits * r  where seen and not;  logits elsewhere
    x = x - frequency_penalty * c - presence_penalty * (c > 0) + bias    (-inf at a banned id)

Repetition first, then presence and frequency, then the bias: vLLM's order (its
``apply_penalties``, then the bias). The repetition step divides and multiplies as transformers'
``RepetitionPenaltyLogitsProcessor`` does on the CPU (``x / r``, never ``x * (1 / r)``: the same
float32 values); a row of the chunk without it is multiplied and divided by 1, which changes
nothing. The additions after it only change rounding with their order; vLLM's keeps a client's
numbers where it moves between them.

The factor is r clamped to [2**-64, 2**64] (``REPETITION_FACTORS``), so every r > 0 a request may
carry (vLLM's range, no upper limit) keeps the row finite. Unclamped, an r below ~1e-38 is 0 or a
subnormal in float32 and ``x / r`` overflows to inf (the row's draw fails: a 500 at the door),
and one above ~3.4e38 is inf in float32 and ``0 * r`` is NaN. The bounds are powers of two, so
``x / r`` and ``x * r`` at them only shift exponents (exact, the order kept), and the rule has
reached its limit there: at 2**-64 a marked logit x in [1e-6, 1e4] (a real model's) becomes
``x * 2**64``, over 1.8e13, and two such values differ by over 2e6, far more than a draw's noise
(the race's ``log(E)`` spans less than 20) at any temperature up to 1e4; at 2**64 a marked
negative one is pushed as far down and a positive one to below 1e-15. So a penalty beyond the
bounds draws what it would with exact arithmetic: greedy among the marked positive logits
(r -> 0), the marked negative ones never drawn (r -> inf).

The counts and marks live on the device (``penalty_counts``: tables kept per request row,
updated by the device after each draw, so a token still in flight under overlapped steps is
already counted in stream order): a chunk's are one ``index_select`` of its rows each
(``StepCounts.rows`` / ``seen``), a C x V float32 and a C x V bool copy, freed before the chunk
is drawn from. The repetition step holds, beside the copy, the marks, a ``logits > 0`` mask, a
third bool mask for a moment and one C x V float32 factor: 11 bytes an element, less than the
top-p sort's chunk that ``memory_estimates.draw_phase_bytes`` bounds the draw with. The host
sends the step's int64 indices (rows, bias positions) and float32 values (bias, penalties) in
one asynchronous copy each; nothing syncs, and nothing the host sends grows with a request's
output. A chunk without a penalty reads no table. On CUDA a chunk with a penalty is built in one
Triton launch instead (``adjust_triton``: the same values, one pass, no temporaries beside the
copy); the torch ops stay for CPU ranks and for a chunk with a bias alone.

Legend: B the step's rows, C a chunk's rows, V the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from dp_runtime.serving.adjust_triton import adjusted_rows_triton
from dp_runtime.serving.host_copy import host_to_device
from dp_runtime.serving.penalty_counts import StepCounts
from dp_runtime.serving.request import SamplingParams

__all__ = ["REPETITION_FACTORS", "adjusted_chunks", "repetition_factor"]

# The factor a repetition penalty r is applied as: r clamped to this range (module docstring).
REPETITION_FACTORS = (2.0**-64, 2.0**64)


class _Entries:
    """Host lists of one dtype, appended in segments: one tensor, sliced by segment."""

    def __init__(self) -> None:
        self.values: list = []

    def add(self, values: Sequence) -> tuple[int, int]:
        lo = len(self.values)
        self.values.extend(values)
        return lo, len(self.values)


def adjusted_chunks(logits_BV: torch.Tensor, rows: Sequence[int],
                    params: Sequence[SamplingParams | None], counts: StepCounts | None, chunk: int,
                    use_triton: bool = False, bans: Sequence[Sequence[int]] = ()
                    ) -> Iterator[tuple[Sequence[int], torch.Tensor, torch.Tensor]]:
    """For rows ``rows`` of ``logits_BV`` (ascending, each with a bias or a penalty), ``chunk``
    at a time: ``(the chunk's rows, those rows on the device, x_CV)``, x_CV a float32 copy of
    their logits with penalties and bias applied (module docstring). ``counts``: each row's
    output-token counts and prompt-or-output marks so far, needed where a row has a penalty.
    ``use_triton``: a chunk with a penalty is built in one launch (``adjust_triton``, CUDA).
    ``bans[row]`` (empty, or one entry per row of ``logits_BV``): ids set to -inf after the bias.
    Raises ValueError for a bias outside the vocabulary or a penalized row without its table."""
    vocab, dev = logits_BV.shape[1], logits_BV.device
    ints, floats = _Entries(), _Entries()
    ints.add(rows)
    plans = [_plan(rows[lo : lo + chunk], params, counts, vocab, ints, floats, bans)
             for lo in range(0, len(rows), chunk)]
    index = host_to_device(ints.values, torch.int64, dev)
    value = host_to_device(floats.values, torch.float32, dev) if floats.values else None
    for c, (part, bias, rep, pen) in enumerate(plans):
        rows_C = index[c * chunk : c * chunk + len(part)]
        rep_C = value[slice(*rep)] if rep is not None else None
        pen_2C = value[slice(*pen)].view(2, -1) if pen is not None else None
        if use_triton and (rep_C is not None or pen_2C is not None):  # one pass (adjust_triton)
            x_CV = adjusted_rows_triton(logits_BV, rows_C, counts.rows_B.index_select(0, rows_C),
                                        counts.table_RV if pen_2C is not None else None,
                                        counts.seen_RV if rep_C is not None else None, rep_C,
                                        pen_2C)
        else:
            x_CV = _adjusted_torch(logits_BV, rows_C, counts, rep_C, pen_2C)
        if bias[0][1] > bias[0][0]:
            x_CV.view(-1).index_add_(0, index[slice(*bias[0])], value[slice(*bias[1])])
        yield part, rows_C, x_CV
        del x_CV  # before the next chunk's copy: one chunk at a time


def _adjusted_torch(logits_BV: torch.Tensor, rows_C: torch.Tensor, counts: StepCounts | None,
                    rep_C: torch.Tensor | None, pen_2C: torch.Tensor | None) -> torch.Tensor:
    """``adjusted_rows_triton``'s result with torch ops (CPU ranks; a chunk with a bias alone)."""
    x_CV = logits_BV.index_select(0, rows_C).float()  # a copy: logits_BV stays raw
    if rep_C is not None:
        _repetition(x_CV, counts.seen(rows_C), rep_C[:, None])
    if pen_2C is not None:
        counts_CV = counts.rows(rows_C)  # a copy: worked in place below, the table untouched
        x_CV.addcmul_(counts_CV, pen_2C[0, :, None], value=-1)  # frequency * c
        x_CV.addcmul_(counts_CV.sign_(), pen_2C[1, :, None], value=-1)  # presence * (c > 0)
        del counts_CV  # before the chunk is drawn from: one C x V buffer more at most
    return x_CV


def _repetition(x_CV: torch.Tensor, seen_CV: torch.Tensor, r_C1: torch.Tensor) -> None:
    """The repetition penalty in place on ``x_CV``: divided by ``r_C1`` where ``seen_CV`` and
    positive, multiplied where ``seen_CV`` and not (``seen_CV`` is worked in place)."""
    one = r_C1.new_ones(())  # a tensor: where's ``out=`` form takes no Python number
    up_CV = x_CV > 0
    factor_CV = torch.where(seen_CV & up_CV, r_C1, one)
    x_CV.div_(factor_CV)
    # the rest seen
    torch.where(seen_CV.logical_and_(up_CV.logical_not_()), r_C1, one, out=factor_CV)
    x_CV.mul_(factor_CV)


def repetition_factor(r: float) -> float:
    """The factor a repetition penalty ``r`` (> 0) divides and multiplies by: r clamped to
    ``REPETITION_FACTORS`` (module docstring: past them float32 overflows, and the draw is
    already the rule's limit)."""
    lo, hi = REPETITION_FACTORS
    return min(max(r, lo), hi)


def _plan(part: Sequence[int], params: Sequence[SamplingParams | None], counts: StepCounts | None,
          vocab: int, ints: _Entries, floats: _Entries, bans: Sequence[Sequence[int]] = ()):
    """One chunk's host entries, appended to ``ints`` / ``floats``; returns the chunk's rows and
    its segments: bias (flat index, value), the repetition penalties and the presence and
    frequency ones (frequencies then presences); None: no such penalty in the chunk."""
    bias_i, bias_v = [], []
    for j, row in enumerate(part):
        p = params[row]
        for tid, b in p.logit_bias:
            if not 0 <= tid < vocab:  # the door refuses these; on CUDA it would be a device assert
                raise ValueError(f"draw_tokens: row {row}'s logit_bias names token {tid}, "
                                 f"outside the vocabulary of {vocab}")
            bias_i.append(j * vocab + tid)
            bias_v.append(b)
        for tid in bans[row] if bans else ():  # -inf added: the token cannot be drawn, bias or not
            if not 0 <= tid < vocab:
                raise ValueError(f"draw_tokens: row {row} bans token {tid}, outside the "
                                 f"vocabulary of {vocab}")
            bias_i.append(j * vocab + tid)
            bias_v.append(-torch.inf)
        if p.penalized and (counts is None or counts.table_RV is None):
            raise ValueError(f"draw_tokens: row {row} has a penalty and no StepCounts was given")
        if p.repeats_penalized and (counts is None or counts.seen_RV is None):
            raise ValueError(f"draw_tokens: row {row} has a repetition penalty and no StepCounts "
                             "marks were given")
    bias = (ints.add(bias_i), floats.add(bias_v))
    rep = pen = None
    if any(params[row].repeats_penalized for row in part):
        rep = floats.add([repetition_factor(params[r].repetition_penalty) for r in part])
    if any(params[row].penalized for row in part):
        pen = floats.add([params[r].frequency_penalty for r in part]
                         + [params[r].presence_penalty for r in part])
    return part, bias, rep, pen
