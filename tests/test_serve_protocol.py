"""The server's request checks: each bad field is a 400 naming the field, its limit and value;
unset sampling fields take the checkpoint's defaults, else OpenAI's."""

from __future__ import annotations

import math

import pytest

from dp_runtime.model.sampling_defaults import SamplingDefaults
from dp_runtime.serving.request import SamplingParams
from launch.server.chat_request import messages_of
from launch.server.logit_bias import logit_bias_of
from launch.server.prompts import MAX_CHOICES, prompts_of
from launch.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    check_prompt_ids,
    sampling_of,
)

CTX, VOCAB = 64, 384


def _sampling(prompt_len=10, default=16, defaults=None, **fields):
    req = CompletionRequest(model="m", prompt="x", **fields)
    return sampling_of(
        req, prompt_len=prompt_len, context_len=CTX, vocab_size=VOCAB, default_max_tokens=default,
        defaults=defaults,
    )


def _refused(name, match, fn, *args, **kw):
    with pytest.raises(ApiError, match=match) as info:
        fn(*args, **kw)
    assert info.value.status == 400 and info.value.param == name
    return info.value


def test_defaults_are_openai_s():
    s = _sampling()
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.stop, s.ignore_eos) == (
        16,
        1.0,
        1.0,
        0,
        (),
        False,
    )
    assert 0 <= s.seed < 2**64
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert (
        sampling_of(
            chat, prompt_len=10, context_len=CTX, vocab_size=VOCAB, default_max_tokens=None
        ).max_new_tokens
        == CTX - 10
    )
    # The completion default is cut to the room left in the context.
    assert _sampling(prompt_len=60).max_new_tokens == 4


def test_fields_resolve():
    s = _sampling(
        max_tokens=5,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        min_p=0.25,
        seed=7,
        stop="ab",
        stop_token_ids=[3],
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
        min_tokens=2,
    )
    assert s.params() == dict(
        max_new_tokens=5,
        temperature=0.0,
        top_p=0.5,
        top_k=0,
        seed=7,
        stop_token_ids=(3,),
        ignore_eos=True,
        logprobs=None,  # set from logprobs.logprobs_of by the app
        logit_bias=(),  # set from logit_bias.logit_bias_of by the app
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_p=0.25,
        repetition_penalty=1.0,
        min_tokens=2,
    )
    assert s.stop == ("ab",) and s.stream and s.include_usage


@pytest.mark.parametrize(
    "fields,param,match",
    [
        (dict(n=0), "n", r"n must be in \[1, 16\].*got 0"),
        (dict(n=17), "n", "got 17"),
        (dict(max_tokens=0), "max_tokens", "max_tokens must be >= 1, got 0"),
        (dict(max_tokens=-3), "max_tokens", "got -3"),
        (
            dict(max_tokens=55),
            "max_tokens",
            r"max_tokens must be <= 54 \(context length 64 minus the prompt's 10",
        ),
        (
            dict(temperature=-0.5),
            "temperature",
            "temperature must be a finite number >= 0, got -0.5",
        ),
        (dict(temperature=math.nan), "temperature", "got nan"),
        (dict(top_p=0), "top_p", r"top_p must be in \(0, 1\], got 0"),
        (dict(top_p=1.5), "top_p", "got 1.5"),
        (dict(top_k=-2), "top_k", "got -2"),
        (dict(min_p=1.5), "min_p", r"min_p must be a finite number in \[0, 1\] \(0: off\), got 1.5"),
        (dict(min_p=-0.1), "min_p", "got -0.1"),
        (dict(min_p=math.nan), "min_p", "got nan"),
        (dict(seed=-1), "seed", r"seed must be in \[0, 2\*\*64\), got -1"),
        (dict(stop=["a", ""]), "stop", "must not be empty"),
        (
            dict(stop_token_ids=[1, 384]),
            "stop_token_ids",
            r"stop_token_ids\[1\] must be a token id in \[0, 384\), got 384",
        ),
        (dict(stream_options={"include_usage": True}), "stream_options", "only with stream"),
        (dict(presence_penalty=2.5), "presence_penalty",
         r"presence_penalty must be a finite number in \[-2, 2\], got 2.5"),
        (dict(frequency_penalty=-2.01), "frequency_penalty", "got -2.01"),
        (dict(frequency_penalty=math.inf), "frequency_penalty", "got inf"),
        (dict(presence_penalty=math.nan), "presence_penalty", "got nan"),
        (dict(repetition_penalty=0), "repetition_penalty",
         r"repetition_penalty must be a finite number > 0 \(1: off\), got 0"),
        (dict(repetition_penalty=-1.5), "repetition_penalty", "got -1.5"),
        (dict(repetition_penalty=math.inf), "repetition_penalty", "got inf"),
        (dict(echo=True), "echo", "not supported"),
        (dict(best_of=3), "best_of", "got 3"),
    ],
)
def test_bad_field_is_named(fields, param, match):
    _refused(param, match, _sampling, **fields)


def test_unset_fields_take_the_checkpoint_s_defaults_and_set_ones_win():
    qwen3 = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05)
    unset = _sampling(defaults=qwen3)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p) == (0.6, 0.95, 20, 0.05)
    # Set to OpenAI's own values, even off: the client's, not the checkpoint's.
    given = _sampling(defaults=qwen3, temperature=1, top_p=1, top_k=-1, min_p=0)
    assert (given.temperature, given.top_p, given.top_k, given.min_p) == (1.0, 1.0, 0, 0.0)
    some = _sampling(defaults=SamplingDefaults(top_k=1), temperature=0.3)  # null is unset
    assert (some.temperature, some.top_p, some.top_k, some.min_p) == (0.3, 1.0, 1, 0.0)
    none = _sampling(defaults=SamplingDefaults())  # --sampling-defaults none: OpenAI's
    assert (none.temperature, none.top_p, none.top_k, none.min_p) == (1.0, 1.0, 0, 0.0)
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], top_p=None)
    resolved = sampling_of(chat, prompt_len=3, context_len=CTX, vocab_size=VOCAB, default_max_tokens=None,
                           defaults=qwen3)
    assert (resolved.temperature, resolved.top_p, resolved.top_k) == (0.6, 0.95, 20)
    assert SamplingParams(**resolved.params()).min_p == 0.05  # what the engine is given


def test_penalties_map_to_the_engine_s_fields():
    s = _sampling(presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.2)
    assert (s.params()["presence_penalty"], s.params()["frequency_penalty"]) == (-2.0, 1.5)
    assert SamplingParams(**s.params()).repetition_penalty == 1.2
    assert _sampling(presence_penalty=None).params()["presence_penalty"] == 0.0  # null: off
    # repetition_penalty unset or null: the checkpoint's, else 1 (off); set, even to 1: the client's.
    ckpt = SamplingDefaults(repetition_penalty=1.05)
    assert _sampling(repetition_penalty=None, defaults=ckpt).repetition_penalty == 1.05
    assert _sampling(repetition_penalty=1, defaults=ckpt).repetition_penalty == 1.0
    assert _sampling().repetition_penalty == 1.0


def test_logit_bias_resolves_to_the_engine_s_pairs():
    def bias(value):
        return logit_bias_of(CompletionRequest(model="m", prompt="x", logit_bias=value), VOCAB)

    assert bias(None) == bias({}) == ()
    assert bias({"383": 100, "0": -2.5, "7": 0}) == ((383, 100.0), (0, -2.5), (7, 0.0))
    assert _sampling(logit_bias={"5": 1}).logit_bias == ()  # resolved once per request (app.py)
    _refused("logit_bias", r"logit_bias\['5'\] must be a number in \[-100, 100\], got nan", bias,
             {"5": math.nan})
    _refused("logit_bias", r"got True", bias, {"5": True})
    _refused("logit_bias", r"keys must be token ids .*got ' 5'", bias, {" 5": 1})


def test_chat_max_completion_tokens_is_named_as_sent():
    chat = ChatRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=100
    )
    _refused(
        "max_completion_tokens",
        "must be <= 54",
        sampling_of,
        chat,
        prompt_len=10,
        context_len=CTX,
        vocab_size=VOCAB,
        default_max_tokens=None,
    )


def test_prompt_ids_checked_against_vocab_and_context():
    check_prompt_ids([0, 383], vocab_size=VOCAB, context_len=CTX, param="prompt")
    _refused(
        "prompt",
        r"prompt\[1\] must be a token id in \[0, 384\).*got 999",
        check_prompt_ids,
        [5, 999],
        vocab_size=VOCAB,
        context_len=CTX,
        param="prompt",
    )
    err = _refused(
        "messages",
        "the prompt has 64 tokens; the context length is 64",
        check_prompt_ids,
        [1] * CTX,
        vocab_size=VOCAB,
        context_len=CTX,
        param="messages",
    )
    assert err.code == "context_length_exceeded"


def _prompts(prompt, **kw):
    return prompts_of(CompletionRequest(model="m", prompt=prompt, **kw))


def test_prompt_forms_one_or_a_batch():
    assert _prompts("hi") == ["hi"] and _prompts(["hi"]) == ["hi"]
    assert _prompts([1, 2]) == [[1, 2]] and _prompts([[1, 2]]) == [[1, 2]]
    assert _prompts(["a", "b"], n=2) == ["a", "b"]
    assert _prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert len(_prompts([[1]] * (MAX_CHOICES // 16), n=16)) == MAX_CHOICES // 16
    for prompt, match in [
        ("", "prompt must not be empty"),
        ([], r"at least one prompt .*got \[\]"),
        (["a", ""], r"prompt\[1\] must not be empty"),
        ([[1], []], r"prompt\[1\] must not be empty"),
        (["a", [1]], r"not a mix: prompt\[0\] is a text, prompt\[1\] is a list"),
        ([[1], "a"], r"not a mix: prompt\[0\] is a list, prompt\[1\] is a text"),
        (["a", 1], r"prompt\[1\] is a token id"),
        ([1, "a"], r"prompt\[1\] must be a token id \(an int\), got 'a'"),
        ([[1, 2], [3, None]], r"prompt\[1\]\[1\] must be a token id"),
        ([None], r"prompt\[0\] is null"),
    ]:
        _refused("prompt", match, _prompts, prompt)
    # prompts x n past the limit names n when n > 1, else prompt; n's own range is sampling_of's.
    k = MAX_CHOICES // 16 + 1
    _refused("n", rf"prompts x n\) must be <= {MAX_CHOICES}, got {k} prompts x n 16 = {k * 16}",
             _prompts, [[1]] * k, n=16)
    _refused("prompt", rf"got {MAX_CHOICES + 1} prompts x n 1", _prompts,
             ["a"] * (MAX_CHOICES + 1))
    assert len(_prompts([[1]] * k, n=17)) == k


def test_chat_messages():
    req = ChatRequest(
        model="m",
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    )
    assert messages_of(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    img = ChatRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    _refused("messages[0].content", "only text parts.*image_url", messages_of, img)
    _refused("messages", "at least one", messages_of, ChatRequest(model="m", messages=[]))


def test_choice_seeds_follow_the_request_seed_or_draw_their_own():
    from launch.server.choices import choice_seeds

    assert choice_seeds(7, 3, seeded=True) == [7, 8, 9]
    assert choice_seeds(2**64 - 1, 2, seeded=True) == [2**64 - 1, 0]  # stays a valid seed
    drawn = choice_seeds(7, 4, seeded=False)
    assert drawn[0] == 7 and len(drawn) == 4 and all(0 <= s < 2**64 for s in drawn)


@pytest.mark.parametrize("fields, param, match", [
    (dict(response_format={"type": "json_object"}), "response_format", "not supported"),
    (dict(functions=[{"name": "f"}]), "functions", "not supported .*deprecated.*use tools"),
    (dict(function_call="auto"), "function_call", "deprecated.*use tool_choice"),
])
def test_chat_structured_output_and_deprecated_functions_are_refused_by_name(fields, param, match):
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    _refused(param, match, sampling_of, chat, prompt_len=10, context_len=CTX, vocab_size=VOCAB,
             default_max_tokens=None)


def test_chat_text_format_and_no_tools_are_accepted():
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                       response_format={"type": "text"}, tools=[], tool_choice="none")
    assert sampling_of(chat, prompt_len=10, context_len=CTX, vocab_size=VOCAB, default_max_tokens=None).top_p == 1.0
