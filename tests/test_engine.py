"""The engine API (launch/engine.py) on one in-process rank: tokens equal transformers' greedy
generate, EOS from the checkpoint, streaming, submits while the rank runs (one by one or many at
once), abort frees KV, the door's errors, drain on shutdown. The Ray gang is in test_engine_ray.py."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request, SamplingParams
from launch.engine import Engine, EngineOptions, QueueFull, RequestRejected
from tests.hf_reference import greedy_reference, load_reference, write_tiny_checkpoint

pytest.importorskip("transformers")

NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("engine_ckpt"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 13, 30, 9)]


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    hf = load_reference(ckpt)
    return [greedy_reference(hf, p, NEW)[0] for p in prompts]


def _spec(model, **kw):
    base = dict(max_running_requests=2, chunked_prefill_size=16, dtype="float32", device="cpu", max_context_len=96)
    return RankSpec.create(str(model), **{**base, **kw})


def _reqs(prompts, new=NEW, prefix="r", **sampling):
    return [Request(f"{prefix}{i}", p, SamplingParams(max_new_tokens=new, **sampling)) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def engine(ckpt):
    with Engine(_spec(ckpt)).start() as eng:
        yield eng


def _free_kv(engine) -> tuple[int, int]:
    # A rank reports its metrics from its first step on: until then they are empty.
    deadline = time.monotonic() + 30
    while "free_kv_slots" not in (m := engine.stats().ranks[0]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return m["free_kv_slots"], m["kv_slots"]


def _wait_idle(engine, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = _free_kv(engine)
        if free == total and engine.stats().ranks[0]["in_flight"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the rank did not go idle: {engine.stats().ranks[0]}")


def test_generate_equals_transformers_and_streams_equal_generate(engine, prompts, reference):
    # More requests than max_running_requests (2): some queue while others run.
    results = engine.generate(_reqs(prompts), timeout_s=60)
    assert [list(r.output_ids) for r in results] == reference
    assert all(r.finish_reason == "length" and r.rank == 0 for r in results)

    async def stream_all():
        async def one(req):
            outs = [o async for o in engine.stream(req)]
            assert outs[-1].finished and all(not o.finished for o in outs[:-1])
            assert len(outs) > 2  # tokens came step by step, not at the end
            return [t for o in outs for t in o.new_token_ids], outs[-1].result

        return await asyncio.gather(*(one(r) for r in _reqs(prompts, prefix="s")))

    streamed = asyncio.run(stream_all())
    assert [toks for toks, _ in streamed] == reference
    assert [list(res.output_ids) for _, res in streamed] == reference


def test_submit_while_running_and_routing_stats(engine, prompts, reference):
    got = {}

    def on_output(out):
        if out.finished:
            got[out.rid] = out.result

    before = engine.stats().ranks[0]["routed_requests"]
    engine.submit(Request("long", prompts[0], SamplingParams(max_new_tokens=40)), on_output)
    time.sleep(0.05)  # "long" is running when the next one arrives
    engine.submit(Request("late", prompts[1], SamplingParams(max_new_tokens=NEW)), on_output)
    deadline = time.monotonic() + 60
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(got["late"].output_ids) == reference[1]
    assert len(got["long"].output_ids) == 40
    assert engine.stats().ranks[0]["routed_requests"] == before + 2


def test_submit_many_is_one_message_per_rank_and_all_or_none(engine, prompts, reference):
    got = {}

    def on_output(out):
        if out.finished:
            got[out.rid] = out.result

    _wait_idle(engine)
    twice = _reqs(prompts[:2], prefix="d") + _reqs(prompts[:1], prefix="d")
    with pytest.raises(RequestRejected, match="an rid appears twice") as e:
        engine.submit_many(twice, on_output)
    assert e.value.field == "rid" and engine.stats().ranks[0]["in_flight"] == 0  # none of them
    assert engine.submit_many(_reqs(prompts, prefix="m"), on_output) == [0] * len(prompts)
    deadline = time.monotonic() + 60
    while len(got) < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [list(got[f"m{i}"].output_ids) for i in range(len(prompts))] == reference


def test_abort_ends_a_stream_and_frees_its_kv(engine, prompts):
    _wait_idle(engine)

    async def leave_early():
        agen = engine.stream(Request("gone", prompts[0], SamplingParams(max_new_tokens=80)))
        async for out in agen:
            assert not out.finished
            break
        await agen.aclose()  # what a closed HTTP stream does

    asyncio.run(leave_early())
    _wait_idle(engine)  # every slot back: the aborted request's KV was freed
    outs = []
    engine.submit(Request("cut", prompts[0], SamplingParams(max_new_tokens=80)), outs.append)
    while not outs:
        time.sleep(0.005)
    assert engine.abort("cut") and not engine.abort("never-submitted")
    deadline = time.monotonic() + 10
    while not outs[-1].finished and time.monotonic() < deadline:
        time.sleep(0.005)
    assert outs[-1].result.finish_reason == "abort" and len(outs[-1].result.output_ids) < 80
    _wait_idle(engine)


def test_a_second_start_is_refused_and_the_first_gang_serves_on(engine, prompts, reference):
    """Before: a second start built a second rank in this process and orphaned the first."""
    with pytest.raises(RuntimeError, match=r"started already .*'ready'.*create a new Engine"):
        engine.start()
    assert engine.health().state == "ready" and len(engine.stats().ranks) == 1
    (res,) = engine.generate(_reqs(prompts[:1], prefix="again"), timeout_s=60)
    assert list(res.output_ids) == reference[0]


def test_generate_aborts_what_it_timed_out_on(engine, prompts):
    """Requests that arrive a minute after submit cannot finish within the timeout; generate
    gives up on them and aborts them, so the rank drops them instead of running them for nobody
    (before: they stayed in flight on the rank)."""
    _wait_idle(engine)
    late = [Request(f"t{i}", p, SamplingParams(max_new_tokens=4), arrival_s=60.0)
            for i, p in enumerate(prompts[:2])]
    with pytest.raises(TimeoutError, match=r"2 of 2 requests unfinished after 0.2 s .aborted"):
        engine.generate(late, timeout_s=0.2)
    _wait_idle(engine)  # in flight 0 within seconds: the rank dropped them
    assert engine.stats().ranks[0]["waiting"] == 0


def test_the_door_refuses_bad_fields_by_name(engine):
    cases = [
        (Request("x", (1, 256)), "prompt_ids", "vocab_size=256"),
        (Request("x", (1,) * 90, SamplingParams(max_new_tokens=10)), "max_new_tokens", "max_context_len is 96"),
    ]
    for req, field, text in cases:
        with pytest.raises(RequestRejected, match=text) as e:
            engine.submit(req, lambda out: None)
        assert e.value.field == field
    bad = Request("nan", (1, 2))
    object.__setattr__(bad, "sampling", SamplingParams.__new__(SamplingParams))
    object.__setattr__(bad.sampling, "__dict__", {})
    for name, value in dict(max_new_tokens=4, temperature=math.nan, top_p=1.0, seed=0, stop_token_ids=(),
                            top_k=0, ignore_eos=False).items():
        object.__setattr__(bad.sampling, name, value)
    with pytest.raises(RequestRejected, match="temperature must be a finite number >= 0, got nan") as e:
        engine.check(bad)
    assert e.value.field == "temperature"


def test_eos_from_generation_config_stops_unless_ignore_eos(tmp_path, prompts, reference):
    ckpt = write_tiny_checkpoint(tmp_path / "eos")
    eos = reference[0][3]  # the greedy output's 4th token: generation stops there
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 255]}))
    hf = load_reference(ckpt)
    want = greedy_reference(hf, prompts[0], NEW)[0]  # transformers stops at its EOS too
    assert want == reference[0][: reference[0].index(eos) + 1]
    with Engine(_spec(ckpt)).start() as eng:
        assert eng.eos_token_ids == (eos, 255)
        stopped, ignored = eng.generate([Request("e", prompts[0], SamplingParams(max_new_tokens=NEW)),
                                         Request("i", prompts[0], SamplingParams(max_new_tokens=NEW,
                                                                                 ignore_eos=True))])
    assert list(stopped.output_ids) == want and stopped.finish_reason == "stop"
    assert list(ignored.output_ids) == reference[0] and ignored.finish_reason == "length"


def test_a_full_queue_is_refused_and_shutdown_drains(ckpt, prompts):
    eng = Engine(_spec(ckpt, max_running_requests=1), EngineOptions(max_queued=1)).start()
    finished = []
    try:
        for i in range(2):  # one runs, one queues
            eng.submit(Request(f"q{i}", prompts[0], SamplingParams(max_new_tokens=30)),
                       lambda out: out.finished and finished.append(out.result))
        with pytest.raises(QueueFull, match="2 requests in flight, the limit is 2") as e:
            eng.submit(Request("q2", prompts[0]), lambda out: None)
        assert e.value.retry_after_s > 0
        with pytest.raises(QueueFull, match=r"2 requests in flight \(\+2 submitted together\)"):
            eng.submit_many(_reqs(prompts[:2], prefix="n"), lambda out: None)
        assert eng.stats().ranks[0]["in_flight"] == 2  # all or none: neither was taken
    finally:
        eng.shutdown(drain_timeout_s=60)
    # Drained: both finished whole, none aborted.
    assert sorted(r.rid for r in finished) == ["q0", "q1"]
    assert all(r.finish_reason == "length" and len(r.output_ids) == 30 for r in finished)
    assert eng.health().state == "stopped" and not eng.health().ok
