"""A step's sampled tokens on their way to the host, so the host can schedule and launch the
next step before it reads them (``RuntimeConfig.overlap_schedule``).

``launch_tokens`` runs right after a step's forward was launched. On the logits' device it
draws every row's token (``sampling.draw_tokens``: the argmax, or a draw where the request
samples with a temperature; a request's penalties and ``logit_bias`` on a copy of its row:
``adjusted_rows``), writes the ids into the scheduler's ``last_tokens`` table (the next decode batch
gathers its input ids there, in stream order) and, for rows that asked, computes their logprobs
(``logprobs.logprob_rows``, from the raw logits: never the biased copy). One asynchronous copy per
result brings them to pinned host buffers, with an event; ``StepTokens.wait`` later waits for that
event alone. So greedy, sampled and logprobs rows all keep the overlap.

In a step with a penalized row, the penalties' counts (presence, frequency) and marks
(repetition: the prompt's and the output's tokens) come from the rank's ``PenaltyCounts`` tables
on the device: the rows of such requests that draw their first token are reset before the draw
(counts zeroed; marks set to the whole prompt), and every row's drawn token is counted and
marked right after it, in stream order, so the next step's draw sees it whether or not the host
has read it (``penalty_counts``). Each table is touched only in steps with a row that reads it.

A worker that keeps logits for comparisons (``kept_logits``) reads the step's rows on the host
at once: a test path.

Rows that do not sample (a prompt chunk that does not end its prompt) get the argmax written
too: harmless, a row is read only after a step of its own sampled into it. A mixed step (decode
rows, then prefill chunks: serving/scheduler.py) needs nothing of its own here: its logits have
one row per request like any extend batch, every decode row samples, and the next step's decode
rows gather their ids from the table this writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dp_runtime.serving.host_copy import device_to_host
from dp_runtime.serving.logprobs import LogprobRows, logprob_rows
from dp_runtime.serving.penalty_counts import PenaltyCounts, StepCounts
from dp_runtime.serving.request import (
    LOGIT_BIAS_LIMIT,
    LOGPROBS_LIMIT,
    PENALTY_MAX,
    SamplingParams,
    TokenLogprob,
)
from dp_runtime.serving.sampling import (
    DrawnTokens,
    RowFailure,
    draw_failure,
    draw_tokens,
)
from dp_runtime.serving.scheduler import ScheduledStep

__all__ = ["StepTokens", "launch_tokens", "worst_case_draw"]


@dataclass
class StepTokens:
    """One step's tokens: ``tokens`` once read on the host (one entry per request of the step:
    a token id, None where it did not sample, or a RowFailure) and ``logprobs`` (per request,
    its token's logprobs where it asked; None: no row of the step asked). Until ``wait``,
    ``drawn`` holds the host copies (possibly still in flight) and ``ready`` the event that
    marks them done (None: already done, e.g. on CPU)."""

    scheduled: ScheduledStep
    tokens: list[int | RowFailure | None] | None = None
    logprobs: list[TokenLogprob | None] | None = None
    drawn: DrawnTokens | None = None
    lp_rows: LogprobRows | None = None
    ready: torch.cuda.Event | None = None

    def wait(self) -> list[int | RowFailure | None]:
        """The step's tokens; waits for this step's copies alone (later steps keep running)."""
        if self.tokens is None:
            assert self.drawn is not None
            if self.ready is not None:
                self.ready.synchronize()
            reqs, samples = self.scheduled.reqs, self.scheduled.samples
            tokens: list[int | RowFailure | None] = [t if s else None for t, s in
                                                     zip(self.drawn.ids_B.tolist(), samples,
                                                         strict=True)]
            if self.drawn.failed_R is not None:
                for i, bad in zip(self.drawn.drawn, self.drawn.failed_R.tolist(), strict=True):
                    if bad:
                        tokens[i] = draw_failure(reqs[i].request.sampling)
            if self.lp_rows is not None:
                got = self.lp_rows.per_row()
                self.logprobs = [None if isinstance(t, RowFailure) else got.get(i)
                                 for i, t in enumerate(tokens)]
            self.tokens = tokens
        return self.tokens


def launch_tokens(scheduled: ScheduledStep, logits_BV: torch.Tensor, last_tokens: torch.Tensor,
                  penalty_counts: PenaltyCounts,
                  kept_logits: dict[str, list[torch.Tensor]] | None = None
                  ) -> StepTokens:
    """Start the step's sampling (module docstring). ``logits_BV``: one row per request of the
    step, in batch order; ``last_tokens`` and ``penalty_counts``: the rank's tables by request
    row (written here, on the device); ``kept_logits``: when given, each sampled row's logits
    (CPU, float32) are appended under its request id."""
    reqs, samples = scheduled.reqs, scheduled.samples
    if not any(samples):
        return StepTokens(scheduled, tokens=[None] * len(reqs))
    rows_B = scheduled.batch.req_pool_indices[: len(reqs)]
    params = [r.request.sampling if s else None for r, s in zip(reqs, samples, strict=True)]
    counts = None
    counted = any(p is not None and p.penalized for p in params)
    marked = any(p is not None and p.repeats_penalized for p in params)
    if counted or marked:
        first = [(r, p) for r, p, d in zip(reqs, params, scheduled.draws, strict=True)
                 if p is not None and d == 0]
        if counted:
            penalty_counts.clear(r.row for r, p in first if p.penalized)
        if marked:
            penalty_counts.mark_prompts((r.row, r.request.prompt_ids) for r, p in first
                                        if p.repeats_penalized)
        counts = penalty_counts.step(rows_B, counts=counted, seen=marked)
    drawn = draw_tokens(logits_BV, params, scheduled.draws, counts=counts, bans=scheduled.bans)
    if counts is not None:
        counts.record(drawn.ids_B)
    last_tokens.index_copy_(0, rows_B, drawn.ids_B)
    asked = [i for i, p in enumerate(params) if p is not None and p.logprobs is not None]
    lp_rows = (logprob_rows(logits_BV, drawn.ids_B, asked, [params[i].logprobs for i in asked])
               if asked else None)
    if kept_logits is not None:
        for i in (i for i, s in enumerate(samples) if s):
            kept_logits.setdefault(reqs[i].request.rid, []).append(logits_BV[i].float().cpu())
    if not logits_BV.is_cuda:
        return StepTokens(scheduled, drawn=drawn, lp_rows=lp_rows)
    host = DrawnTokens(device_to_host(drawn.ids_B), drawn.drawn,
                       None if drawn.failed_R is None else device_to_host(drawn.failed_R))
    ready = torch.cuda.Event()
    # the logits' device, whatever is current
    ready.record(torch.cuda.current_stream(logits_BV.device))
    return StepTokens(scheduled, drawn=host, lp_rows=None if lp_rows is None else lp_rows.to_host(),
                      ready=ready)


def worst_case_draw(logits_BV: torch.Tensor) -> torch.Tensor:
    """Every row drawn the costliest way (a full-vocabulary top-p, with a min-p, from a copy of
    its logits with every penalty and a bias, whose counts and marks are gathered from tables,
    then counted and marked into them; every logprob alternative): what the memory profile runs
    after its largest step, so the draw's temporaries are in the peak the KV cache is sized
    from. The tables are a row of their own that every row reads (the rank's own are allocated
    before the profile and counted apart: ``penalty_counts``). Returns the ids."""
    rows, vocab = logits_BV.shape
    dev = logits_BV.device
    bias = tuple((t, 1.0) for t in range(min(LOGIT_BIAS_LIMIT, vocab)))
    worst = SamplingParams(temperature=1.0, top_p=0.5, min_p=0.05, logprobs=LOGPROBS_LIMIT,
                           logit_bias=bias, presence_penalty=PENALTY_MAX,
                           frequency_penalty=PENALTY_MAX, repetition_penalty=1.5)
    counts = StepCounts(torch.ones(1, vocab, device=dev),  # every token seen once
                        torch.zeros(rows, dtype=torch.int64, device=dev),
                        torch.ones(1, vocab, dtype=torch.bool, device=dev))
    drawn = draw_tokens(logits_BV, [worst] * rows, [1] * rows, counts=counts)
    counts.record(drawn.ids_B)
    logprob_rows(logits_BV, drawn.ids_B, range(rows), [LOGPROBS_LIMIT] * rows)
    return drawn.ids_B
