"""``n`` choices through `dp-runtime serve` (launch/server/choices.py, respond.py), on
test_serve_openai.py's server (its tiny checkpoint and trained tokenizer), driven by the
official `openai` client and, where the SSE framing itself is checked, raw HTTP.

``TestChoicesServed`` is imported by test_serve_openai.py, so pytest runs it there with that
module's fixtures (``server``, ``client``, ``name``): one server process for both. This module's
name does not start with ``test_``: it is not collected on its own.

The seeded tests are deterministic (a draw's noise is keyed by the seed and token index): 8 tokens
drawn at temperature 1 from the random model's 384 ids differ between seeds 11, 12 and 13.
"""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest

from tests.support.failing_worker import FAILING_SEED, INJECTED
from tests.support.serve_process import IDS

__all__ = ["TestChoicesServed"]

RANK0 = (("rank", "0"),)
ABORTED = ("dp_runtime_requests_finished_total", (("finish_reason", "abort"), ("rank", "0")))
ROUTED = ("dp_runtime_requests_routed_total", RANK0)
IN_FLIGHT = ("dp_runtime_in_flight_requests", RANK0)


def _ask(client, name, route, **kw):
    kw = {"model": name, "max_tokens": 8, "temperature": 1.0,
          "extra_body": {"ignore_eos": True, **IDS}, **kw}
    if route == "chat":
        return client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
    return client.completions.create(prompt="The quick brown fox", **kw)


def _texts(r):
    return [c.message.content if hasattr(c, "message") else c.text for c in r.choices]


def _ids(r):
    return [c.model_extra["token_ids"] for c in r.choices]


def _sse_events(server, key, path, body):
    req = urllib.request.Request(
        server.url + path,
        json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]


def _wait_aborted(server, key, at_least):
    for _ in range(100):  # counted when each aborted request's last output is drained
        m = server.metrics(key)
        if m.get(ABORTED, 0) >= at_least:
            return m
        time.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} aborted requests: {m}")


class TestChoicesServed:
    @pytest.mark.parametrize("route", ["completion", "chat"])
    def test_choices_sample_apart_reproducibly_and_sum_usage(self, client, name, route):
        r = _ask(client, name, route, n=3, seed=11)
        ids = _ids(r)
        assert [c.index for c in r.choices] == [0, 1, 2] and all(len(i) == 8 for i in ids)
        assert [c.finish_reason for c in r.choices] == ["length"] * 3
        assert len({tuple(i) for i in ids}) == 3  # seeds 11, 12, 13
        one = _ask(client, name, route, n=1, seed=13)  # choice i samples with seed + i
        assert _ids(one) == ids[2:] and _texts(one) == _texts(r)[2:]
        assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
        assert r.usage.completion_tokens == 24 == r.usage.total_tokens - r.usage.prompt_tokens
        again = _ask(client, name, route, n=3, seed=11)
        assert _ids(again) == ids and _texts(again) == _texts(r)
        greedy = _ask(client, name, route, n=2, temperature=0)  # not special-cased: the same
        assert _ids(greedy)[0] == _ids(greedy)[1]

    def test_streamed_choices_by_index_then_usage_then_one_done(self, server, client, name):
        body = {"model": name, "prompt": "The quick brown fox", "n": 2, "seed": 5,
                "max_tokens": 8, "stop": ["never-there"]}
        whole = client.completions.create(**body, extra_body={"ignore_eos": True, **IDS})
        events = _sse_events(server, client.api_key, "/v1/completions", {
            **body, "ignore_eos": True, **IDS, "stream": True,
            "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True)
        texts, ids, reasons = ["", ""], [[], []], [[], []]
        for ch in chunks[:-1]:
            (c,) = ch["choices"]
            texts[c["index"]] += c["text"]
            ids[c["index"]] += c["token_ids"]
            reasons[c["index"]] += [c["finish_reason"]] if c["finish_reason"] else []
        assert texts == _texts(whole) and ids == _ids(whole)
        assert reasons == [["length"], ["length"]]
        # Chat through the openai client: each index reassembles to its whole choice.
        kw = dict(n=2, seed=5, max_tokens=8)
        whole = _ask(client, name, "chat", **kw)
        texts, reasons, usage = ["", ""], [[], []], None
        stream = _ask(client, name, "chat", **kw, stream=True,
                      stream_options={"include_usage": True})
        for ch in stream:
            usage = ch.usage or usage
            for c in ch.choices:
                texts[c.index] += c.delta.content or ""
                reasons[c.index] += [c.finish_reason] if c.finish_reason else []
        assert texts == _texts(whole) and reasons == [["length"], ["length"]]
        assert usage.completion_tokens == whole.usage.completion_tokens == 16

    def test_closing_the_stream_aborts_every_choice(self, server, client, name):
        key = client.api_key
        before = server.wait_kv_free(key).get(ABORTED, 0)
        context = client.models.list().data[0].model_extra["max_model_len"]
        stream = client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=context - 3,
                                           n=2, stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        while {c.index for c in next(it).choices} != {1}:  # until choice 1 has sent a token
            pass
        assert server.metrics(key)[("dp_runtime_running_requests", RANK0)] == 2
        stream.close()
        server.wait_kv_free(key)
        # The rank frees a request's KV at the abort and reports it finished at a later poll
        # (seen once in a full CI run: KV free, one request still in flight): both choices
        # end as aborted, then nothing is in flight.
        _wait_aborted(server, key, before + 2)
        for _ in range(100):
            if server.metrics(key)[IN_FLIGHT] == 0:
                break
            time.sleep(0.05)
        assert server.metrics(key)[IN_FLIGHT] == 0

    def test_choices_past_the_queue_are_429_and_the_submitted_ones_aborted(
        self, server, client, name
    ):
        key = client.api_key
        before = server.wait_kv_free(key)
        with pytest.raises(openai.BadRequestError) as info:  # 16 > the server's room for 4: never
            client.completions.create(model=name, prompt=[1, 2], max_tokens=2, n=16)
        assert info.value.body["param"] == "n" and "16 engine requests" in info.value.body["message"]
        assert "at most 4 in flight" in info.value.body["message"]
        assert server.metrics(key)[ROUTED] == before[ROUTED]  # refused before any was submitted
        context = client.models.list().data[0].model_extra["max_model_len"]
        held = client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=context - 3, n=2,
                                         stream=True, extra_body={"ignore_eos": True})
        it = iter(held)
        next(it)  # two of the four places are taken
        with pytest.raises(openai.RateLimitError) as info:  # 3 > the 2 left: 429, retry later
            client.completions.create(model=name, prompt=[1, 2], max_tokens=2, n=3)
        assert info.value.body["code"] == "queue_full"
        held.close()
        routed = server.metrics(key)[ROUTED] - before[ROUTED]
        assert routed >= 3  # the held two, and those submitted before the queue was full: aborted
        assert _wait_aborted(server, key, before.get(ABORTED, 0) + routed)[IN_FLIGHT] == 0
        r = client.completions.create(model=name, prompt=[1, 2], max_tokens=2, n=3)
        assert [c.index for c in r.choices] == [0, 1, 2]

    def test_choices_failing_in_their_step_are_one_500(self, server, client, name):
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=name, prompt=[4, 5, 6], max_tokens=5, n=2,
                                      temperature=1, seed=FAILING_SEED)
        assert info.value.status_code == 500 and INJECTED in info.value.body["message"]
        assert server.wait_kv_free(client.api_key)[IN_FLIGHT] == 0
