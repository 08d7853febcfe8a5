"""Logprobs through `dp-runtime serve`, on test_serve_openai.py's server (its tiny checkpoint
and trained tokenizer), driven by the official `openai` client: /v1/completions' legacy shape
and /v1/chat/completions' shape, whole and streamed, greedy and seeded.

``TestLogprobsServed`` is imported by test_serve_openai.py, so pytest runs it there with that
module's fixtures (``ckpt``, ``client``, ``name``): one server process for both. This module's
name does not start with ``test_``: it is not collected on its own.
"""

from __future__ import annotations

import openai
import pytest

from tests.support.serve_process import IDS

__all__ = ["TestLogprobsServed"]

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "hello there!"}]
GREEDY, SEEDED = dict(temperature=0), dict(temperature=1.0, seed=7)


def _legacy_ok(lp, ids, n, greedy):
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) > 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Up to n + 1 (the sampled token besides the top n); fewer where ids read the same
        # (the tiny tokenizer has many tokens that are part of a UTF-8 character: "\ufffd").
        assert v <= 0 and 1 <= len(top) <= n + 1
        values = list(top.values())
        assert values == sorted(values, reverse=True) and all(x <= 0 for x in values)
        # The sampled token is always listed: its own entry, or a likelier id's that reads the same.
        assert tok in top and top[tok] >= v
        if greedy:
            assert next(iter(top.items())) == (tok, v)


def _chat_ok(content, ids, n, greedy):
    assert len(content) == len(ids) > 0
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == n
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert bytes(e.bytes).decode("utf-8", errors="replace") in (e.token, "\ufffd")
        # The sampled token's entry among the top, told apart by its bytes (many ids read "\ufffd").
        same = [t for t in e.top_logprobs if (t.token, t.bytes) == (e.token, e.bytes)]
        if same:
            assert same[0].logprob == e.logprob
        if greedy:
            assert e.top_logprobs[0].model_dump() == {k: getattr(e, k) for k in ("token", "bytes", "logprob")}


def _same_entries(got, want, tol=1e-5):
    """Chat logprob entries alike: tokens and bytes exactly, values within ``tol``. With prefix
    caching a repeated prompt's K/V come from the cache and its last token runs in a step of
    another shape, so float32 sums (CPU) run in another order: the same tokens, values a few
    ulp apart."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for a, b in ((g, w), *zip(g.top_logprobs, w.top_logprobs, strict=True)):
            assert (a.token, a.bytes) == (b.token, b.bytes)
            assert a.logprob == pytest.approx(b.logprob, abs=tol)


class TestLogprobsServed:
    @pytest.mark.parametrize("sampled", [GREEDY, SEEDED], ids=["greedy", "seeded"])
    def test_completion_logprobs_whole_and_streamed(self, ckpt, client, name, sampled):
        special = set(ckpt[2].all_special_ids)
        kw = dict(model=name, prompt=PROMPT, max_tokens=10, logprobs=3, extra_body=IDS, **sampled)
        c = client.completions.create(**kw).choices[0]
        ids = c.model_extra["token_ids"]
        _legacy_ok(c.logprobs, ids, 3, greedy=sampled is GREEDY)
        visible = "".join(s for i, s in zip(ids, c.logprobs.tokens, strict=True) if i not in special)
        if "\ufffd" not in visible:  # no token splits a UTF-8 character: the tokens are the text
            assert visible == c.text
        parts = [ch.choices[0] for ch in client.completions.create(**kw, stream=True)]
        assert [i for p in parts for i in p.model_extra["token_ids"]] == ids
        assert "".join(p.text for p in parts) == c.text
        streamed = {k: [x for p in parts for x in getattr(p.logprobs, k)]
                    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert streamed == {k: getattr(c.logprobs, k) for k in streamed}

    @pytest.mark.parametrize("sampled", [GREEDY, SEEDED], ids=["greedy", "seeded"])
    def test_chat_logprobs_whole_and_streamed(self, ckpt, client, name, sampled):
        special = set(ckpt[2].all_special_ids)
        kw = dict(model=name, messages=MESSAGES, max_tokens=10, logprobs=True, top_logprobs=2,
                  extra_body=IDS, **sampled)
        c = client.chat.completions.create(**kw).choices[0]
        ids, content = c.model_extra["token_ids"], c.logprobs.content
        _chat_ok(content, ids, 2, greedy=sampled is GREEDY)
        # The bytes of the tokens that are text join to the text, split characters included.
        raw = b"".join(bytes(e.bytes) for i, e in zip(ids, content, strict=True) if i not in special)
        assert raw.decode("utf-8", errors="replace") == c.message.content
        chunks = list(client.chat.completions.create(**kw, stream=True))
        streamed = [e for ch in chunks for x in ch.choices if x.logprobs for e in x.logprobs.content]
        _same_entries(streamed, content)
        assert "".join(x.delta.content or "" for ch in chunks for x in ch.choices) == c.message.content

    def test_without_logprobs_a_choice_has_none_and_the_same_tokens(self, client, name):
        kw = dict(model=name, prompt=PROMPT, max_tokens=10, extra_body=IDS, **SEEDED)
        plain = client.completions.create(**kw).choices[0]
        asked = client.completions.create(**kw, logprobs=5).choices[0]
        assert plain.logprobs is None and asked.logprobs is not None
        assert plain.model_extra["token_ids"] == asked.model_extra["token_ids"]

    @pytest.mark.parametrize("route,kw,param", [
        ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        ("chat", dict(top_logprobs=2), "top_logprobs"),
        ("completions", dict(logprobs=-1), "logprobs"),
        ("completions", dict(logprobs=21), "logprobs"),
        ("completions", dict(echo=True, logprobs=1), "echo"),
    ])
    def test_bad_values_are_400_naming_the_field(self, client, name, route, kw, param):
        with pytest.raises(openai.BadRequestError) as info:
            if route == "chat":
                client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2, **kw)
            else:
                client.completions.create(model=name, prompt=PROMPT, max_tokens=2, **kw)
        assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body

    def test_each_of_n_choices_has_its_own_logprobs(self, client, name):
        kw = dict(model=name, prompt=PROMPT, max_tokens=6, n=2, logprobs=1, extra_body=IDS, **SEEDED)
        whole = client.completions.create(**kw).choices
        assert [c.index for c in whole] == [0, 1]
        for c in whole:
            _legacy_ok(c.logprobs, c.model_extra["token_ids"], 1, greedy=False)
        got: dict[int, list[float]] = {0: [], 1: []}
        for ch in client.completions.create(**kw, stream=True):
            for c in ch.choices:
                got[c.index] += c.logprobs.token_logprobs
        assert got == {c.index: c.logprobs.token_logprobs for c in whole}
