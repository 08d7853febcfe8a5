"""vLLM's side of the door (issue 45 item 5), on a real server process (local launcher, a tiny
checkpoint with a trained tokenizer) and the real ``openai`` client: each vLLM extra that would
change a result is refused by name; /tokenize, /detokenize, /version and /v1/models/{id} in
vLLM's shapes; ``return_token_ids``, ``stream_options.continuous_usage_stats``, the first chat
delta, ``return_tokens_as_token_ids`` and ``truncate_prompt_tokens``."""

from __future__ import annotations

import json
import math
import time
import urllib.request

import openai
import pytest

from launch.server.protocol import ChatRequest, CompletionRequest
from launch.server.vllm_fields import REFUSED, refuse_unimplemented
from tests.support.serve_model import write_serve_checkpoint
from tests.support.serve_process import ServeProcess, get

CONTEXT = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_serve_checkpoint(tmp_path_factory.mktemp("vllm") / "ckpt")
    args = ("--model", str(ckpt), "--launcher", "local", "--context-len", str(CONTEXT),
            "--sampling-defaults", "none")
    with ServeProcess(tmp_path_factory.mktemp("logs"), *args) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_every_refused_extra_is_named_and_its_off_values_pass():
    for name, (unset, _) in REFUSED.items():
        on = {"guided_json": {"type": "object"}, "prompt_logprobs": 0, "length_penalty": 2.0,
              "skip_special_tokens": False, "spaces_between_special_tokens": False,
              "add_generation_prompt": False, "bad_words": ["x"], "allowed_token_ids": [1],
              "chat_template_kwargs": {"enable_thinking": False}}.get(name, True)
        for cls, extra in ((CompletionRequest, {"prompt": "a"}),
                           (ChatRequest, {"messages": [{"role": "user", "content": "a"}]})):
            with pytest.raises(Exception, match=f"{name} is not supported") as info:
                refuse_unimplemented(cls(model="m", **extra, **{name: on}))
            assert info.value.status == 400 and info.value.param == name
            for off in unset:
                refuse_unimplemented(cls(model="m", **extra, **{name: off}))
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "a"}], echo=True)
    with pytest.raises(Exception, match="echo is not supported"):
        refuse_unimplemented(chat)


@pytest.mark.parametrize("route, extra", [
    ("completions", {"guided_json": {"type": "object"}}),
    ("completions", {"guided_choice": ["yes", "no"]}),
    ("completions", {"include_stop_str_in_output": True}),
    ("completions", {"prompt_logprobs": 1}),
    ("completions", {"use_beam_search": True}),
    ("chat", {"echo": True}),
    ("chat", {"guided_regex": "[a-z]+"}),
    ("chat", {"tool_choice": "auto"}),  # without tools (vLLM's rule)
])
def test_extras_that_would_change_results_are_400_by_name(server, route, extra):
    body = ({"prompt": "hello", "max_tokens": 2} if route == "completions"
            else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    status, out = _post(server, path, {"model": "ckpt", **body, **extra})
    name = next(iter(extra))
    assert status == 400 and out["error"]["param"] == name, out


def test_tokenize_detokenize_version_and_models_as_vllm_serves_them(server, client):
    status, tok = _post(server, "/tokenize", {"model": "ckpt", "prompt": "hello world",
                                              "return_token_strs": True})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == CONTEXT
    assert len(tok["token_strs"]) == tok["count"]
    r = client.completions.create(model="ckpt", prompt="hello world", max_tokens=1)
    assert r.usage.prompt_tokens == tok["count"]
    assert _post(server, "/detokenize", {"tokens": tok["tokens"]}) == (200, {"prompt": "hello world"})
    messages = [{"role": "user", "content": "hi there"}]
    status, chat = _post(server, "/tokenize", {"messages": messages})
    r = client.chat.completions.create(model="ckpt", messages=messages, max_tokens=1)
    assert status == 200 and chat["token_strs"] is None and r.usage.prompt_tokens == chat["count"]
    status, err = _post(server, "/tokenize", {"prompt": "a", "add_special_tokens": False})
    assert status == 400 and err["error"]["param"] == "add_special_tokens"
    status, err = _post(server, "/detokenize", {"tokens": [1, 10**6]})
    assert status == 400 and err["error"]["param"] == "tokens[1]"
    status, text = get(server.url + "/version")
    assert status == 200 and json.loads(text)["version"]
    card = client.models.retrieve("ckpt")
    assert card.id == "ckpt" and card.model_extra["root"].endswith("ckpt")
    assert client.models.list().data[0].model_extra["root"] == card.model_extra["root"]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other")
    assert info.value.body["code"] == "model_not_found"


def test_return_token_ids_gives_the_prompt_s_ids_whole_and_streamed(server, client):
    ids = _post(server, "/tokenize", {"prompt": "hello world"})[1]["tokens"]
    r = client.completions.create(model="ckpt", prompt=[ids, [5, 6, 7]], max_tokens=3, n=2,
                                  extra_body={"return_token_ids": True})
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == [ids, ids, [5, 6, 7], [5, 6, 7]]
    plain = client.completions.create(model="ckpt", prompt="hello world", max_tokens=3)
    assert "prompt_token_ids" not in plain.choices[0].model_extra
    chat = client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] and chat.choices[0].model_extra["token_ids"]
    chunks = list(client.completions.create(model="ckpt", prompt="hello world", max_tokens=4,
                                            n=2, stream=True,
                                            extra_body={"return_token_ids": True}))
    carrying = [(c.choices[0].index, c.choices[0].model_extra["prompt_token_ids"])
                for c in chunks if c.choices and "prompt_token_ids" in c.choices[0].model_extra]
    assert sorted(carrying) == [(0, ids), (1, ids)]  # once per choice, on its first chunk


def test_continuous_usage_first_chat_delta_and_tokens_as_ids(client):
    stream = client.chat.completions.create(
        model="ckpt", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    used = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and used == sorted(used) and used[-1] == 5
    r = client.completions.create(model="ckpt", prompt="hello", max_tokens=3, logprobs=2,
                                  extra_body={"return_tokens_as_token_ids": True,
                                              "ignore_eos": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids]
    assert r.choices[0].logprobs.text_offset[0] == 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client):
    ids = list(range(10, 40))
    cut = client.completions.create(model="ckpt", prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 5})
    alone = client.completions.create(model="ckpt", prompt=ids[-5:], max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 5
    assert cut.choices[0].model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
    whole = client.completions.create(model="ckpt", prompt=list(range(10, 10 + CONTEXT + 8)),
                                      max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == CONTEXT - 1
    for k in (0, -2, CONTEXT):
        status, err = _post(server, "/v1/completions", {"model": "ckpt", "prompt": ids,
                                                         "truncate_prompt_tokens": k})
        assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens", err


def test_vllm_metric_families_beside_dp_runtime_s(server, client):
    before = server.metrics()
    r = client.completions.create(model="ckpt", prompt=[1, 2, 3, 4], max_tokens=3, n=2,
                                  extra_body={"ignore_eos": True})
    m = server.metrics()
    labels = (("engine", "0"), ("model_name", "ckpt"))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
        assert (name, labels) in m, name

    def grew(name, labels=labels):
        return m[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("vllm:request_success_total", (*labels[:1], ("finished_reason", "length"),
                                               labels[1])) == 2
    assert grew("vllm:request_prompt_tokens_sum") == 8 and grew("vllm:request_prompt_tokens_count") == 2
    assert grew("vllm:request_generation_tokens_sum") == 6 == r.usage.completion_tokens
    assert grew("vllm:request_params_n_sum", (("model_name", "ckpt"),)) == 2  # one prompt, n 2
    assert grew("vllm:request_params_max_tokens_sum", (("model_name", "ckpt"),)) == 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert grew(f"vllm:{name}_count") == 2, name
    assert grew("vllm:inter_token_latency_seconds_count") == 4
    # scraped from the ranks' stats, as the dp_runtime_ series of the same scrape
    rank = (("rank", "0"),)
    assert m[("vllm:generation_tokens_total", labels)] == m[("dp_runtime_generation_tokens_total", rank)]
    assert m[("vllm:prompt_tokens_total", labels)] == m[("dp_runtime_prompt_tokens_total", rank)]
    queries, hits = grew("vllm:prefix_cache_queries_total"), grew("vllm:prefix_cache_hits_total")
    assert queries >= hits and queries == grew("vllm:prompt_tokens_total") + hits


def _settled(server) -> dict:
    """/metrics once every step the rank launched is recorded (one rank, so no IDLE steps: the
    histogram counts every step); a step whose tokens were not read yet (a stop token's extra
    step, overlapped) is recorded a step later. Raises after 20 s of polling."""
    for _ in range(400):
        m = server.metrics()
        count = m[("vllm:iteration_tokens_total_count", (("engine", "0"), ("model_name", "ckpt")))]
        if count == m[("dp_runtime_steps_total", (("rank", "0"),))]:
            return m
        time.sleep(0.05)
    raise AssertionError(f"steps never all recorded: {count} of {m}")


def test_iteration_tokens_counts_each_step_s_tokens_on_its_rank(server, client):
    before = _settled(server)
    new = 4
    client.completions.create(model="ckpt", prompt=[21, 22, 23, 24, 25], max_tokens=new,
                              extra_body={"ignore_eos": True})
    m = _settled(server)
    labels = (("engine", "0"), ("model_name", "ckpt"))

    def grew(name, *le):
        key = (name, tuple(sorted((*labels, *((("le", le[0]),) if le else ())))))
        return m[key] - before.get(key, 0.0)

    prefilled = grew("vllm:prompt_tokens_total")  # the prompt less what the prefix cache held
    assert 1 <= prefilled <= 5
    # One step prefills the prompt and samples the first token; one decode row per token after.
    assert grew("vllm:iteration_tokens_total_count") == new
    assert grew("vllm:iteration_tokens_total_sum") == prefilled + new - 1
    assert grew("vllm:iteration_tokens_total_bucket", "1.0") == new - 1 + (prefilled == 1)
    assert grew("vllm:iteration_tokens_total_bucket", "8.0") == new
    assert grew("vllm:iteration_tokens_total_bucket", "+Inf") == new
    buckets = sorted(float(dict(k[1])["le"]) for k in m
                     if k[0] == "vllm:iteration_tokens_total_bucket")
    assert buckets == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, math.inf]
