"""Tool calls end to end: a real ``dp-runtime serve`` process (local launcher) on a checkpoint
whose greedy output is a hermes tool call (tests/support/tool_model.py), driven by the official
``openai`` client: the call parsed from the whole and the streamed output, ``tool_choice:
"none"`` giving the raw text, the tools and the tool turns rendered as transformers'
``apply_chat_template`` renders them (the prompt token counts), bad fields 400 naming them."""

from __future__ import annotations

import json

import openai
import pytest

from tests.hf_reference import greedy_reference, load_reference
from tests.support.serve_process import IDS, ServeProcess
from tests.support.tool_model import CALL_TEXT, PIECES, write_tool_checkpoint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint dir, transformers model, tokenizer)."""
    from transformers import AutoTokenizer

    path = write_tool_checkpoint(tmp_path_factory.mktemp("tool_ckpt"))
    return path, load_reference(path), AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    args = (
        "--model",
        str(ckpt[0]),
        "--launcher",
        "local",
        "--context-len",
        "256",
        "--max-running-requests",
        "2",
        "--sampling-defaults",
        "none",
    )
    with ServeProcess(tmp_path_factory.mktemp("logs"), *args) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _prompt(ckpt, messages, tools=None) -> list[int]:
    """Transformers' rendering of ``messages`` with ``tools``, as token ids."""
    tok = ckpt[2]
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False).input_ids


def _create(client, ckpt, messages=ASK, **kw):
    return client.chat.completions.create(
        model=ckpt[0].name, messages=messages, temperature=0, max_tokens=16, **kw
    )


def _is_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_the_model_s_tool_call_is_parsed(ckpt, client):
    ids = _prompt(ckpt, ASK, [WEATHER])
    ref, _ = greedy_reference(ckpt[1], ids, 16)
    assert ckpt[2].decode(ref[:-1]) == CALL_TEXT  # the chain ends on EOS
    r = _create(client, ckpt, tools=[WEATHER], logprobs=True, extra_body=IDS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _is_weather_call(choice.message.tool_calls[0])
    assert choice.model_extra["token_ids"] == ref
    assert len(choice.logprobs.content) == len(ref)  # logprobs stay per token
    assert r.usage.prompt_tokens == len(ids)
    assert len(ids) > len(_prompt(ckpt, ASK))  # the tools are in the prompt


def test_streaming_gives_the_same_call(ckpt, client):
    chunks = list(_create(client, ckpt, tools=[WEATHER], stream=True, extra_body=IDS))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)  # no part of the block is sent as content
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0
    _is_weather_call(calls[0])
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1])
    # The role chunk carries no ids; the step's ids ride on its first chunk.
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", ())]
    assert len(ids) == len(PIECES) + 1


def test_each_of_n_choices_parses_its_own_call(ckpt, client):
    r = _create(client, ckpt, tools=[WEATHER], n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _is_weather_call(choice.message.tool_calls[0])
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id
    chunks = list(_create(client, ckpt, tools=[WEATHER], n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        calls = [t for c in mine for t in c.delta.tool_calls or ()]
        assert len(calls) == 1 and mine[-1].finish_reason == "tool_calls"
        _is_weather_call(calls[0])


def test_tool_choice_none_is_plain_text_without_the_tools(ckpt, client):
    r = _create(client, ckpt, tools=[WEATHER], tool_choice="none")
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == CALL_TEXT
    assert r.usage.prompt_tokens == len(_prompt(ckpt, ASK))  # rendered without the tools
    text = "".join(
        c.choices[0].delta.content or ""
        for c in _create(client, ckpt, tools=[WEATHER], tool_choice="none", stream=True)
        if c.choices
    )
    assert text == CALL_TEXT


def test_a_follow_up_with_the_call_and_the_tool_s_answer_renders(ckpt, client):
    r = _create(client, ckpt, tools=[WEATHER])
    call = r.choices[0].message.tool_calls[0]
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    # Transformers is given the arguments as an object, as Qwen's templates want them.
    as_template = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        follow[2],
    ]
    again = _create(client, ckpt, messages=follow, tools=[WEATHER])
    assert again.usage.prompt_tokens == len(_prompt(ckpt, as_template, [WEATHER]))
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + len(PIECES)
    _is_weather_call(again.choices[0].message.tool_calls[0])  # the chain again


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(tools=[WEATHER], tool_choice="required"), "tool_choice"),
        (
            dict(tools=[WEATHER, {"type": "function", "function": {"name": "bad name"}}]),
            "tools[1].function.name",
        ),
        (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
        (dict(functions=[WEATHER["function"]]), "functions"),
        (dict(messages=[*ASK, {"role": "tool", "content": "x"}]), "messages[1].tool_call_id"),
    ],
)
def test_bad_fields_are_400_naming_them(ckpt, client, fields, param):
    kw = {"messages": ASK, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=ckpt[0].name, max_tokens=4, **kw)
    assert info.value.status_code == 400 and info.value.body["param"] == param
