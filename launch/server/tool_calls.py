"""Tool calls in a chat model's output, in the hermes format (Qwen's, and vLLM's
``--tool-call-parser hermes``): each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``parse_tool_calls(text, names)`` reads a whole output; ``ToolCallStream`` reads it as it grows
and gives the same content and calls whatever the steps' boundaries (tests/test_tool_calls.py
feeds it every split).

A block is a call when its body is a JSON object with a ``name`` that is one of the request's
tools and ``arguments`` that is an object (absent: ``{}``). Any other block (JSON that does not
parse, no name, a function the request did not offer, a block never closed) stays in the content
as the model wrote it: a model's malformed call is its text, never an error (vLLM's rule). The
content is the text outside the calls with its surrounding whitespace removed (the model writes
newlines between blocks): the stream holds back whitespace until text follows it, so its deltas
join to the same content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection

__all__ = ["CLOSE", "OPEN", "ToolCallStream", "parse_tool_calls"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), re.DOTALL)


def _call(body: str, names: Collection[str]) -> dict | None:
    """The OpenAI tool call a block's body holds, or None when it is no call of ``names``."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return {
        # Random ids, as OpenAI's: a client matches a tool's answer to its call by this id.
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse_tool_calls(text: str, names: Collection[str]) -> tuple[str, list[dict]]:
    """(content, calls) of a whole output: the text outside the call blocks, stripped, and the
    calls in order (OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``,
    arguments a JSON string)."""
    content, calls, at = [], [], 0
    for block in _BLOCK.finditer(text):
        call = _call(block.group(1), names)
        if call is None:  # not a call: stays content, as written
            continue
        content.append(text[at : block.start()])
        calls.append(call)
        at = block.end()
    content.append(text[at:])
    return "".join(content).strip(), calls


class ToolCallStream:
    """The content and calls of one choice's output, fed its text deltas in order.

    Text before a block's opening tag is sent as content; from the tag on it is held until the
    block closes (then it is one call, or content when it is none). A tail that may be the start
    of the tag (``<tool_``) is held too, so a tag is never half sent as content. ``calls``
    counts the calls given so far; each streamed call carries its ``index`` among them."""

    def __init__(self, names: Collection[str]):
        self._names = frozenset(names)
        self._buf = ""  # text not yet sent: a block being written, or a possible tag's start
        self._in_block = False
        self._started = False  # content sent already (leading whitespace is dropped before)
        self._space = ""  # whitespace after the content sent, held until text follows it
        self.calls = 0

    def add(self, text: str, *, finished: bool = False) -> list[str | dict]:
        """What ``text`` (the next delta) completes, in order: content (str) and calls (dict).
        ``finished``: the output ended; the rest held (a block never closed, a tail that looked
        like a tag) is content, and the whitespace after the last content is dropped."""
        out: list[str | dict] = []
        self._buf += text
        while True:
            if self._in_block:
                end = self._buf.find(CLOSE)
                if end < 0:
                    break  # the block is still being written
                end += len(CLOSE)
                block, self._buf, self._in_block = self._buf[:end], self._buf[end:], False
                call = _call(block[len(OPEN) : -len(CLOSE)], self._names)
                if call is None:
                    _put(out, self._content(block))
                else:
                    out.append({"index": self.calls, **call})
                    self.calls += 1
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                _put(out, self._content(self._buf[:start]))
                self._buf, self._in_block = self._buf[start:], True
                continue
            keep = _tag_prefix(self._buf)
            _put(out, self._content(self._buf[: len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep :]
            break
        if finished:
            _put(out, self._content(self._buf))
            self._buf, self._in_block = "", False
        return out

    def _content(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
        if not text:
            return ""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        self._started = self._started or bool(body)
        return body


def _tag_prefix(text: str) -> int:
    """The length of the longest tail of ``text`` that the opening tag starts with."""
    for k in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


def _put(out: list[str | dict], content: str) -> None:
    """Append content, joined to content just before it (one chunk, not two)."""
    if not content:
        return
    if out and isinstance(out[-1], str):
        out[-1] += content
    else:
        out.append(content)
