"""Every field of a Request checked with its name, the limit and the value, on the constructor
and again at the door (for requests built around the constructor: ``object.__setattr__``, a
pickle), and a request that only a rank's KV cache cannot hold failing alone."""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import pytest
import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.admission import admit, check_request, known_kv_slots
from dp_runtime.serving.request import Request, SamplingParams

VOCAB = 256  # the tiny preset's


def _around(req: Request, **fields) -> Request:
    """``req`` with fields set past the constructor (as unpickling or object.__setattr__ do)."""
    out = pickle.loads(pickle.dumps(req))
    for name, value in fields.items():
        object.__setattr__(out, name, value)
    return out


def _spec(**kw):
    base = dict(dp_size=1, max_running_requests=4, chunked_prefill_size=64, dtype="float32", device="cpu",
                max_context_len=64, use_cuda_graph=False)
    return RankSpec.create("tiny", **{**base, **kw})


@pytest.mark.parametrize("ids", [torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5], dtype=torch.int32),
                                 np.array([3, 4, 5], dtype=np.uint16), [torch.tensor(3), np.int64(4), 5]])
def test_integer_tensor_prompt_is_accepted_as_python_ints(ids):
    req = Request("t", ids)
    assert req.prompt_ids == (3, 4, 5) and all(type(t) is int for t in req.prompt_ids)
    assert pickle.loads(pickle.dumps(req)) == req  # no tensor inside: it crosses Ray and torchrun as is


@pytest.mark.parametrize(("ids", "message"), [
    (torch.tensor([[1, 2]]), r"'t': prompt_ids must be a 1-D tensor of token ids, got a Tensor of dtype "
                             r"torch.int64 and shape \(1, 2\)"),
    (torch.tensor(7), r"'t': prompt_ids must be a 1-D tensor .* shape \(\)"),
    (torch.tensor([1.0, 2.0]), r"'t': prompt_ids must hold integer token ids, got a Tensor of dtype torch.float32"),
    (torch.tensor([True]), r"'t': prompt_ids must hold integer token ids, got a Tensor of dtype torch.bool"),
    (np.array([1.5]), r"'t': prompt_ids must hold integer token ids, got a ndarray of dtype float64"),
    (torch.tensor([], dtype=torch.int64), r"'t': prompt_ids must be a non-empty tuple of token ids, got tuple \(\)"),
    (torch.tensor([1, -2]), r"'t': prompt_ids\[1\] must be an int >= 0, got -2"),
    ("hello", r"'t': prompt_ids must be a sequence of int token ids, got str 'hello'"),
    (7, r"'t': prompt_ids must be a sequence of int token ids, got int 7"),
])
def test_prompt_that_is_not_token_ids_is_refused_by_name(ids, message):
    with pytest.raises(ValueError, match=message):
        Request("t", ids)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(rid=""), "request rid must be a non-empty string, got ''"),
    (dict(rid=3), "request rid must be a non-empty string, got 3"),
    (dict(arrival_s=math.nan), r"'a': arrival_s must be finite and >= 0 \(seconds after submit\), got nan"),
    (dict(arrival_s=math.inf), "'a': arrival_s must be finite and >= 0 .*got inf"),
    (dict(arrival_s=-0.5), "'a': arrival_s must be finite and >= 0 .*got -0.5"),
    (dict(arrival_s="1"), "'a': arrival_s must be finite and >= 0 .*got '1'"),
    (dict(arrival_s=True), "'a': arrival_s must be finite and >= 0 .*got True"),
    (dict(sampling={"max_new_tokens": 3}), r"'a': Request.sampling must be a SamplingParams, got dict"),
])
def test_every_request_field_is_checked_on_the_constructor_and_replace(kw, message):
    with pytest.raises(ValueError, match=message):
        Request(**{"rid": "a", "prompt_ids": [1, 2], **kw})
    with pytest.raises(ValueError, match=message):  # replace runs the constructor's checks
        dataclasses.replace(Request("a", [1, 2]), **kw)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(arrival_s=math.nan), "'a': arrival_s must be finite and >= 0 (seconds after submit), got nan"),
    (dict(arrival_s=math.inf), "'a': arrival_s must be finite and >= 0 (seconds after submit), got inf"),
    (dict(arrival_s=-1.0), "'a': arrival_s must be finite and >= 0 (seconds after submit), got -1.0"),
    (dict(prompt_ids=torch.tensor([1, 2])), "'a': prompt_ids must be a non-empty tuple of token ids, got Tensor"),
    (dict(prompt_ids=[1, 2]), "'a': prompt_ids must be a non-empty tuple of token ids, got list [1, 2]"),
    (dict(sampling=None), "'a': Request.sampling must be a SamplingParams, got NoneType None"),
])
def test_fields_set_around_the_constructor_are_refused_at_the_door_and_at_submit(fields, message):
    bad = _around(Request("a", [1, 2]), **fields)
    assert message in check_request(bad, VOCAB, 64)
    accepted, (refused,) = admit([Request("ok", [1, 2]), bad], VOCAB, 64)
    assert [r.rid for r in accepted] == ["ok"] and message in refused.error
    with RankWorker(_spec()) as w:
        # Before: NaN blocked the queue for good and inf raised OverflowError in run_until_idle.
        with pytest.raises(ValueError) as e:
            w.submit([Request("ok", [1, 2]), bad])
        assert message in str(e.value)
        assert not w.has_work  # all or none: "ok" was not queued either


def test_request_over_the_rank_kv_cache_is_refused_alone_at_the_door():
    spec = _spec(kv_cache_tokens=50)
    assert known_kv_slots(spec) == 50
    assert known_kv_slots(_spec()) == 4 * 64  # a CPU rank's size: max_running_requests x context
    big = Request("big", [1] * 50, SamplingParams(max_new_tokens=8))
    accepted, (refused,) = admit([Request("a", [1]), big, Request("b", [2])], VOCAB, 64, known_kv_slots(spec))
    assert [r.rid for r in accepted] == ["a", "b"]
    assert (refused.rid, refused.finish_reason, refused.rank) == ("big", "error", -1)
    assert refused.error == ("request 'big' needs 57 KV tokens (prompt 50 + max_new_tokens 8 - 1); "
                             "a rank's whole KV cache holds 50 (kv_cache_tokens)")


def test_scheduler_fails_a_request_its_kv_cache_cannot_hold_alone_and_serves_the_others():
    good = [Request(f"g{i}", [1 + i, 2, 3], SamplingParams(max_new_tokens=4)) for i in range(3)]
    big = Request("big", [5] * 48, SamplingParams(max_new_tokens=8))  # 55 KV tokens: fits the context of 64
    with RankWorker(_spec(kv_cache_tokens=50)) as w:
        reference = w.generate(good)
        (refused,) = w.scheduler.submit([good[0], big, *good[1:]])
        assert (refused.rid, refused.finish_reason, refused.rank, refused.ok) == ("big", "error", 0, False)
        assert "needs 55 KV tokens" in refused.error and "whole KV cache holds 50" in refused.error
        assert w.scheduler.num_waiting == 3  # before: ValueError and none of the batch queued
        w.run_until_idle()
        served = {r.rid: r.output_ids for r in w.pop_finished()}
    assert served == {r.rid: r.output_ids for r in reference}
