"""The numbers of one rate of bench/serve_load.py (its docstring says what they mean): latency
percentiles, the most requests running at once, the steps by kind, and the decode probe's step
time behind the decode-only bound."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from itertools import pairwise
from typing import Any, NamedTuple

from dp_runtime.serving.request import Request, RequestResult
from dp_runtime.step_kinds import dp_balance
from launch.run_report import percentile

__all__ = ["STEP_KINDS", "IdealStep", "decode_step_s", "dp_balance_between", "ideal_occupancy", "ideal_steps", "max_overlap",
           "step_kinds", "summarize_rate"]


class IdealStep(NamedTuple):
    """One step of ``ideal_steps``: its decode rows, its prompt tokens, and the requests (rids)
    it gave a token (the decode rows' and those whose prompt it completed)."""

    decode_rows: int
    prompt_tokens: int
    gave: tuple[str, ...]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals ``[start, end]`` open at one time (one that ends when another starts
    does not overlap it: a finished request frees its place before the next step admits)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, d in events:  # at equal times -1 sorts first
        now += d
        most = max(most, now)
    return most


def summarize_rate(rate: float, requests: list[Request], results: list[RequestResult], world: int) -> dict[str, Any]:
    """The numbers of one rate (module docstring); times in seconds."""
    arrival = {r.rid: r.arrival_s for r in requests}
    ok = [r for r in results if r.ok]
    duration = max((arrival[r.rid] + r.latency_s for r in results), default=0.0)
    out_tokens = sum(len(r.output_ids) for r in ok)
    itl = [b - a for r in ok for a, b in pairwise(r.token_times_s)]
    tpot = [r.tpot_s for r in ok if len(r.output_ids) > 1]
    running = {rank: [(arrival[r.rid] + r.queued_s, arrival[r.rid] + r.latency_s) for r in ok if r.rank == rank]
               for rank in range(world)}

    def pct(xs: list[float]) -> dict[str, float | None]:
        return {f"p{q}": _num(percentile(xs, q)) for q in (50, 99)} | {"mean": sum(xs) / len(xs) if xs else None}

    return dict(
        rate=None if math.isinf(rate) else rate, requests=len(requests), completed=len(ok),
        errors=len(results) - len(ok), duration_s=duration,
        per_rank_requests=[sum(r.rank == k for r in results) for k in range(world)],
        input_tokens=sum(r.prompt_len for r in ok), output_tokens=out_tokens,
        request_throughput=len(ok) / duration if duration else None,
        output_tok_s=out_tokens / duration if duration else None,
        ttft_s=pct([r.ttft_s for r in ok]), itl_s=pct(itl), tpot_s=pct(tpot), e2e_s=pct([r.latency_s for r in ok]),
        max_running=[max_overlap(v) for v in running.values()],
        max_concurrency=max_overlap([iv for v in running.values() for iv in v]),
    )


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


STEP_KINDS = ("decode", "extend", "mixed")


def step_kinds(all_metrics: list[dict[str, Any]]) -> dict[str, int]:
    """Steps by kind so far, summed over the ranks' metrics (``RankWorker.metrics``)."""
    return {k: sum(m.get("steps_by_kind", {}).get(k, 0) for m in all_metrics) for k in STEP_KINDS}


def dp_balance_between(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, float]:
    """The DP balance of what ran between two readings of the ranks' metrics
    (``step_kinds.dp_balance`` on the counters' differences; every rank counts the same table,
    so rank 0's are used) and the most seconds one rank waited in the exchange for its peers.
    No reading before (the first rate without a warm-up): counted from the ranks' start."""
    if not after:  # a torchrun rank but 0 holds no metrics
        return {}
    before = before or [{} for _ in after]
    delta = {k: after[0].get(k, 0) - before[0].get(k, 0) for k in ("dp_tokens", "dp_max_tokens")}
    waits = [(a.get("dp_sync_wait_us", 0) - b.get("dp_sync_wait_us", 0)) / 1e6
             for b, a in zip(before, after, strict=True)]  # (b)efore, (a)fter
    return {"dp_balance": dp_balance(delta), "dp_sync_wait_s": max(waits, default=0.0)}


def decode_step_s(results: list[RequestResult], world: int) -> float | None:
    """The decode step of a decode probe: on each rank, the gaps between consecutive tokens
    once every probe request of that rank has its first token (every step then decodes them
    all); the median over the ranks' gaps. None without such a gap."""
    gaps = []
    for rank in range(world):
        mine = [r for r in results if r.ok and r.rank == rank and r.token_times_s]
        if mine:
            start = max(r.token_times_s[0] for r in mine)
            gaps += [b - a for r in mine for a, b in pairwise(r.token_times_s) if a >= start]
    return statistics.median(gaps) if gaps else None


def ideal_steps(requests: list[Request], running: int, chunk: int, mixed_tokens: int, policy: str,
                mixed: bool = True) -> Iterator[IdealStep]:
    """The steps of one ideal rank serving ``requests`` under the scheduler's rules
    (``Scheduler``: admission order ``policy``, at most ``running`` at once, a step's prompt
    tokens within ``chunk``, or ``mixed_tokens`` minus the decode rows in a mixed step; a
    prompt's chunk that completes it gives its first token, every running prefilled request one
    token a step) with no KV limit. Arrival times are ignored (every request waits from the
    start): meant for rate inf. tests/test_step_model.py holds it to the Scheduler's own steps."""
    queue = sorted(requests, key=lambda r: -r.sampling.max_new_tokens) if policy == "lof" else list(requests)
    queue.reverse()  # pop() from the end: the next admission (sorted() is stable: arrival order)
    left: dict[str, int] = {}  # per running request: prompt tokens not yet prefilled
    out: dict[str, int] = {}  # per running request: output tokens still to come
    while queue or out:
        decode = [k for k in out if not left[k]]
        is_mixed = mixed and 0 < len(decode) < mixed_tokens
        budget = mixed_tokens - len(decode) if is_mixed else chunk
        picks = []  # (request, tokens) as Scheduler._prefill_picks: partial prompts, then admissions
        for k in [k for k in out if left[k]]:
            picks.append((k, min(left[k], budget)))
            budget -= picks[-1][1]
            if budget <= 0:
                break
        while queue and budget > 0 and len(out) < running:
            r = queue.pop()
            k = r.rid
            left[k], out[k] = len(r.prompt_ids), r.sampling.max_new_tokens
            picks.append((k, min(left[k], budget)))
            budget -= picks[-1][1]
        for k, n in picks:
            left[k] -= n
        rows = decode if is_mixed or not picks else []  # the decode rows this step runs
        gave = rows + [k for k, n in picks if n and not left[k]]
        yield IdealStep(len(rows), sum(n for _, n in picks), tuple(gave))
        for k in gave:
            out[k] -= 1
            if not out[k]:
                del out[k], left[k]


def ideal_occupancy(requests: list[Request], running: int, chunk: int, mixed_tokens: int,
                    policy: str, mixed: bool = True) -> float | None:
    """The occupancy (output tokens / (steps x ``running``)) of ``ideal_steps``, every step
    equally long: the ceiling the workload puts on serve_load's ``eff`` where steps run at the
    decode step's speed."""
    steps = tokens = 0
    for step in ideal_steps(requests, running, chunk, mixed_tokens, policy, mixed):
        steps += 1
        tokens += len(step.gave)
    return tokens / (steps * running) if steps else None
