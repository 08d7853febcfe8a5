"""`dp-runtime serve` end to end: a real server process (local launcher) on a tiny Qwen3-MoE
checkpoint with a tokenizer trained by the test, driven by the official `openai` client, its
answers compared with transformers' greedy `generate` on the same checkpoint.

The checkpoint's generation_config.json names, besides the tokenizer's EOS, a plain token that
greedy decoding of ``EOS_PROMPT`` reaches as its 4th token, so a request ends on EOS (the
random model never samples the real EOS). It also says ``top_k: 1``, which the server, run with
``--sampling-defaults none``, must ignore (tests/served_sampling.py): the sampled tests here are
written against OpenAI's defaults.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.hf_reference import greedy_reference, load_reference
from tests.served_bias import TestLogitBiasServed  # noqa: F401  (runs here, on this server)
from tests.served_choices import TestChoicesServed  # noqa: F401  (runs here, on this server)
from tests.served_edges import TestRangeEndsServed  # noqa: F401  (runs here, on this server)
from tests.served_logprobs import TestLogprobsServed  # noqa: F401  (runs here, on this server)
from tests.served_min_tokens import TestMinTokensServed  # noqa: F401  (runs here, on this server)
from tests.served_penalties import TestPenaltiesServed  # noqa: F401  (runs here, on this server)
from tests.served_prompts import TestPromptsServed  # noqa: F401  (runs here, on this server)
from tests.served_sampling import TestSamplingServed  # noqa: F401  (runs here, on this server)
from tests.support.failing_worker import FAILING_SEED, INJECTED, server_env
from tests.support.serve_model import write_serve_checkpoint
from tests.support.serve_process import IDS, ServeProcess, get

KEY = "test-key"
EOS_PROMPT = "hello world"
CONTEXT = 128
MAX_RUNNING, MAX_QUEUED = 2, 2  # room for 4: two prompts of n = 2 (served_prompts.py)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint dir, transformers model, tokenizer, the extra EOS id)."""
    from transformers import AutoTokenizer

    path = write_serve_checkpoint(tmp_path_factory.mktemp("ckpt"))
    tok = AutoTokenizer.from_pretrained(str(path))
    model = load_reference(path)
    first, _ = greedy_reference(model, tok(EOS_PROMPT).input_ids, 8)
    eos = first[3]
    assert eos not in first[:3]
    # The same weights (same seed), EOS list extended; top_k after the reference loaded (its
    # generate would read it).
    write_serve_checkpoint(path, extra_eos=(eos,), generation={"top_k": 1})
    model.generation_config.eos_token_id = [tok.eos_token_id, eos]
    return path, model, tok, eos


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    args = (
        "--model",
        str(ckpt[0]),
        "--launcher",
        "local",
        "--api-key",
        KEY,
        "--context-len",
        str(CONTEXT),
        "--max-running-requests",
        str(MAX_RUNNING),
        "--max-queued",
        str(MAX_QUEUED),
        "--sampling-defaults",
        "none",
    )
    with ServeProcess(tmp_path_factory.mktemp("logs"), *args, env=server_env()) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def name(ckpt):
    return ckpt[0].name


def _ref(ckpt, ids, n):
    return greedy_reference(ckpt[1], ids, n)[0]


def _text(ckpt, ids, hidden=()):
    ids = ids[:-1] if ids and ids[-1] in hidden else ids
    return ckpt[2].decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _eos_ids(ckpt):
    return (ckpt[2].eos_token_id, ckpt[3])


@pytest.mark.parametrize("prompt", ["The quick brown fox", "café 日本語 🙂"])
def test_text_prompt_equals_transformers(ckpt, client, name, prompt):
    ids = ckpt[2](prompt).input_ids
    ref = _ref(ckpt, ids, 12)
    r = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body=IDS)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == ref
    assert choice.text == _text(ckpt, ref, _eos_ids(ckpt))
    assert choice.finish_reason == ("stop" if ref[-1] in _eos_ids(ckpt) else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref))


def test_token_id_prompt_equals_transformers(ckpt, client, name):
    ids = [5, 77, 300, 12, 190, 45]
    ref = _ref(ckpt, ids, 10)
    r = client.completions.create(model=name, prompt=ids, max_tokens=10, temperature=0,
                                  extra_body=IDS)
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.choices[0].text == _text(ckpt, ref, _eos_ids(ckpt))


def test_chat_goes_through_the_template_and_equals_transformers(ckpt, client, name):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ids = ckpt[2].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ckpt[2](ids, add_special_tokens=False).input_ids
    ref = _ref(ckpt, ids, 10)
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0,
                                       extra_body=IDS)
    assert r.choices[0].message.content == _text(ckpt, ref, _eos_ids(ckpt))
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.usage.prompt_tokens == len(ids)


def test_eos_stops_with_reason_stop_and_is_not_text(ckpt, client, name):
    ids = ckpt[2](EOS_PROMPT).input_ids
    ref = _ref(ckpt, ids, 16)  # transformers stops at the EOS too
    assert len(ref) == 4 and ref[-1] == ckpt[3]
    r = client.completions.create(model=name, prompt=EOS_PROMPT, max_tokens=16, temperature=0,
                                  extra_body=IDS)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.choices[0].text == _text(ckpt, ref[:-1])
    r = client.completions.create(
        model=name, prompt=EOS_PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True, **IDS}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    assert r.choices[0].model_extra["token_ids"][:4] == ref


def test_stop_token_ids_end_the_request_and_are_not_text(ckpt, client, name):
    ids = [9, 8, 7, 6, 5]
    ref = _ref(ckpt, ids, 10)
    stop_id = next(
        t for i, t in enumerate(ref) if i >= 2 and t not in ref[:i] and t not in _eos_ids(ckpt)
    )
    cut = ref[: ref.index(stop_id) + 1]
    r = client.completions.create(
        model=name,
        prompt=ids,
        max_tokens=10,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], **IDS},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["token_ids"] == cut
    assert r.choices[0].text == _text(ckpt, cut[:-1])


def _stream_text(stream, ids=None):
    parts, reasons, usage = [], [], None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            parts.append(c.text if hasattr(c, "text") else (c.delta.content or ""))
            reasons.append(c.finish_reason)
            if ids is not None:
                ids.extend(c.model_extra.get("token_ids") or [])
    return "".join(parts), [r for r in reasons if r], usage


@pytest.mark.parametrize("prompt", ["café 日本語 🙂", "The quick brown fox", EOS_PROMPT])
def test_streamed_text_equals_non_streamed(client, name, prompt):
    kw = dict(model=name, prompt=prompt, max_tokens=20, temperature=0, extra_body=IDS)
    whole = client.completions.create(**kw)
    ids: list[int] = []
    text, reasons, usage = _stream_text(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True}), ids
    )
    assert text == whole.choices[0].text and reasons == [whole.choices[0].finish_reason]
    assert ids == whole.choices[0].model_extra["token_ids"]
    assert usage.completion_tokens == whole.usage.completion_tokens
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(
        model=name, messages=messages, max_tokens=20, temperature=0
    )
    text, reasons, _ = _stream_text(
        client.chat.completions.create(
            model=name, messages=messages, max_tokens=20, temperature=0, stream=True
        )
    )
    assert text == whole.choices[0].message.content and reasons == [whole.choices[0].finish_reason]


def test_sse_ends_with_done(server, name):
    import urllib.request

    body = json.dumps(
        {"model": name, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "stream": True}
    )
    req = urllib.request.Request(
        server.url + "/v1/completions",
        body.encode(),
        method="POST",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        events = [ln for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_text_streamed_or_not(client, name):
    kw = dict(
        model=name,
        prompt="The quick brown fox",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0].text
    i = next(i for i in range(3, len(full)) if full[i] not in "\ufffd ")
    stop = full[i]
    expect = full[: full.index(stop)]
    r = client.completions.create(**kw, stop=[stop, "never-there"])
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    text, reasons, _ = _stream_text(client.completions.create(**kw, stop=[stop], stream=True))
    assert text == expect and reasons == ["stop"]


@pytest.mark.parametrize(
    "kw,param,text",
    [
        (dict(n=17), "n", "n must be in [1, 16] (choices per request), got 17"),
        (dict(n=0), "n", "got 0"),
        (dict(max_tokens=0), "max_tokens", "got 0"),
        (dict(max_tokens=CONTEXT), "max_tokens", f"must be <= {CONTEXT - 3}"),
        (dict(temperature=-1), "temperature", "got -1"),
        (dict(top_p=0), "top_p", "(0, 1]"),
        (dict(top_p=1.01), "top_p", "got 1.01"),
        (dict(model="other"), "model", "got 'other'"),
        (
            dict(prompt=[1] * CONTEXT),
            "prompt",
            f"the prompt has {CONTEXT} tokens; the context length is {CONTEXT}",
        ),
        (dict(prompt=[1, 384]), "prompt", "prompt[1] must be a token id in [0, 384)"),
        (dict(temperature="hot"), "temperature", "valid number"),
    ],
)
def test_bad_fields_are_400_naming_the_field(client, name, kw, param, text):
    kw = {"model": name, "prompt": [1, 2, 3], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kw)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param and text in err["message"], err


def test_nan_temperature_is_400(server, name):
    # The openai client refuses to send NaN; Python's json writes it, and servers must refuse it.
    import urllib.error
    import urllib.request

    body = json.dumps(
        {"model": name, "prompt": [1, 2], "max_tokens": 2, "temperature": float("nan")}
    )
    req = urllib.request.Request(
        server.url + "/v1/completions",
        body.encode(),
        method="POST",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    err = json.loads(info.value.read())["error"]
    assert info.value.code == 400 and err["param"] == "temperature" and "got nan" in err["message"]


def test_api_key_guards_every_route_but_health(server):
    for path in ("/v1/models", "/metrics"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, body = get(server.url + path, headers)
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert get(server.url + "/health")[0] == 200
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="x", prompt=[1], max_tokens=1)


def test_models_lists_the_served_model(client, name):
    assert [m.id for m in client.models.list().data] == [name]


def _long(client, name):
    return client.completions.create(
        model=name,
        prompt=[1, 2, 3],
        max_tokens=CONTEXT - 3,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def test_closing_a_stream_aborts_it_and_frees_its_kv(server, client, name):
    server.wait_kv_free(KEY)
    stream = _long(client, name)
    it = iter(stream)
    next(it), next(it)
    m = server.metrics(KEY)
    assert m[("dp_runtime_running_requests", (("rank", "0"),))] == 1
    assert (
        m[("dp_runtime_kv_cache_free_slots", (("rank", "0"),))]
        < m[("dp_runtime_kv_cache_slots", (("rank", "0"),))]
    )
    stream.close()
    m = server.wait_kv_free(KEY)
    assert m[("dp_runtime_running_requests", (("rank", "0"),))] == 0
    # The abort is counted when the server drains the request's last output, which can land a
    # moment after the rank reports its KV free.
    aborted = ("dp_runtime_requests_finished_total", (("finish_reason", "abort"), ("rank", "0")))
    for _ in range(100):
        if m.get(aborted, 0) >= 1:
            break
        time.sleep(0.05)
        m = server.metrics(KEY)
    assert m.get(aborted, 0) >= 1, m


def _hold(server, name, n):
    body = {"model": name, "prompt": [1, 2, 3], "max_tokens": CONTEXT - 3, "temperature": 0,
            "stream": True, "ignore_eos": True}
    return server.hold_streams("/v1/completions", body, n, KEY)


def test_queue_full_is_429_with_retry_after_and_leaving_clients_free_kv(server, client, name):
    server.wait_kv_free(KEY)
    socks = _hold(server, name, MAX_RUNNING + MAX_QUEUED)
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=name, prompt=[1, 2], max_tokens=2)
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.body["code"] == "queue_full"
    finally:
        for s in socks:
            s.close()
    m = server.wait_kv_free(KEY)  # the running ones and the queued one are all aborted
    assert m[("dp_runtime_running_requests", (("rank", "0"),))] == 0
    assert (
        client.completions.create(model=name, prompt=[1, 2], max_tokens=2).choices[0].finish_reason
    )


def test_metrics_parse_and_count_per_rank(server, client, name):
    before = server.metrics(KEY)
    client.completions.create(
        model=name,
        prompt=[4, 5, 6, 7],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = server.metrics(KEY)
    rank0 = (("rank", "0"),)
    assert (
        after[("dp_runtime_generation_tokens_total", rank0)]
        - before[("dp_runtime_generation_tokens_total", rank0)]
        == 5
    )
    assert (
        after[("dp_runtime_prompt_tokens_total", rank0)]
        - before[("dp_runtime_prompt_tokens_total", rank0)]
        == 4
    )
    assert (
        after[("dp_runtime_requests_routed_total", rank0)]
        == before[("dp_runtime_requests_routed_total", rank0)] + 1
    )
    key = ("dp_runtime_time_to_first_token_seconds_count", rank0)
    assert after[key] == before.get(key, 0) + 1
    assert (
        after[("dp_runtime_engine_healthy", ())] == 1
        and after[("dp_runtime_restarts_total", ())] == 0
    )


def test_a_request_failing_in_its_step_is_500_and_fails_alone(server, client, name):
    # The server's ranks (server_env) fail a request seeded FAILING_SEED at its first token,
    # inside the step, as a draw over NaN logits fails (tests/support/failing_worker.py); a
    # stream beside it goes on to its end.
    other = client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=30, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=name, prompt=[4, 5, 6], max_tokens=5, temperature=1,
                                  seed=FAILING_SEED)
    assert info.value.status_code == 500 and INJECTED in info.value.body["message"]
    reasons = [c.choices[0].finish_reason for c in other if c.choices]
    assert reasons[-1] == "length"


def test_an_idle_connection_outlives_uvicorns_default_keep_alive(server):
    """A connection left idle past uvicorn's default keep-alive (5 s) still serves the next
    request on the same socket: the server keeps idle connections --keep-alive-timeout (30 s),
    longer than clients keep them pooled, so no client sends on one the server is closing."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        time.sleep(6)
        conn.request("GET", "/health")  # raises RemoteDisconnected had the server closed it
        second = conn.getresponse()
        second.read()
        assert (first.status, second.status) == (200, 200) and conn.sock is sock
    finally:
        conn.close()
