"""`dp-runtime serve` of a preset (random weights, no tokenizer): token-id prompts work and their
output ``token_ids`` come back unasked (no ``return_token_ids``: without text they are the only
output), text and chat prompts get 400 saying why; /health needs no key; Ctrl-C exits 0. The server runs with
``--prefix-caching``: a repeated prompt gives the same tokens and its usage and /metrics count
the prompt tokens served from the cache."""

from __future__ import annotations

import json
import signal

import openai
import pytest

from tests.support.serve_process import ServeProcess, get


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServeProcess(
        tmp_path_factory.mktemp("logs"),
        "--model",
        "tiny",
        "--launcher",
        "local",
        "--prefix-caching",
        env={"DP_RUNTIME_API_KEY": "k"},
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)


def test_token_ids_work_without_a_tokenizer(client):
    r = client.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=5, temperature=0)
    assert len(r.choices[0].model_extra["token_ids"]) == 5 and r.choices[0].text == ""
    assert r.choices[0].finish_reason == "length"


def test_token_ids_stream_step_by_step_without_text(client):
    kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0)
    whole = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    steps = [
        c.choices[0].model_extra["token_ids"]
        for c in client.completions.create(**kw, stream=True)
        if c.choices
    ]
    assert [t for step in steps for t in step] == whole
    assert sum(1 for step in steps if step) > 1  # not all at the end: no text holds ids back


def test_text_and_chat_are_400_saying_there_is_no_tokenizer(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert info.value.body["param"] == "prompt" and "has no tokenizer" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["param"] == "messages" and "send token ids" in info.value.body["message"]


def test_a_repeated_prompt_reports_its_cached_tokens(server, client):
    before = server.metrics("k")
    kw = dict(model="tiny", prompt=list(range(30, 60)), max_tokens=4, temperature=0)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    streamed = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 29  # all but the last prompt token
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 29
    ids = first.choices[0].model_extra["token_ids"]
    assert again.choices[0].model_extra["token_ids"] == ids
    assert [t for c in streamed if c.choices for t in c.choices[0].model_extra["token_ids"]] == ids
    after = server.metrics("k")
    key = ("dp_runtime_prefix_cache_hit_tokens_total", (("rank", "0"),))
    assert after[key] - before.get(key, 0) == 2 * 29
    assert after[("dp_runtime_prefix_cache_tokens", (("rank", "0"),))] >= 33


def test_api_key_from_the_environment(server):
    assert get(server.url + "/v1/models")[0] == 401
    status, body = get(server.url + "/v1/models", {"Authorization": "Bearer k"})
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"
    status, body = get(server.url + "/health")
    assert status == 200 and json.loads(body)["state"] == "ready"


def test_ctrl_c_exits_0(server):
    assert server.stop(signal.SIGINT) == 0, server.log()
    assert "stopped" in server.log()
