"""The rows of a step chosen from adjusted logits: a request's presence and frequency penalties
and its ``logit_bias``, applied on the device to a float32 copy of its row, ``chunk`` rows at a
time (``sampling.draw_tokens`` then takes the argmax or draws from the copy; the logits the
logprobs read are never written, so they stay raw).

Per row, with ``c`` the count of each token id in the request's output so far (not its prompt)::

    x = logits - frequency_penalty * c - presence_penalty * (c > 0) + bias

Penalties first, then the bias: vLLM's order. Both are additions, so the order only changes
rounding; vLLM's keeps a client's numbers where it moves between the two.

The counts: the host knows the output a request has recorded (``TokenHistory.recorded``); under
overlapped steps the token of the step before may not be recorded yet when this step launches
(the row's draw index is then one past what is recorded), and it is on the device
(``TokenHistory.last_B``): it is added there. The step's int64 indices and its float32 values
each cross in one asynchronous copy; a chunk's counts are one ``index_add_`` of the recorded
(row x vocabulary + id, count) entries into a zeroed C x V float32 buffer, one more for the
tokens in flight; nothing syncs. The buffer is freed before the chunk is drawn from
(memory_estimates.draw_phase_bytes). A chunk without a penalty builds no counts.

Legend: B the step's rows, C a chunk's rows, V the vocabulary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dp_runtime.serving.host_copy import host_to_device
from dp_runtime.serving.request import SamplingParams

__all__ = ["TokenHistory", "adjusted_chunks"]


@dataclass(frozen=True)
class TokenHistory:
    """What each row of a step generated before it, for its penalties: ``recorded[i]`` the
    output tokens of row i's request that the host has recorded (read for penalized rows only);
    ``last_B`` (int64, on the logits' device) row i's token of the step before (the scheduler's
    ``last_tokens`` at the row's request row), which counts where row i's draw index is one past
    ``recorded[i]`` (that token is not recorded yet: overlapped steps)."""

    recorded: Sequence[Sequence[int]]
    last_B: torch.Tensor


class _Entries:
    """Host lists of one dtype, appended in segments: one tensor, sliced by segment."""

    def __init__(self) -> None:
        self.values: list = []

    def add(self, values: Sequence) -> tuple[int, int]:
        lo = len(self.values)
        self.values.extend(values)
        return lo, len(self.values)


def adjusted_chunks(logits_BV: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams | None],
                    indices: Sequence[int], history: TokenHistory | None,
                    chunk: int) -> Iterator[tuple[Sequence[int], torch.Tensor, torch.Tensor]]:
    """For rows ``rows`` of ``logits_BV`` (ascending, each with a bias or a penalty), ``chunk``
    at a time: ``(the chunk's rows, those rows on the device, x_CV)``, x_CV a float32 copy of
    their logits with penalties and bias applied (module docstring). ``indices[i]``: the output
    index of the token row i draws; ``history``: needed where a row has a penalty. Raises
    ValueError for a bias outside the vocabulary or a penalized row without a history."""
    vocab, dev = logits_BV.shape[1], logits_BV.device
    ints, floats = _Entries(), _Entries()
    ints.add(rows)
    plans = [_plan(rows[lo : lo + chunk], params, indices, history, vocab, ints, floats)
             for lo in range(0, len(rows), chunk)]
    index = host_to_device(ints.values, torch.int64, dev)
    value = host_to_device(floats.values, torch.float32, dev) if floats.values else None
    for c, (part, bias, counts, pending, pen) in enumerate(plans):
        rows_C = index[c * chunk : c * chunk + len(part)]
        x_CV = logits_BV.index_select(0, rows_C).float()  # a copy: logits_BV stays raw
        if pen is not None:
            counts_CV = torch.zeros_like(x_CV)
            flat = counts_CV.view(-1)
            flat.index_add_(0, index[slice(*counts[0])], value[slice(*counts[1])])
            if pending[0][1] > pending[0][0]:  # the step before's tokens, not recorded yet
                at, rows_P = index[slice(*pending[0])], index[slice(*pending[1])]
                flat.index_add_(0, at + history.last_B.index_select(0, rows_P), value[slice(*pending[2])])
            pen_2C = value[slice(*pen)].view(2, -1)
            x_CV.addcmul_(counts_CV, pen_2C[0, :, None], value=-1)  # frequency * c
            x_CV.addcmul_(counts_CV.sign_(), pen_2C[1, :, None], value=-1)  # presence * (c > 0)
            del counts_CV, flat  # before the chunk is drawn from: one C x V buffer more at most
        if bias[0][1] > bias[0][0]:
            x_CV.view(-1).index_add_(0, index[slice(*bias[0])], value[slice(*bias[1])])
        yield part, rows_C, x_CV
        del x_CV  # before the next chunk's copy: one chunk at a time


def _plan(part: Sequence[int], params: Sequence[SamplingParams | None], indices: Sequence[int],
          history: TokenHistory | None, vocab: int, ints: _Entries, floats: _Entries):
    """One chunk's host entries, appended to ``ints`` / ``floats``; returns the chunk's rows and
    its segments: bias (flat index, value), counts (flat index, count), pending (flat row
    offset, step row, 1.0) and the penalties (frequencies then presences; None: no penalty)."""
    bias_i, bias_v, count_i, count_v, pend_at, pend_rows = [], [], [], [], [], []
    for j, row in enumerate(part):
        p = params[row]
        for tid, b in p.logit_bias:
            if not 0 <= tid < vocab:  # the door refuses these; on CUDA it would be a device assert
                raise ValueError(f"draw_tokens: row {row}'s logit_bias names token {tid}, "
                                 f"outside the vocabulary of {vocab}")
            bias_i.append(j * vocab + tid)
            bias_v.append(b)
        if not p.penalized:
            continue
        if history is None:
            raise ValueError(f"draw_tokens: row {row} has a penalty and no TokenHistory was given")
        seen = history.recorded[row]
        ahead = indices[row] - len(seen)
        # At most the step before is in flight: the scheduler records a step's tokens before it
        # launches the step after next.
        assert ahead in (0, 1), (row, indices[row], len(seen))
        for tid, n in Counter(seen).items():
            count_i.append(j * vocab + tid)
            count_v.append(n)
        if ahead:
            pend_at.append(j * vocab)
            pend_rows.append(row)
    bias = (ints.add(bias_i), floats.add(bias_v))
    counts = (ints.add(count_i), floats.add(count_v))
    pending = (ints.add(pend_at), ints.add(pend_rows), floats.add([1.0] * len(pend_at)))
    pen = None
    if any(params[row].penalized for row in part):
        pen = floats.add([params[r].frequency_penalty for r in part] + [params[r].presence_penalty for r in part])
    return part, bias, counts, pending, pen
