"""The scheduler of one rank: a request queue, continuous batching, and the ForwardBatch of
each step.

A step's kind (``ScheduledStep.kind``):

- **Mixed** (``mixed_steps``, the default) whenever there is prefill work and running requests
  to decode: one EXTEND batch whose first rows are every decodable running request (one token
  each, a decode row) and then prefill chunks. The decode rows count against the mixed step's
  token budget (``mixed_step_tokens``, as in vLLM), the chunks take what is left: first the
  request whose prompt is partly prefilled, then new requests admitted from the queue. So a
  prefill never stalls the running requests, and a step never brings more than the budget. The
  budget is smaller than the prefill chunk by default (the largest extend graph): a mixed step
  holds up every running request's next token, so it should replay a graph, not run eager.
- **Extend** when there is prefill work and nothing to decode (or ``mixed_steps`` is off, or
  the decode rows alone fill the mixed budget: then, as without mixed steps, the prefill runs
  alone, so admission never starves): prefill chunks only, within ``chunked_prefill_size``.
- **Decode** otherwise: one token for every decodable running request, a DECODE batch (decode
  graphs serve it).

Under DP the ranks step together: a rank with nothing to decode whose peers sampled in the last
step (``note_peers_decoding``) keeps its prefill-only step to the mixed budget too, lest a whole
chunk hold up every peer's running requests.

A prompt longer than the budget is prefilled in chunks over several steps; only the chunk that
completes a prompt samples (its first output token); every decode row samples.

Admission order (``policy``): "fcfs" admits the arrived requests in arrival order; "lof"
(longest output first, as SGLang's policy of that name) admits the arrived request with the
largest ``max_new_tokens`` first (arrival order among equals). Under a closed workload (a queue
that never empties until the end) FCFS leaves the batch draining to the longest outputs at the
end; LOF starts them first, so the batch stays full to the end, at the cost of short requests'
queueing time while the queue is long.

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

Prefix caching (``prefix_caching``, on by default; prefix_reuse.py has the rules): a request
starts from the K/V of its prompt's longest cached prefix and reserves the rest of its
``max_total_tokens``; the cache's slots in use by running requests count as taken, so the
guarantee above holds; a finished request's known tokens are cached.

Overlap: a step's bookkeeping that does not depend on token values (K/V lengths, slots) is
done when it is scheduled, so the next step can be scheduled before this one's tokens are
read. A decode batch, and the decode rows of a mixed one, take their input ids on the device
from ``last_tokens`` (the token each request row sampled last, written by the rank worker's
sampling), and a request is decoded only while its recorded plus in-flight tokens are below
``max_new_tokens``. Tokens are recorded by ``advance`` (possibly one step later); a request
that stopped (a stop token) while its next step was already scheduled ran that step for
nothing: ``advance`` drops its extra token.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

import torch

from dp_runtime.config import SCHEDULE_POLICIES, RuntimeConfig
from dp_runtime.serving.admission import check_request, kv_refusal, refused_result
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.paged_batches import decode_forward_batch, extend_forward_batch
from dp_runtime.serving.prefix_reuse import PrefixReuse
from dp_runtime.serving.request import Request, RequestResult, TokenLogprob
from dp_runtime.serving.sampling import RowFailure
from dp_runtime.serving.scheduled_step import RequestState, ScheduledStep, draw_bans

__all__ = ["ScheduledStep", "Scheduler"]


class Scheduler:
    """Continuous batching over one rank's KV cache (see the module docstring).

    Args:
        allocator: the rank's KVAllocator (its cache gives the device and the slot count).
        max_running_requests, chunked_prefill_size, mixed_steps: from the RuntimeConfig.
        mixed_step_tokens: the mixed steps' token budget (RuntimeConfig.mixed_step_tokens;
            None: chunked_prefill_size).
        policy: the admission order, "fcfs" or "lof" (RuntimeConfig.schedule_policy).
        rank: the DP rank, recorded in results.
        vocab_size: the model's vocabulary; prompt token ids must lie below it (None: unchecked).
        eos_token_ids: the checkpoint's EOS ids: a request stops at one (reason "stop") unless
            its sampling says ``ignore_eos``.
        prefix_caching: reuse cached prefixes' K/V (RuntimeConfig.prefix_caching).
    """

    def __init__(self, allocator: KVAllocator, *, max_running_requests: int,
                 chunked_prefill_size: int, rank: int = 0, vocab_size: int | None = None,
                 eos_token_ids: Iterable[int] = (), mixed_steps: bool = True,
                 mixed_step_tokens: int | None = None, policy: str = "fcfs",
                 prefix_caching: bool = False) -> None:
        cache = allocator.cache
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"Scheduler: policy must be one of {SCHEDULE_POLICIES}, got {policy!r}")
        if max_running_requests > cache.max_reqs:
            raise ValueError(
                f"Scheduler: max_running_requests={max_running_requests} exceeds the KV cache's "
                f"max_reqs={cache.max_reqs}"
            )
        self.allocator, self.cache = allocator, cache
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.mixed_steps = mixed_steps
        self.mixed_step_tokens = (chunked_prefill_size if mixed_step_tokens is None
                                  else mixed_step_tokens)
        self.policy = policy
        self.rank = rank
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self._reserved = 0  # KV slots the running requests may still take (RequestState.reserved)
        self.prefix = PrefixReuse(allocator) if prefix_caching else None
        self._rids: set[str] = set()
        self._peers_decoding = False  # note_peers_decoding: a DP peer's requests decode next
        # The token each request row sampled last, on the device: decode input ids (docstring).
        self.last_tokens = torch.zeros(cache.req_to_token.shape[0], dtype=torch.int64,
                                       device=cache.device)

    @classmethod
    def for_runtime(cls, allocator: KVAllocator, cfg: RuntimeConfig, *, rank: int,
                    vocab_size: int | None, eos_token_ids: Iterable[int]) -> Scheduler:
        """The scheduler of a rank whose RuntimeConfig is ``cfg`` (its serving fields)."""
        return cls(allocator, max_running_requests=cfg.max_running_requests,
                   chunked_prefill_size=cfg.chunked_prefill_size, rank=rank, vocab_size=vocab_size,
                   eos_token_ids=eos_token_ids, mixed_steps=cfg.mixed_steps,
                   mixed_step_tokens=cfg.mixed_step_tokens, policy=cfg.schedule_policy,
                   prefix_caching=cfg.prefix_caching)

    # -- requests in -----------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> list[RequestResult]:
        """Queue ``requests``; returns the results of those that can never fit this rank's KV
        cache (finish_reason "error", the need and the cache's size in ``error``; in submission
        order): each fails alone and the others are queued. Raises ValueError, all or none,
        naming the request, the limit and the value when one breaks a rule of the door
        (``admission.check_request``: its fields, token ids in ``[0, vocab_size)``, context
        length) or its rid is already queued or running. A refused request never enters a step."""
        reqs = list(requests)
        seen = set(self._rids)
        for r in reqs:
            problem = check_request(r, self.vocab_size, self.cache.max_context_len)
            if problem is not None:
                raise ValueError(problem)
            if r.rid in seen:
                raise ValueError(f"request {r.rid!r} is already queued or running on rank "
                                 f"{self.rank}")
            seen.add(r.rid)
        now = time.perf_counter()
        refused = []
        for r in reqs:
            if r.max_total_tokens > self.cache.num_slots:
                refused.append(refused_result(r, kv_refusal(r, self.cache.num_slots), self.rank))
                continue
            # insort_right: arrival order, and submission order among equal arrivals (FCFS).
            bisect.insort_right(self.waiting, RequestState(r, now + r.arrival_s),
                                key=lambda q: q.t_arrival)
            self._rids.add(r.rid)
        return refused

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, those that have not arrived yet included."""
        return len(self.waiting)

    def kv_metrics(self) -> dict[str, int]:
        """``free_kv_slots``: the slots new tokens can take (the prefix cache's evictable ones
        included); ``prefix_hit_tokens``: prompt tokens served from the prefix cache, in all;
        ``prefix_cached_tokens``: tokens it holds."""
        p = self.prefix
        return dict(free_kv_slots=self.allocator.num_free_slots if p is None else p.free_slots,
                    prefix_hit_tokens=p.hit_tokens if p else 0,
                    prefix_cached_tokens=p.tree.cached_tokens if p else 0)

    def next_arrival_in(self, now: float | None = None) -> float | None:
        """Seconds from ``now`` (default: the clock) until the head of the queue arrives: 0 when
        it has (it arrived after the last ``next_step`` looked, or waits for room); None for an
        empty queue."""
        if not self.waiting:
            return None
        now = time.perf_counter() if now is None else now
        return max(0.0, self.waiting[0].t_arrival - now)

    # -- batches out -----------------------------------------------------------------------------
    def _admit(self, r: RequestState) -> bool:
        """Give ``r`` a row, its reservation and its cached prefix if it fits (module
        docstring: admission, prefix caching); False, changing nothing, if it does not."""
        if len(self.running) >= self.max_running_requests:
            return False
        m = self.prefix.claim(r.request.prompt_ids) if self.prefix is not None else None
        need = r.request.max_total_tokens - (0 if m is None else m.n)
        if (self._reserved + need + (0 if m is None else self.prefix.locked_tokens)
                > self.cache.num_slots):
            if m is not None:
                self.prefix.unclaim(m)
            return False
        r.row, r.reserved, r.match = self.allocator.alloc_row(), need, m
        self._reserved += need
        if m is not None:
            r.kv_len = r.cached = m.n
            self.prefix.place(r.row, m)
        return True

    def _make_room(self, n: int) -> None:
        if self.prefix is not None:
            self.prefix.make_room(n)

    def note_peers_decoding(self, decoding: bool) -> None:
        """Whether a DP peer sampled in the last step: its requests decode next (docstring)."""
        self._peers_decoding = decoding

    def next_step(self) -> ScheduledStep | None:
        """The batch of this rank's next step, or None when it has nothing to run now (the
        step kinds and the budget: module docstring)."""
        decode = [r for r in self.running if r.decodable]
        mixed = self.mixed_steps and 0 < len(decode) < self.mixed_step_tokens
        short = mixed or (self.mixed_steps and not decode and self._peers_decoding)  # DP peers wait
        picks = self._prefill_picks(self.mixed_step_tokens - len(decode) if short
                                    else self.chunked_prefill_size)
        if picks:
            return self._extend(decode if mixed else [], picks)
        return self._decode(decode) if decode else None

    def _prefill_picks(self, budget: int) -> list[tuple[RequestState, int]]:
        """The prefill chunks of a step within ``budget`` tokens: the partly prefilled request
        first, then arrived requests admitted from the queue while they fit."""
        now = time.perf_counter()
        picks: list[tuple[RequestState, int]] = []
        for r in self.running:
            if not r.prefilled and budget > 0:
                take = min(r.prompt_len - r.kv_len, budget)
                picks.append((r, take))
                budget -= take
        while (budget > 0 and (i := self._next_admission(now)) is not None
               and self._admit(self.waiting[i])):
            r = self.waiting[i]
            del self.waiting[i]
            self.running.append(r)
            take = min(r.prompt_len - r.kv_len, budget)
            picks.append((r, take))
            budget -= take
        return picks

    def _next_admission(self, now: float) -> int | None:
        """The queue index of the request to admit next by the policy (module docstring), among
        those arrived by ``now``; None if none has arrived."""
        if not self.waiting or self.waiting[0].t_arrival > now:
            return None
        if self.policy == "fcfs":
            return 0
        arrived = bisect.bisect_right(self.waiting, now, key=lambda q: q.t_arrival)
        # max() keeps the first of equals: arrival order among the same max_new_tokens.
        return max(range(arrived), key=lambda i: self.waiting[i].request.sampling.max_new_tokens)

    def _stamp(self, reqs: Iterable[RequestState]) -> None:
        now = time.perf_counter()
        for r in reqs:
            if r.t_first_forward is None:
                r.t_first_forward = now

    def _extend(self, decode: list[RequestState],
                picks: list[tuple[RequestState, int]]) -> ScheduledStep:
        # Decode rows first: their ids are one device gather from last_tokens (paged_batches).
        reqs = (*decode, *(r for r, _ in picks))
        takes = (1,) * len(decode) + tuple(n for _, n in picks)
        ids = [t for r, n in picks for t in r.request.prompt_ids[r.kv_len : r.kv_len + n]]
        self._make_room(sum(takes))
        batch = extend_forward_batch(self.allocator, [r.row for r in reqs],
                                     [r.kv_len for r in reqs], takes, ids, decode_rows=len(decode),
                                     token_table=self.last_tokens if decode else None)
        self._stamp(r for r, _ in picks)
        samples = (True,) * len(decode) + tuple(r.kv_len + n == r.prompt_len for r, n in picks)
        for r in decode:
            r.decode_steps += 1
        draws = tuple(len(r.output) + r.inflight for r in reqs)
        for r, n, sample in zip(reqs, takes, samples, strict=True):
            r.kv_len += n
            r.inflight += sample
        for r, _ in picks if self.prefix is not None else ():
            if r.prefilled and (m := self.prefix.share(r.request.prompt_ids,
                                                       self.allocator.slots_of(r.row, r.kv_len),
                                                        r.match)) is not None:
                # Its prompt's slots are the cache's now (locked): its reservation shrinks as much.
                r.reserved -= m.n - r.match.n
                self._reserved -= m.n - r.match.n
                r.match = m
        return ScheduledStep(batch, reqs, takes, samples, num_decode=len(decode), draws=draws,
                             bans=draw_bans(reqs, samples, draws, self.eos_token_ids))

    def _decode(self, running: list[RequestState]) -> ScheduledStep:
        reqs = tuple(running)
        self._make_room(len(reqs))
        batch = decode_forward_batch(self.allocator, [r.row for r in reqs],
                                     [r.kv_len for r in reqs], token_table=self.last_tokens)
        draws = tuple(len(r.output) + r.inflight for r in reqs)
        for r in reqs:
            r.kv_len += 1
            r.inflight += 1
            r.decode_steps += 1
        samples = (True,) * len(reqs)
        return ScheduledStep(batch, reqs, (1,) * len(reqs), samples, draws=draws,
                             bans=draw_bans(reqs, samples, draws, self.eos_token_ids))

    # -- results ---------------------------------------------------------------------------------
    def advance(self, step: ScheduledStep, tokens: list[int | RowFailure | None],
                logprobs: list[TokenLogprob | None] | None = None) -> list[RequestResult]:
        """Record the step's tokens (its K/V lengths grew when it was scheduled): ``tokens[i]``
        for the i-th request of the step; None where it did not sample; a RowFailure where its
        draw failed: that request alone finishes with finish_reason "error" and the error.
        ``logprobs[i]``: its token's logprobs where it asked (None: none). Returns the requests
        that finished, whose rows and slots are freed."""
        now = time.perf_counter()
        finished = []
        lps = logprobs or [None] * len(tokens)
        for r, samples, tok, lp in zip(step.reqs, step.samples, tokens, lps, strict=True):
            if not samples:
                continue
            r.inflight -= 1
            if r.done:  # stopped by the step before's token (overlap): this one ran for nothing
                continue
            if isinstance(tok, RowFailure):
                finished.append(self._finish(r, "error", now,
                                             error=f"request {r.request.rid!r}: {tok.error}"))
                continue
            r.output.append(int(tok))
            if lp is not None:
                r.logprobs.append(lp)
            r.token_times.append(now - r.t_arrival)
            if r.t_first_token is None:
                r.t_first_token = now
            sp = r.request.sampling
            stops = len(r.output) > sp.min_tokens and (
                tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids))
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

    def _finish(self, r: RequestState, reason: str, now: float,
                error: str | None = None) -> RequestResult:
        r.done = True
        if r.row >= 0:  # admitted: it holds a row and slots
            slots = self.allocator.slots_of(r.row, r.kv_len)
            if self.prefix is not None:  # the known tokens go to the cache (prefix_reuse.py)
                n = r.match.n if reason == "error" else min(r.kv_len, r.prompt_len + len(r.output))
                slots = self.prefix.release([*r.request.prompt_ids, *r.output][:n], slots, r.match)
            self.allocator.free_slots(slots)
            self.allocator.free_row(r.row)
            self._reserved -= r.reserved
        self._rids.discard(r.request.rid)
        return RequestResult(
            rid=r.request.rid, prompt_len=r.prompt_len, output_ids=tuple(r.output),
            finish_reason=reason, rank=self.rank,
            queued_s=(r.t_first_forward or now) - r.t_arrival,
            ttft_s=(r.t_first_token or now) - r.t_arrival, latency_s=now - r.t_arrival,
            decode_steps=r.decode_steps, token_times_s=tuple(r.token_times), error=error,
            logprobs=tuple(r.logprobs) if r.request.sampling.logprobs is not None else None,
            cached_tokens=r.cached,
        )

