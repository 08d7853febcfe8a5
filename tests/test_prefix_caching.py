"""Prefix caching on a rank (RuntimeConfig.prefix_caching; serving/prefix_cache.py, the
scheduler's module docstring).

A rank (tiny preset, CPU, overlapped steps): requests sharing a prefix longer than a prefill
chunk give the greedy tokens of serving without the cache, one after another (each reuses what
the ones before left: a prompt, an identical prompt, a prompt that continues a finished
request's output) and all at once (a waiting request admitted after a finish reuses it while
others run: mixed steps with a cached prefix); a reused prefix is reported and not prefilled
again; a KV cache too small to keep every prefix evicts them and serves everything; aborted
requests (mid-prefill, mid-decode) leave usable prefixes; logprobs and penalties are those of
serving without the cache.

The scheduler alone: over a long random workload on a small cache the admission rule
(``reserved + locked <= num_slots``) holds at every step and every allocation succeeds."""

from __future__ import annotations

import random

import pytest
import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import KVCache
from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.serving.scheduler import Scheduler

CHUNK = 16


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = _ids(40, 1)  # longer than a prefill chunk


def _req(rid: str, prompt: list[int], new: int, **sp) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=new, temperature=0.0, **sp))


def _worker(caching: bool, *, running: int = 4, slots: int | None = None) -> RankWorker:
    spec = RankSpec.create("tiny", dp_size=1, device="cpu", dtype="float32", max_running_requests=running,
                           chunked_prefill_size=CHUNK, max_context_len=96, attention="sdpa",
                           prefix_caching=caching, kv_cache_tokens=slots)
    return RankWorker(spec)


def _one_by_one(w: RankWorker, reqs: list[Request]) -> dict:
    return {q.rid: w.generate([q])[0] for q in reqs}


def _requests(a_out: tuple[int, ...] | None = None) -> list[Request]:
    a = _req("a", SHARED + _ids(5, 2), 6)
    out = [a, _req("b", SHARED + _ids(3, 3), 10), _req("c", list(a.prompt_ids), 6)]
    if a_out is not None:  # the next turn of a's chat: its prompt, its answer, a new message
        out.append(_req("d", list(a.prompt_ids) + list(a_out) + _ids(4, 4), 5))
    return out


@pytest.fixture(scope="module")
def served():
    with _worker(False) as w:
        a_out = w.generate(_requests()[:1])[0].output_ids
        base = _one_by_one(w, _requests(a_out))
    with _worker(True) as w:
        seq = _one_by_one(w, _requests(a_out))
        seq_metrics = w.metrics()
    with _worker(True, running=2) as w:
        together = {r.rid: r for r in w.generate(_requests(a_out))}
    return base, seq, seq_metrics, together


def test_one_after_another_reuses_prefixes_with_the_same_tokens(served):
    base, seq, m, _ = served
    for rid, res in base.items():
        assert seq[rid].output_ids == res.output_ids, rid
        assert res.cached_tokens == 0
    a = len(SHARED) + 5
    # b shares the 40 tokens; c is a's prompt (all but its last token); d continues a's chat:
    # a's prompt and the 5 outputs fed back (the 6th never was).
    want = {"a": 0, "b": len(SHARED), "c": a - 1, "d": a + 5}
    assert {rid: r.cached_tokens for rid, r in seq.items()} == want
    prompts = sum(r.prompt_len for r in seq.values())
    assert m["prefill_tokens"] == prompts - sum(want.values())
    assert m["prefix_hit_tokens"] == sum(want.values()) and m["prefix_cached_tokens"] > 0


def test_all_at_once_reuses_a_finished_prefix_while_others_run(served):
    base, _, _, together = served
    for rid, res in base.items():
        assert together[rid].output_ids == res.output_ids, rid
    # Two run at a time: a and b first; c is admitted when a (fewer tokens) finishes, b still
    # decoding, and reuses all of a's prompt but its last token.
    assert together["a"].cached_tokens == together["b"].cached_tokens == 0
    assert together["c"].cached_tokens == len(SHARED) + 4
    assert together["d"].cached_tokens >= len(SHARED) + 5


def test_a_burst_reuses_a_prompt_as_soon_as_it_is_prefilled():
    # Four at once, room for all: p0's prompt is cached when its last chunk is scheduled, so
    # the requests admitted after that step reuse the shared 40 tokens while p0 still decodes.
    reqs = [_req(f"p{i}", SHARED + _ids(3, 60 + i), 10) for i in range(4)]
    with _worker(False) as w:
        want = _one_by_one(w, reqs)
    with _worker(True) as w:
        got = {r.rid: r for r in w.generate(reqs)}
    for rid, res in want.items():
        assert got[rid].output_ids == res.output_ids, rid
    # p1 was admitted in the step of p0's last chunk (before it was cached); all four run at
    # once, none finished before p3's admission: only sharing at prefill gives p3 its hit.
    assert [got[f"p{i}"].cached_tokens for i in range(4)] == [0, 0, len(SHARED), len(SHARED)]


def test_a_small_cache_evicts_prefixes_and_serves_everything():
    # 120 slots, two requests of up to 48 at a time: the cached prefixes must make room.
    first = [_req(f"p{i}", _ids(40, 10 + i), 8) for i in range(4)]
    second = [_req("p3'", first[3].prompt_ids, 8), _req("p0'", first[0].prompt_ids, 8),
              *(_req(f"q{i}", SHARED[:20] + _ids(20, 20 + i), 8) for i in range(3))]
    runs = []
    for caching in (False, True):
        with _worker(caching, running=2, slots=120) as w:
            got = {r.rid: r for r in w.generate(first)}
            got.update({r.rid: r for r in w.generate(second)})
            runs.append((got, w.metrics()))
    (plain, _), (cached, m) = runs
    for rid, res in plain.items():
        assert cached[rid].finish_reason == "length" and cached[rid].output_ids == res.output_ids, rid
    assert cached["p3'"].cached_tokens == 39  # the last prompt cached survived the evictions
    # Idle, every cached slot is evictable: all 120 count as free.
    assert 0 < m["prefix_cached_tokens"] <= 120 and m["free_kv_slots"] == 120


def test_aborted_requests_leave_usable_prefixes():
    long_prompt, decoding = _ids(60, 30), SHARED + _ids(4, 31)
    with _worker(False) as w:
        want = {q.rid: q for q in w.generate([_req("x", long_prompt, 6), _req("y", decoding, 12)])}
    with _worker(True) as w:
        w.submit([_req("x", long_prompt, 6)])
        w.step()
        w.step()  # two chunks of x's prompt scheduled (the second maybe still in flight)
        w.abort(["x"])
        w.submit([_req("y", decoding, 12)])
        for _ in range(8):  # y's prefill and a few of its tokens
            w.step()
        w.abort(["y"])
        w.run_until_idle()
        aborted = {r.rid: r for r in w.pop_finished()}
        again = {q.rid: q for q in w.generate([_req("x", long_prompt, 6), _req("y", decoding, 12)])}
    assert aborted["x"].finish_reason == aborted["y"].finish_reason == "abort"
    assert 0 < len(aborted["y"].output_ids) < 12
    assert again["x"].cached_tokens == 2 * CHUNK
    assert again["y"].cached_tokens == len(decoding) - 1  # its prompt, all but the last token
    for rid in want:
        assert again[rid].output_ids == want[rid].output_ids, rid


def test_logprobs_and_penalties_are_unaffected():
    reqs = [_req("plain", SHARED + _ids(3, 40), 4),
            _req("pen", SHARED + _ids(6, 41), 8, logprobs=2, frequency_penalty=1.5, repetition_penalty=1.3)]
    runs = []
    for caching in (False, True):
        with _worker(caching) as w:
            runs.append(_one_by_one(w, reqs)["pen"])
    plain, cached = runs
    assert cached.cached_tokens == len(SHARED) and plain.cached_tokens == 0
    assert cached.output_ids == plain.output_ids
    for (lp0, top0), (lp1, top1) in zip(plain.logprobs, cached.logprobs, strict=True):
        assert lp1 == pytest.approx(lp0, abs=1e-4)
        assert [t for t, _ in top1] == [t for t, _ in top0]


def test_admission_keeps_every_allocation_possible_on_a_small_cache():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=100, max_reqs=4,
                    max_context_len=64, dtype=torch.float32, device="cpu")
    s = Scheduler(KVAllocator(cache), max_running_requests=4, chunked_prefill_size=CHUNK, prefix_caching=True)
    rng = random.Random(0)
    heads = [_ids(rng.randrange(4, 30), 50 + i) for i in range(6)]
    s.submit([_req(f"r{i}", rng.choice(heads) + _ids(rng.randrange(1, 12), 100 + i), rng.randrange(1, 20))
              for i in range(60)])
    pending, finished = None, []
    for _ in range(2000):
        step = s.next_step()  # raises ValueError if an allocation finds no slot
        assert s._reserved + s.prefix.locked_tokens <= cache.num_slots
        assert s.allocator.num_free_slots + s.prefix.tree.cached_tokens + sum(
            r.kv_len - r.match.n for r in s.running) == cache.num_slots  # every slot owned once
        if pending is not None:  # overlap: the previous step's tokens are recorded now
            finished += s.advance(pending, [7 if x else None for x in pending.samples])
        pending = step
        if not s.has_work:
            break
    hits = sum(r.cached_tokens for r in finished)
    assert len(finished) == 60 and all(r.finish_reason == "length" for r in finished)
    assert hits > 0 and s.prefix.locked_tokens == 0
