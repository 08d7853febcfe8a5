"""Logprobs at the server's door: the request fields' checks (``logprobs``, ``top_logprobs``),
each bad value a 400 naming the field. The served shapes are checked on a real server in
tests/served_logprobs.py (run by test_serve_openai.py, on its server)."""

from __future__ import annotations

import pytest

from launch.server.logprobs import ChoiceLogprobs, logprobs_of
from launch.server.protocol import ApiError, ChatRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hello there!"}]


def _chat(**kw):
    return ChatRequest(model="m", messages=MESSAGES, **kw)


@pytest.mark.parametrize("req,want", [
    (CompletionRequest(model="m", prompt="x"), None),
    (CompletionRequest(model="m", prompt="x", logprobs=False), None),
    (CompletionRequest(model="m", prompt="x", logprobs=0), 0),
    (CompletionRequest(model="m", prompt="x", logprobs=20), 20),
    (_chat(), None),
    (_chat(logprobs=False), None),
    (_chat(logprobs=True), 0),
    (_chat(logprobs=True, top_logprobs=5), 5),
])
def test_the_fields_give_the_engine_s_logprobs(req, want):
    assert logprobs_of(req) == want


@pytest.mark.parametrize("req,param,match", [
    (CompletionRequest(model="m", prompt="x", logprobs=-1), "logprobs", r"\[0, 20\].*got -1"),
    (CompletionRequest(model="m", prompt="x", logprobs=21), "logprobs", r"\[0, 20\].*got 21"),
    (CompletionRequest(model="m", prompt="x", logprobs=True), "logprobs", "got True"),
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs", r"\[0, 20\], got 21"),
    (_chat(top_logprobs=2), "top_logprobs", "needs logprobs: true"),
    (_chat(logprobs=False, top_logprobs=0), "top_logprobs", "needs logprobs: true"),
    (_chat(logprobs=3), "logprobs", "true or false, got 3"),
])
def test_a_bad_field_is_named(req, param, match):
    with pytest.raises(ApiError, match=match) as info:
        logprobs_of(req)
    assert info.value.status == 400 and info.value.param == param


def test_without_a_tokenizer_tokens_read_their_ids_and_minus_inf_is_a_number():
    lps = [(-0.5, ((5, -0.5), (7, -1.0))), (float("-inf"), ((3, -0.1),))]
    chat = ChoiceLogprobs("chat", None).next([5, 9], lps)
    assert chat == {"content": [
        {"token": "token_id:5", "logprob": -0.5, "bytes": None, "top_logprobs": [
            {"token": "token_id:5", "logprob": -0.5, "bytes": None},
            {"token": "token_id:7", "logprob": -1.0, "bytes": None}]},
        {"token": "token_id:9", "logprob": -9999.0, "bytes": None, "top_logprobs": [
            {"token": "token_id:3", "logprob": -0.1, "bytes": None}]},
    ]}
    legacy = ChoiceLogprobs("completion", None)
    assert legacy.next([5, 9], lps) == {
        "tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"token_id:5": -0.5, "token_id:7": -1.0},
                         {"token_id:3": -0.1, "token_id:9": -9999.0}],  # the sampled one added
        "text_offset": [0, 0],  # no tokenizer, no text
    }
