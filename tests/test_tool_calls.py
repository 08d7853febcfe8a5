"""Tool calls at the server's door, without a server: the hermes parser of a whole output and
its streaming splitter (every split of the text into 2 or 3 deltas gives the whole text's
content and calls; a partial tag is never sent as content), and the request's checks (each bad
``tools`` / ``tool_choice`` / tool message field a 400 naming it with the value)."""

from __future__ import annotations

import itertools
import json

import pytest

from launch.server.chat_request import MAX_TOOLS, check_template, messages_of, tools_of
from launch.server.protocol import ApiError, ChatRequest
from launch.server.tool_calls import ToolCallStream, parse_tool_calls

NAMES = frozenset({"get_weather", "get_time"})


def block(name: str, arguments: dict | None = None, raw: str | None = None) -> str:
    body = raw if raw is not None else json.dumps({"name": name, "arguments": arguments or {}})
    return f"<tool_call>\n{body}\n</tool_call>"


def _strip_ids(calls):
    for c in calls:
        assert c["id"].startswith("call_") and len(c["id"]) > len("call_") + 8
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


def _fn(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_a_whole_output_with_one_call():
    content, calls = parse_tool_calls(block("get_weather", {"city": "Paris"}), NAMES)
    assert content == ""
    assert _strip_ids(calls) == [_fn("get_weather", {"city": "Paris"})]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_several_calls_and_text_around_them():
    text = (
        "Let me check.\n\n"
        + block("get_weather", {"city": "Paris"})
        + "\n"
        + block("get_time", {"tz": "CET", "n": [1, 2]})
        + "\n"
    )
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert _strip_ids(calls) == [
        _fn("get_weather", {"city": "Paris"}),
        _fn("get_time", {"tz": "CET", "n": [1, 2]}),
    ]
    assert calls[0]["id"] != calls[1]["id"]
    # No arguments: an empty object.
    _, calls = parse_tool_calls(block("get_time", raw='{"name": "get_time"}'), NAMES)
    assert calls[0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(
    "bad",
    [
        block("x", raw='{"name": "get_weather", "arguments": {"city": '),  # broken JSON
        block("x", raw='{"arguments": {"city": "Paris"}}'),  # no name
        block("get_stock", {"s": "X"}),  # a function the request did not offer
        block("x", raw='{"name": "get_weather", "arguments": [1]}'),  # arguments not an object
        block("x", raw='"get_weather"'),  # not an object
        "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {}}),  # never closed
    ],
)
def test_a_block_that_is_no_call_stays_content(bad):
    good = block("get_time", {"tz": "UTC"})
    content, calls = parse_tool_calls(f"a {bad} b {good}", NAMES)
    if bad.endswith("</tool_call>"):
        assert content == f"a {bad} b" and _strip_ids(calls) == [_fn("get_time", {"tz": "UTC"})]
    else:  # an open block swallows the rest: nothing after it is a call
        assert content == f"a {bad} b {good}" and calls == []


def test_no_blocks_is_the_text_stripped():
    assert parse_tool_calls("  plain answer <tool \n", NAMES) == ("plain answer <tool", [])


def _streamed(pieces, names=NAMES):
    stream, content, calls = ToolCallStream(names), [], []
    for k, piece in enumerate(pieces):
        for part in stream.add(piece, finished=k == len(pieces) - 1):
            (content if isinstance(part, str) else calls).append(part)
    for k, call in enumerate(calls):
        assert call.pop("index") == k
    assert stream.calls == len(calls)
    return "".join(content), calls, content


TEXTS = [
    block("get_weather", {"city": "Paris"}),
    " Sure!\n" + block("get_weather", {"city": "Paris"}) + "\n" + block("get_time", {}) + "\n",
    "a <tool_call>{broken</tool_call> b\n" + block("get_time", {"tz": "x"}) + " after  \n",
    "x <tool_ y" + block("get_stock", {}) + "<tool_call",
    "text only, no calls, < and <t",
    "<tool_call>" + json.dumps({"name": "get_time"}) + " unclosed",
]


@pytest.mark.parametrize("text", TEXTS)
def test_every_split_streams_the_whole_text_s_content_and_calls(text):
    want_content, want_calls = parse_tool_calls(text, NAMES)
    want_calls = _strip_ids(want_calls)
    splits = [[text]]
    splits += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits += [
        [text[:i], text[i:j], text[j:]] for i, j in itertools.combinations(range(len(text) + 1), 2)
    ]
    for pieces in splits:
        content, calls, _ = _streamed(pieces)
        assert content == want_content, pieces
        assert _strip_ids(calls) == want_calls, pieces


def test_a_partial_tag_is_held_back_and_text_before_it_streams():
    stream = ToolCallStream(NAMES)
    assert stream.add("Hi <tool_") == ["Hi"]  # the space waits for what follows it
    assert stream.add('call>\n{"name": "get_time", ') == []  # inside a block: held
    parts = stream.add('"arguments": {}}\n</tool_call> done')
    assert _strip_ids([parts[0]]) == [{"index": 0, **_fn("get_time", {})}]
    assert parts[1:] == ["  done"]  # the space held after "Hi", then this one
    stream = ToolCallStream(NAMES)
    assert stream.add("x <tool_") == ["x"]
    assert stream.add("box>") == [" <tool_box>"]  # not the tag after all: sent as it was
    assert ToolCallStream(NAMES).add("a <tool_", finished=True) == ["a <tool_"]


def _chat(**fields):
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatRequest(model="m", **fields)


def _tool(name="get_weather", **fn):
    return {"type": "function", "function": {"name": name, **fn}}


def test_tools_and_tool_choice_resolve():
    spec = _tool(description="Weather", parameters={"type": "object"}, strict=True)
    use = tools_of(_chat(tools=[spec, _tool("get_time")]))
    assert use.names == {"get_weather", "get_time"}
    assert use.specs[0] == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object"},
        },
    }
    assert tools_of(_chat(tools=[spec], tool_choice="auto")).names == {"get_weather"}
    for off in (
        _chat(tools=[spec], tool_choice="none"),
        _chat(),
        _chat(tools=[]),
        _chat(tools=[], tool_choice="none"),
    ):
        assert tools_of(off).specs is None and not tools_of(off).names
    # vLLM's rule: a tool_choice other than "none" needs tools, "auto" included (issue 45)
    for no_tools in (_chat(tool_choice="auto"), _chat(tools=[], tool_choice="auto")):
        _refused("tool_choice", "tool_choice 'auto' needs tools, and none are given", tools_of,
                 no_tools)
    assert len(tools_of(_chat(tools=[_tool(f"f{i}") for i in range(MAX_TOOLS)])).names) == 128


def _refused(param, match, fn, *args):
    with pytest.raises(ApiError, match=match) as info:
        fn(*args)
    assert info.value.status == 400 and info.value.param == param


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "fields, param, match",
    [
        (
            dict(tools=[_tool(), {"type": "code", "function": {"name": "f"}}]),
            "tools[1].type",
            "must be 'function', got 'code'",
        ),
        (dict(tools=["f"]), "tools[0]", "must be an object, got 'f'"),
        (dict(tools=[{"type": "function"}]), "tools[0].function", "must be an object, got None"),
        (
            dict(tools=[_tool(), _tool("a"), _tool("bad name")]),
            "tools[2].function.name",
            "1 to 64 of .*got 'bad name'",
        ),
        (dict(tools=[_tool("")]), "tools[0].function.name", "got ''"),
        (dict(tools=[_tool("x" * 65)]), "tools[0].function.name", "got 'x{65}'"),
        (
            dict(tools=[{"type": "function", "function": {"name": 3}}]),
            "tools[0].function.name",
            "got 3",
        ),
        (
            dict(tools=[_tool(), _tool("f"), _tool()]),
            "tools[2].function.name",
            "'get_weather' is given twice",
        ),
        (dict(tools=[_tool(description=5)]), "tools[0].function.description", "a string, got 5"),
        (
            dict(tools=[_tool(parameters="{}")]),
            "tools[0].function.parameters",
            "an object, got '{}'",
        ),
        (
            dict(tools=[_tool(f"f{i}") for i in range(MAX_TOOLS + 1)]),
            "tools",
            "at most 128 functions, got 129",
        ),
        (
            dict(tools=[_tool()], tool_choice="required"),
            "tool_choice",
            "'required' is not supported: .*constrained decoding",
        ),
        (
            dict(tools=[_tool()], tool_choice=NAMED),
            "tool_choice",
            "naming a function \\('get_weather'\\) is not supported: .*constrained decoding",
        ),
        (
            dict(tools=[_tool()], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "names function 'nope', which is not in tools \\(get_weather\\)",
        ),
        (
            dict(tools=[_tool()], tool_choice="sometimes"),
            "tool_choice",
            "must be 'none', 'auto', .*got 'sometimes'",
        ),
        (dict(tools=[_tool()], tool_choice={"type": "function"}), "tool_choice", "got \\{"),
        (dict(tool_choice="required"), "tool_choice", "needs tools, and none are given"),
    ],
)
def test_bad_tools_fields_are_named(fields, param, match):
    _refused(param, match, tools_of, _chat(**fields))


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def test_tool_turns_reach_the_template_as_it_expects():
    req = _chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        ]
    )
    assert messages_of(req) == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
    ]


@pytest.mark.parametrize(
    "message, param, match",
    [
        ({"role": "tool", "content": "sunny"}, "messages[1].tool_call_id", "required in a tool"),
        (
            {
                "role": "assistant",
                "tool_calls": [CALL, {**CALL, "function": {"name": "f", "arguments": "{not json"}}],
            },
            "messages[1].tool_calls[1].function.arguments",
            "must be a JSON object, got '\\{not json'",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
            },
            "messages[1].tool_calls[0].function.arguments",
            "got \\[1\\]",
        ),
        (
            {"role": "user", "content": "x", "tool_calls": [CALL]},
            "messages[1].tool_calls",
            "only an assistant message has tool calls, got role 'user'",
        ),
    ],
)
def test_bad_tool_turns_are_named(message, param, match):
    req = _chat(messages=[{"role": "user", "content": "weather?"}, message])
    _refused(param, match, messages_of, req)


def test_a_template_that_does_not_render_tools_is_refused_by_name():
    from tests.support.serve_model import train_tokenizer

    tok = train_tokenizer()  # its template never reads `tools`
    _refused("tools", "chat template does not render tools", check_template, tok, "m")
    tok.chat_template = "{% for t in tools or [] %}{{ t }}{% endfor %}" + tok.chat_template
    check_template(tok, "m")
    check_template(None, "m")  # no tokenizer: the encoder's own 400 (no_tokenizer) says why
