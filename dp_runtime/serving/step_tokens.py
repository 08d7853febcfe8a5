"""A step's sampled tokens on their way to the host, so the host can schedule and launch the
next step before it reads them (``RuntimeConfig.overlap_schedule``).

``launch_tokens`` runs right after a step's forward was launched:

- every sampling row greedy (the common case): the argmax runs on the device, its ids go into
  the scheduler's ``last_tokens`` table (the next decode batch gathers its input ids there, in
  stream order), and an asynchronous copy brings them to a pinned host buffer, with an event;
  ``StepTokens.wait`` later waits for that event alone;
- otherwise (a temperature/top-p row, a row that asked for logprobs, or a worker that keeps
  logits for comparisons): the rows cross to the host now and are drawn there with each
  request's generator (``sampling.sample_tokens``), and the drawn ids are written into
  ``last_tokens``. Rows that asked for logprobs get them here too (``logprobs.token_logprobs``:
  computed on the device, a few floats per row cross), after the draw, which they never change.

Rows that do not sample (a prompt chunk that does not end its prompt) get the argmax written
too: harmless, a row is read only after a step of its own sampled into it. A mixed step (decode
rows, then prefill chunks: serving/scheduler.py) needs nothing of its own here: its logits have
one row per request like any extend batch, every decode row samples, and the next step's decode
rows gather their ids from the table this writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dp_runtime.serving.logprobs import token_logprobs
from dp_runtime.serving.request import TokenLogprob
from dp_runtime.serving.sampling import RowFailure, sample_tokens
from dp_runtime.serving.scheduler import ScheduledStep

__all__ = ["StepTokens", "launch_tokens"]


@dataclass
class StepTokens:
    """One step's tokens: ``tokens`` once known on the host (one entry per request of the
    step: a token id, None where it did not sample, or a RowFailure), else the pinned ``host``
    buffer that an asynchronous copy fills and the ``ready`` event that marks it done.
    ``logprobs``: per request of the step, its token's logprobs where it asked (None: no row
    of the step asked)."""

    scheduled: ScheduledStep
    tokens: list[int | RowFailure | None] | None = None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    logprobs: list[TokenLogprob | None] | None = None

    def wait(self) -> list[int | RowFailure | None]:
        """The step's tokens; waits for this step's copy alone (later steps keep running)."""
        if self.tokens is None:
            assert self.host is not None and self.ready is not None
            self.ready.synchronize()
            ids = self.host.tolist()
            self.tokens = [t if s else None for t, s in zip(ids, self.scheduled.samples, strict=True)]
        return self.tokens


def launch_tokens(scheduled: ScheduledStep, logits_BV: torch.Tensor, last_tokens: torch.Tensor,
                  kept_logits: dict[str, list[torch.Tensor]] | None = None) -> StepTokens:
    """Start the step's sampling (module docstring). ``logits_BV``: one row per request of the
    step, in batch order; ``kept_logits``: when given, each sampled row's logits (CPU, float32)
    are appended under its request id (this takes the host path)."""
    reqs, samples = scheduled.reqs, scheduled.samples
    picked = [i for i, s in enumerate(samples) if s]
    if not picked:
        return StepTokens(scheduled, tokens=[None] * len(reqs))
    rows_B = scheduled.batch.req_pool_indices[: len(reqs)]
    params = [reqs[i].request.sampling for i in picked]
    if kept_logits is None and all(p.greedy and p.logprobs is None for p in params):
        ids_B = logits_BV.argmax(dim=-1)
        last_tokens.index_copy_(0, rows_B, ids_B)
        if not ids_B.is_cuda:
            return StepTokens(scheduled, tokens=[t if s else None for t, s in zip(ids_B.tolist(), samples, strict=True)])
        host = torch.empty(ids_B.shape, dtype=ids_B.dtype, pin_memory=True)
        host.copy_(ids_B, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(ids_B.device))  # the logits' device, whatever is current
        return StepTokens(scheduled, host=host, ready=ready)
    rows = logits_BV if len(picked) == len(reqs) else logits_BV[picked]
    drawn = sample_tokens(rows, params, [reqs[i].generator for i in picked])
    tokens: list[int | RowFailure | None] = [None] * len(reqs)
    for i, tok in zip(picked, drawn, strict=True):
        tokens[i] = tok
    logprobs = None
    asked = [j for j, p in enumerate(params) if p.logprobs is not None]
    if asked:
        logprobs = [None] * len(reqs)
        lp_rows = rows if len(asked) == len(picked) else rows[asked]
        got = token_logprobs(lp_rows, [drawn[j] for j in asked], [params[j].logprobs for j in asked])
        for j, lp in zip(asked, got, strict=True):
            logprobs[picked[j]] = lp
    if kept_logits is not None:
        for i, row in zip(picked, rows.float().cpu(), strict=True):
            kept_logits.setdefault(reqs[i].request.rid, []).append(row)
    good = [(i, t) for i, t in zip(picked, drawn, strict=True) if not isinstance(t, RowFailure)]
    if good:
        at = torch.tensor([i for i, _ in good], device=rows_B.device)
        last_tokens.index_copy_(0, rows_B[at], torch.tensor([t for _, t in good], device=last_tokens.device))
    return StepTokens(scheduled, tokens=tokens, logprobs=logprobs)
