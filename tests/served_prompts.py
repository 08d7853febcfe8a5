"""Batched prompts on /v1/completions through `dp-runtime serve` (launch/server/prompts.py,
choices.py), on test_serve_openai.py's server (its tiny checkpoint and trained tokenizer),
driven by the official `openai` client and, where the SSE framing itself is checked, raw HTTP.

``TestPromptsServed`` is imported by test_serve_openai.py, so pytest runs it there with that
module's fixtures (``server``, ``client``, ``name``): one server process for all. This module's
name does not start with ``test_``: it is not collected on its own.

Two prompts with n = 2 are four engine requests: the server's room (2 running + 2 queued). The
seeded comparisons are deterministic for the reason given in served_choices.py.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.served_choices import IN_FLIGHT, _ids, _sse_events, _texts
from tests.support.serve_process import IDS

__all__ = ["TestPromptsServed"]

FORMS = {
    "text": ["The quick brown fox", "café 日本語"],
    "tokens": [[5, 77, 300, 12, 190], [9, 8, 7]],
}
SEED = 21
CONTEXT = 128  # test_serve_openai.py's --context-len


def _ask(client, name, prompt, **kw):
    kw = {"model": name, "max_tokens": 8, "temperature": 1.0, "n": 2, "seed": SEED, **kw}
    return client.completions.create(prompt=prompt, extra_body={"ignore_eos": True, **IDS}, **kw)


def _idle(server, key):
    """Every engine request of the tests before has ended (a batch needs the whole room)."""
    for _ in range(400):
        m = server.wait_kv_free(key)
        if m[IN_FLIGHT] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still in flight: {m}")


class TestPromptsServed:
    @pytest.mark.parametrize("form", sorted(FORMS))
    def test_a_batch_is_each_prompt_alone_by_index_whole_and_streamed(
        self, server, client, name, form
    ):
        prompts = FORMS[form]
        _idle(server, client.api_key)
        r = _ask(client, name, prompts, logprobs=1)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.finish_reason for c in r.choices] == ["length"] * 4
        ids = _ids(r)
        assert all(len(i) == 8 for i in ids) and len({tuple(i) for i in ids}) == 4
        # Index p * n + i samples with seed SEED + p * n + i: prompt p alone, n = 2, from there.
        alone = [_ask(client, name, p, seed=SEED + 2 * k) for k, p in enumerate(prompts)]
        assert ids == _ids(alone[0]) + _ids(alone[1])
        assert _texts(r) == _texts(alone[0]) + _texts(alone[1])
        for c, i in zip(r.choices, ids, strict=True):  # logprobs per choice, as for one prompt
            assert len(c.logprobs.tokens) == len(i) == len(c.logprobs.token_logprobs)
        assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each once
        if form == "tokens":
            assert r.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])
        assert r.usage.completion_tokens == 32 == r.usage.total_tokens - r.usage.prompt_tokens
        # Streamed: chunks by index reassemble to the whole choices; the usage comes once.
        texts, got, reasons, usages = [""] * 4, [[] for _ in range(4)], [[] for _ in range(4)], []
        for ch in _ask(client, name, prompts, stream=True, stream_options={"include_usage": True}):
            usages += [ch.usage] if ch.usage else []
            for c in ch.choices:
                texts[c.index] += c.text
                got[c.index] += c.model_extra["token_ids"]
                reasons[c.index] += [c.finish_reason] if c.finish_reason else []
        assert texts == _texts(r) and got == ids and reasons == [["length"]] * 4
        # The counts alike; the prompts' cached tokens may differ (the prefix cache warmed).
        cached = "prompt_tokens_details"
        whole = r.usage.model_dump(exclude={cached})
        assert [u.model_dump(exclude={cached}) for u in usages] == [whole]

    def test_a_streamed_batch_ends_with_one_usage_chunk_and_one_done(self, server, client, name):
        _idle(server, client.api_key)
        body = {"model": name, "prompt": FORMS["tokens"], "n": 2, "seed": SEED, "max_tokens": 4,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        events = _sse_events(server, client.api_key, "/v1/completions", body)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"] == [] and "usage" not in chunks[0]
        assert sum("usage" in ch for ch in chunks) == 1
        assert chunks[-1]["usage"]["prompt_tokens"] == 5 + 3
        assert chunks[-1]["usage"]["completion_tokens"] == 16
        assert {ch["choices"][0]["index"] for ch in chunks[:-1]} == {0, 1, 2, 3}

    @pytest.mark.parametrize(
        "kw,param,text",
        [
            (dict(prompt=[]), "prompt", "prompt must hold at least one prompt"),
            (dict(prompt=["a", ""]), "prompt", "prompt[1] must not be empty"),
            (dict(prompt=[[1, 2], []]), "prompt", "prompt[1] must not be empty"),
            (dict(prompt=["a", [1, 2]]), "prompt", "not a mix: prompt[0] is a text"),
            (dict(prompt=[[1], [1] * CONTEXT]), "prompt[1]",
             f"the prompt has {CONTEXT} tokens; the context length is {CONTEXT}"),
            (dict(prompt=[[1], [1, 384]]), "prompt[1]", "prompt[1][1] must be a token id in"),
            (dict(prompt=[[1, 2], [1] * (CONTEXT - 3)]), "max_tokens",
             f"max_tokens must be <= 3 (context length {CONTEXT} minus prompt[1]'s"),
            (dict(prompt=[[1]] * 17, n=16), "n",
             "choices (prompts x n) must be <= 256, got 17 prompts x n 16 = 272"),
            (dict(prompt=[[1]] * 257), "prompt", "got 257 prompts x n 1 = 257"),
        ],
    )
    def test_bad_batches_are_400_naming_the_field(self, client, name, kw, param, text):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{"model": name, "max_tokens": 4, **kw})
        err = info.value.body
        assert info.value.status_code == 400 and err["param"] == param and text in err["message"]
