"""The door (dp_runtime.serving.admission) on every path, and a request that fails inside a step
on its own: refused requests never enter a step, a failing one is failed alone and the rank
goes on serving the others."""

from __future__ import annotations

import math
import pickle

import pytest

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.admission import admit, check_request
from dp_runtime.serving.request import Request, SamplingParams
from launch.engine_errors import rejection
from launch.torchrun_main import run_torchrun
from tests.support.engine_runs import run_local

VOCAB = 256  # the tiny preset's
# A temperature that passes every rule (finite, > 0) yet makes the draw fail: logits / T
# overflow float32 and the probabilities become NaN (torch.multinomial raises).
FAILING_TEMPERATURE = 1e-45


def _spec(**kw):
    base = dict(dp_size=1, max_running_requests=4, chunked_prefill_size=64, dtype="float32", device="cpu",
                max_context_len=64, use_cuda_graph=False)
    return RankSpec.create("tiny", **{**base, **kw})


def _smuggled(req: Request, **fields) -> Request:
    """``req`` with fields set past the constructor's checks, as a pickled copy built elsewhere
    can arrive (unpickling a dataclass does not run ``__post_init__``)."""
    out = pickle.loads(pickle.dumps(req))
    for name, value in fields.items():
        object.__setattr__(out, name, value)
    return out


def _good(n: int, new: int = 4) -> list[Request]:
    return [Request(f"g{i}", [1 + i, 2, 3, 4 + i], SamplingParams(max_new_tokens=new)) for i in range(n)]


@pytest.mark.parametrize(("kw", "message"), [
    (dict(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=math.inf), "temperature must be a finite number >= 0, got inf"),
    (dict(top_p=math.nan), r"top_p must be a finite number in \(0, 1\], got nan"),
    (dict(min_p=1.5), r"min_p must be a finite number in \[0, 1\] \(0: off\), got 1.5"),
    (dict(min_p=-0.1), r"min_p must be a finite number in \[0, 1\] \(0: off\), got -0.1"),
    (dict(min_p=math.nan), r"min_p must be a finite number in \[0, 1\] \(0: off\), got nan"),
    (dict(min_p=True), r"min_p must be a finite number in \[0, 1\] \(0: off\), got True"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an int >= 1, got 2.5"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1, got True"),
    (dict(seed=2**64), r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(stop_token_ids=(1, -3)), "stop_token_ids must be a tuple of ints >= 0"),
    (dict(logit_bias=((1, 100.5),)),
     r"logit_bias\[0\]: the bias of token 1 must be a finite number in \[-100, 100\], got 100.5"),
    (dict(logit_bias={3: math.nan}), r"logit_bias\[0\]: the bias of token 3 .*got nan"),
    (dict(logit_bias=((2, True),)), r"logit_bias\[0\]: the bias of token 2 .*got True"),
    (dict(logit_bias=((1, 1.0), (-1, 1.0))), r"logit_bias\[1\]: the token id must be an int >= 0, got -1"),
    (dict(logit_bias=((1.0, 1.0),)), r"logit_bias\[0\]: the token id must be an int >= 0, got 1.0"),
    (dict(logit_bias=((4, 1.0), (4, -1.0))), r"logit_bias\[1\]: token id 4 is given twice"),
    (dict(logit_bias=((4, 1.0, 2.0),)), r"logit_bias\[0\] must be a \(token_id, bias\) pair"),
    (dict(logit_bias=tuple((t, 1.0) for t in range(301))), "logit_bias must hold at most 300 entries, got 301"),
    (dict(logit_bias="5"), "logit_bias must be a tuple of .token_id, bias. pairs, got str '5'"),
])
def test_sampling_params_refuse_what_cannot_be_sampled(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


@pytest.mark.parametrize(("ids", "message"), [
    ([1, -1], r"prompt_ids\[1\] must be an int >= 0, got -1"),  # once wrapped to the last row
    ([2.7], r"prompt_ids\[0\] must be an int >= 0, got 2.7"),  # once truncated to 2
    ([True], r"prompt_ids\[0\] must be an int >= 0, got True"),
])
def test_request_refuses_ids_that_are_not_token_ids(ids, message):
    with pytest.raises(ValueError, match=message):
        Request("a", ids)


def test_check_request_names_the_field_the_limit_and_the_value():
    ok = Request("a", [0, 255], SamplingParams(max_new_tokens=3))
    assert check_request(ok, VOCAB, 4) is None
    assert check_request(Request("a", [256]), VOCAB) == "request 'a': prompt_ids[0]=256 is not a token id in [0, vocab_size=256)"
    assert check_request(ok, VOCAB, 3) == ("request 'a' needs 4 KV tokens (prompt 2 + max_new_tokens 3 - 1); "
                                           "max_context_len is 3")
    # What a pickle can carry past the constructors is caught again at the door.
    assert "prompt_ids[1] must be an int >= 0, got -1" in check_request(_smuggled(ok, prompt_ids=(1, -1)), VOCAB)
    assert "prompt_ids[0] must be an int >= 0, got 2.5" in check_request(_smuggled(ok, prompt_ids=(2.5,)), VOCAB)
    bad_sampling = _smuggled(SamplingParams(), temperature=math.nan)
    assert "temperature must be a finite number" in check_request(_smuggled(ok, sampling=bad_sampling), VOCAB)
    bad_min_p = check_request(_smuggled(ok, sampling=_smuggled(SamplingParams(), min_p=2.0)), VOCAB)
    assert bad_min_p == "request 'a': SamplingParams.min_p must be a finite number in [0, 1] (0: off), got 2.0"
    assert rejection(bad_min_p).field == "min_p"  # the engine's 400 names it
    for name, value in (("presence_penalty", 3.0), ("frequency_penalty", 3.0), ("repetition_penalty", 0.0)):
        bad = check_request(_smuggled(ok, sampling=_smuggled(SamplingParams(), **{name: value})), VOCAB)
        assert name in bad and str(value) in bad and rejection(bad).field == name


def test_a_logit_bias_is_checked_against_the_vocabulary_and_crosses_a_pickle():
    sp = SamplingParams(logit_bias={255: 100, 3: -2.5})  # a dict is taken as its pairs, frozen
    assert sp.logit_bias == ((255, 100), (3, -2.5)) and pickle.loads(pickle.dumps(sp)) == sp
    assert SamplingParams(logit_bias=[[7, 1.0]]).logit_bias == ((7, 1.0),)  # a JSONL line's form
    assert check_request(Request("a", [1], sp), VOCAB) is None
    over = Request("a", [1], SamplingParams(logit_bias=((3, 1.0), (256, 1.0))))
    message = check_request(over, VOCAB)
    assert message == "request 'a': SamplingParams.logit_bias[1]: token id 256 is not in [0, vocab_size=256)"
    assert rejection(message).field == "logit_bias"  # the engine's 400 names it
    smuggled = _smuggled(Request("a", [1]), sampling=_smuggled(SamplingParams(), logit_bias=((1, 1e9),)))
    assert "the bias of token 1 must be a finite number in [-100, 100], got 1000000000.0" in check_request(
        smuggled, VOCAB)


def test_admit_splits_refused_from_accepted_and_refuses_duplicate_rids():
    reqs = [*_good(2), Request("big", [VOCAB + 3]), *_good(3)[2:]]
    accepted, refused = admit(reqs, VOCAB, 64)
    assert [r.rid for r in accepted] == ["g0", "g1", "g2"]
    (res,) = refused
    assert (res.rid, res.finish_reason, res.output_ids, res.rank, res.ok) == ("big", "error", (), -1, False)
    assert "prompt_ids[0]=259" in res.error
    with pytest.raises(ValueError, match=r"duplicate request ids .*\['g1'\]"):
        admit([*_good(2), Request("g1", [5])], VOCAB, 64)


def test_worker_refuses_bad_requests_at_submit_and_keeps_serving():
    with RankWorker(_spec()) as w:
        reference = w.generate(_good(3))
        for bad, message in [
            (Request("over", [1, VOCAB]), r"'over': prompt_ids\[1\]=256 is not a token id in \[0, vocab_size=256\)"),
            (_smuggled(Request("neg", [1, 2]), prompt_ids=(1, -1)), r"'neg': prompt_ids\[1\] must be an int >= 0, got -1"),
            (_smuggled(Request("nan", [1]), sampling=_smuggled(SamplingParams(), temperature=math.nan)),
             "'nan': SamplingParams.temperature must be a finite number"),
        ]:
            with pytest.raises(ValueError, match=message):
                w.submit([Request("fine", [1, 2]), bad])
            assert w.scheduler.num_waiting == 0 and not w.has_work  # all or none: nothing queued
        again = w.generate([Request(r.rid, [1 + i, 2, 3, 4 + i], SamplingParams(max_new_tokens=4))
                            for i, r in enumerate(reference)])
    assert [r.output_ids for r in again] == [r.output_ids for r in reference]


def test_request_failing_in_a_step_fails_alone():
    bad = Request("bad", [7, 8, 9], SamplingParams(max_new_tokens=4, temperature=FAILING_TEMPERATURE))
    with RankWorker(_spec()) as w:
        reference = w.generate(_good(3))
        results = w.generate([*_good(3)[:2], bad, *_good(3)[2:]])
        assert not w.has_work
        # its slots came back (free, or the prefix cache's to evict)
        assert w.scheduler.kv_metrics()["free_kv_slots"] == w.kv_cache.num_slots
        after = w.generate(_good(3))  # the rank goes on serving
    by_rid = {r.rid: r for r in results}
    failed = by_rid.pop("bad")
    assert failed.finish_reason == "error" and not failed.ok and failed.output_ids == ()
    assert "'bad': sampling failed (temperature=1e-45" in failed.error and "not finite" in failed.error
    assert {rid: r.output_ids for rid, r in by_rid.items()} == {r.rid: r.output_ids for r in reference}
    assert all(r.ok and r.finish_reason == "length" for r in by_rid.values())
    assert [r.output_ids for r in after] == [r.output_ids for r in reference]


def test_local_launcher_answers_a_refused_request_with_its_error():
    reqs = [*_good(2), Request("over", [VOCAB]), Request("long", [1] * 60, SamplingParams(max_new_tokens=8))]
    report = run_local(_spec(), reqs)
    assert [r.rid for r in report.results] == ["g0", "g1", "over", "long"]
    res = {r.rid: r for r in report.results}
    assert res["g0"].ok and len(res["g0"].output_ids) == 4
    assert "vocab_size=256" in res["over"].error and res["over"].finish_reason == "error"
    assert "needs 67 KV tokens" in res["long"].error and "max_context_len is 64" in res["long"].error


def test_run_torchrun_refuses_duplicate_rids_up_front():
    # Before: the two "g1" were both run and one result was reported twice, the other lost.
    with pytest.raises(ValueError, match=r"duplicate request ids .*\['g1'\]"):
        run_torchrun(_spec(), [*_good(2), Request("g1", [9, 9])])
    report = run_torchrun(_spec(), [*_good(2), Request("over", [VOCAB])])
    assert [(r.rid, r.ok) for r in report.results] == [("g0", True), ("g1", True), ("over", False)]


def test_a_stop_token_id_outside_the_vocabulary_is_refused_by_the_engine_s_door():
    ok = Request("s", [1], SamplingParams(stop_token_ids=(0, 255)))
    assert check_request(ok, VOCAB) is None
    message = check_request(Request("s", [1], SamplingParams(stop_token_ids=(3, 256))), VOCAB)
    assert message == "request 's': SamplingParams.stop_token_ids[1]=256 is not a token id in [0, vocab_size=256)"
    assert rejection(message).field == "stop_token_ids"
