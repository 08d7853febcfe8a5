"""The scheduler of one rank: a request queue, continuous batching, and the ForwardBatch of
each step.

Each step is either a prefill (extend) step or a decode step, never a mix:

- **Extend** whenever there is prefill work: first the request whose prompt is partly prefilled,
  then new requests admitted from the queue, each taking up to what is left of the
  ``chunked_prefill_size`` token budget. A prompt longer than the budget is prefilled in chunks
  over several steps; only the chunk that completes a prompt samples (its first output token).
- **Decode** otherwise: one token for every running request.

Admission (back-pressure, never an overwrite): a request joins the running set only while
fewer than ``max_running_requests`` run and the KV slots that every running request may still
need at its end (``Request.max_total_tokens``) fit the cache. So a running request can always
allocate the slot of its next token; a request waits in the queue until one finishes. A request
that could never fit (longer than ``max_context_len`` or than the whole cache) is refused at
``submit`` with both numbers.

Arrivals: a request arrives ``Request.arrival_s`` after its ``submit``; the queue is kept in
arrival order and a request is admitted no earlier than its arrival (``next_arrival_in`` says
how long until the next one). A request's times count from its arrival.

Slots are allocated when a token is scheduled and freed when the request finishes. Times are
``time.perf_counter`` seconds.

Overlap: a step's bookkeeping that does not depend on token values (K/V lengths, slots) is
done when it is scheduled, so the next step can be scheduled before this one's tokens are
read. A decode batch takes its input ids on the device from ``last_tokens`` (the token each
request row sampled last, written by the rank worker's sampling), and a request is decoded only
while its recorded plus in-flight tokens are below ``max_new_tokens``. Tokens are recorded by
``advance`` (possibly one step later); a request that stopped (a stop token) while its next
step was already scheduled ran that step for nothing: ``advance`` drops its extra token.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.admission import check_request
from dp_runtime.serving.forward_batch import ForwardBatch
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.paged_batches import decode_forward_batch, extend_forward_batch
from dp_runtime.serving.request import Request, RequestResult
from dp_runtime.serving.sampling import RowFailure

__all__ = ["ScheduledStep", "Scheduler"]


@dataclass(eq=False)
class _Req:
    """A request on this rank, with the scheduler's bookkeeping."""

    request: Request
    t_arrival: float
    row: int = -1  # req_to_token row once admitted
    kv_len: int = 0  # tokens whose K/V are in the cache
    output: list[int] = field(default_factory=list)
    t_first_forward: float | None = None
    t_first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # seconds after arrival
    decode_steps: int = 0
    generator: torch.Generator | None = None
    inflight: int = 0  # sampling steps scheduled whose token advance has not recorded yet
    done: bool = False  # finished: later tokens of steps already in flight are dropped

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def prefilled(self) -> bool:
        return self.kv_len >= self.prompt_len

    @property
    def decodable(self) -> bool:
        """Prefilled (maybe still in flight), and its next token is not known to be its last."""
        return self.prefilled and len(self.output) + self.inflight < self.request.sampling.max_new_tokens


@dataclass(frozen=True)
class ScheduledStep:
    """One step's batch and what the scheduler needs back: for each request of the batch (in
    batch order) the tokens it runs, and whether its logits row samples a token."""

    batch: ForwardBatch
    reqs: tuple[_Req, ...]
    num_new: tuple[int, ...]
    samples: tuple[bool, ...]

    @property
    def is_extend(self) -> bool:
        return self.batch.forward_mode is ForwardMode.EXTEND

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    """Continuous batching over one rank's KV cache (see the module docstring).

    Args:
        allocator: the rank's KVAllocator (its cache gives the device and the slot count).
        max_running_requests, chunked_prefill_size: from the RuntimeConfig.
        rank: the DP rank, recorded in results.
        vocab_size: the model's vocabulary; prompt token ids must lie below it (None: unchecked).
        eos_token_ids: the checkpoint's EOS ids: a request stops at one (reason "stop") unless
            its sampling says ``ignore_eos``.
    """

    def __init__(self, allocator: KVAllocator, *, max_running_requests: int, chunked_prefill_size: int,
                 rank: int = 0, vocab_size: int | None = None, eos_token_ids: Iterable[int] = ()) -> None:
        cache = allocator.cache
        if max_running_requests > cache.max_reqs:
            raise ValueError(
                f"Scheduler: max_running_requests={max_running_requests} exceeds the KV cache's max_reqs={cache.max_reqs}"
            )
        self.allocator, self.cache = allocator, cache
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.rank = rank
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self._reserved = 0  # KV slots the running requests may hold at their end
        self._rids: set[str] = set()
        # The token each request row sampled last, on the device: decode input ids (module docstring).
        self.last_tokens = torch.zeros(cache.req_to_token.shape[0], dtype=torch.int64, device=cache.device)

    # -- requests in -----------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue ``requests``. All or none: raises ValueError naming the request, the limit and the
        value when one breaks a rule of the door (``admission.check_request``: token ids in
        ``[0, vocab_size)``, sampling, context length), can never fit the KV cache, or its rid
        is already queued or running. A refused request never enters a step."""
        reqs = list(requests)
        seen = set(self._rids)
        for r in reqs:
            problem = check_request(r, self.vocab_size, self.cache.max_context_len)
            if problem is not None:
                raise ValueError(problem)
            if r.rid in seen:
                raise ValueError(f"request {r.rid!r} is already queued or running on rank {self.rank}")
            seen.add(r.rid)
            need = r.max_total_tokens
            if need > self.cache.num_slots:
                raise ValueError(
                    f"request {r.rid!r} needs {need} KV tokens; the whole KV cache holds {self.cache.num_slots}"
                )
        now = time.perf_counter()
        for r in reqs:
            gen = None if r.sampling.greedy else torch.Generator().manual_seed(r.sampling.seed)
            # insort_right: arrival order, and submission order among equal arrivals (FCFS).
            bisect.insort_right(self.waiting, _Req(r, now + r.arrival_s, generator=gen), key=lambda q: q.t_arrival)
            self._rids.add(r.rid)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, those that have not arrived yet included."""
        return len(self.waiting)

    def next_arrival_in(self, now: float | None = None) -> float | None:
        """Seconds from ``now`` (default: the clock) until the head of the queue arrives: 0 when
        it has (it arrived after the last ``next_step`` looked, or waits for room); None for an
        empty queue."""
        if not self.waiting:
            return None
        now = time.perf_counter() if now is None else now
        return max(0.0, self.waiting[0].t_arrival - now)

    # -- batches out -----------------------------------------------------------------------------
    def _admissible(self, r: _Req) -> bool:
        return (
            len(self.running) < self.max_running_requests
            and self._reserved + r.request.max_total_tokens <= self.cache.num_slots
        )

    def next_step(self) -> ScheduledStep | None:
        """The batch of this rank's next step, or None when it has nothing to run now."""
        budget = self.chunked_prefill_size
        now = time.perf_counter()
        picks: list[tuple[_Req, int]] = []
        for r in self.running:
            if not r.prefilled and budget > 0:
                take = min(r.prompt_len - r.kv_len, budget)
                picks.append((r, take))
                budget -= take
        while (self.waiting and budget > 0 and self.waiting[0].t_arrival <= now
               and self._admissible(self.waiting[0])):
            r = self.waiting.popleft()
            r.row = self.allocator.alloc_row()
            self._reserved += r.request.max_total_tokens
            self.running.append(r)
            take = min(r.prompt_len, budget)
            picks.append((r, take))
            budget -= take
        if picks:
            return self._extend(picks)
        decode = [r for r in self.running if r.decodable]
        return self._decode(decode) if decode else None

    def _stamp(self, reqs: Iterable[_Req]) -> None:
        now = time.perf_counter()
        for r in reqs:
            if r.t_first_forward is None:
                r.t_first_forward = now

    def _extend(self, picks: list[tuple[_Req, int]]) -> ScheduledStep:
        reqs = tuple(r for r, _ in picks)
        takes = tuple(n for _, n in picks)
        ids = [t for r, n in picks for t in r.request.prompt_ids[r.kv_len : r.kv_len + n]]
        batch = extend_forward_batch(self.allocator, [r.row for r in reqs], [r.kv_len for r in reqs], takes, ids)
        self._stamp(reqs)
        samples = tuple(r.kv_len + n == r.prompt_len for r, n in picks)
        for (r, n), sample in zip(picks, samples, strict=True):
            r.kv_len += n
            r.inflight += sample
        return ScheduledStep(batch, reqs, takes, samples)

    def _decode(self, running: list[_Req]) -> ScheduledStep:
        reqs = tuple(running)
        batch = decode_forward_batch(self.allocator, [r.row for r in reqs], [r.kv_len for r in reqs],
                                     token_table=self.last_tokens)
        for r in reqs:
            r.kv_len += 1
            r.inflight += 1
            r.decode_steps += 1
        return ScheduledStep(batch, reqs, (1,) * len(reqs), (True,) * len(reqs))

    # -- results ---------------------------------------------------------------------------------
    def advance(self, step: ScheduledStep, tokens: list[int | RowFailure | None]) -> list[RequestResult]:
        """Record the step's tokens (its K/V lengths grew when it was scheduled): ``tokens[i]``
        for the i-th request of the step; None where it did not sample; a RowFailure where its
        draw failed: that request alone finishes with finish_reason "error" and the error.
        Returns the requests that finished, whose rows and slots are freed."""
        now = time.perf_counter()
        finished = []
        for r, samples, tok in zip(step.reqs, step.samples, tokens, strict=True):
            if not samples:
                continue
            r.inflight -= 1
            if r.done:  # stopped by the token of the step before (overlap): this one ran for nothing
                continue
            if isinstance(tok, RowFailure):
                finished.append(self._finish(r, "error", now, error=f"request {r.request.rid!r}: {tok.error}"))
                continue
            r.output.append(int(tok))
            r.token_times.append(now - r.t_arrival)
            if r.t_first_token is None:
                r.t_first_token = now
            sp = r.request.sampling
            stops = tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids)
            reason = "stop" if stops else "length" if len(r.output) >= sp.max_new_tokens else None
            if reason is not None:
                finished.append(self._finish(r, reason, now))
        if finished:
            done = {res.rid for res in finished}
            self.running = [r for r in self.running if r.request.rid not in done]
        return finished

    def abort(self, rids: Iterable[str]) -> list[RequestResult]:
        """Finish the queued or running requests named in ``rids`` now, finish_reason "abort",
        with the tokens recorded so far; their rows and slots are freed at once (a step already
        launched may still write them: later steps follow it in stream order). Unknown rids
        (finished, never queued) are ignored. Returns the aborted requests' results."""
        wanted = set(rids) & self._rids
        if not wanted:
            return []
        now = time.perf_counter()
        out = [self._finish(r, "abort", now) for r in self.running if r.request.rid in wanted]
        self.running = [r for r in self.running if not r.done]
        for r in [r for r in self.waiting if r.request.rid in wanted]:
            self.waiting.remove(r)
            out.append(self._finish(r, "abort", now))
        return out

    def _finish(self, r: _Req, reason: str, now: float, error: str | None = None) -> RequestResult:
        r.done = True
        if r.row >= 0:  # admitted: it holds a row and slots
            self.allocator.free_slots(self.allocator.slots_of(r.row, r.kv_len))
            self.allocator.free_row(r.row)
            self._reserved -= r.request.max_total_tokens
        self._rids.discard(r.request.rid)
        return RequestResult(
            rid=r.request.rid,
            prompt_len=r.prompt_len,
            output_ids=tuple(r.output),
            finish_reason=reason,
            rank=self.rank,
            queued_s=(r.t_first_forward or now) - r.t_arrival,
            ttft_s=(r.t_first_token or now) - r.t_arrival,
            latency_s=now - r.t_arrival,
            decode_steps=r.decode_steps,
            token_times_s=tuple(r.token_times),
            error=error,
        )
