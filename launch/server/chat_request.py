"""A chat request as its chat template takes it: the messages (text content parts joined; an
assistant's tool calls, a tool's answers) and the tools, ``tools`` and ``tool_choice`` checked
(the output side is ``tool_calls.py``).

``tools`` is OpenAI's list of ``{"type": "function", "function": {"name", "description",
"parameters"}}``: each type "function", each name 1 to 64 of ``a-zA-Z0-9_-`` and unique, at
most 128 tools (OpenAI's limits); any other entry is a 400 naming it (``tools[2].function.name``)
with the value. ``tool_choice`` is "auto" (the default with tools: the model may call one),
or "none" (the prompt is rendered without the tools and the output is plain content).
"required" and a named function would have the model call one: that needs decoding constrained
to the call's format, which this server lacks, so they are refused rather than left to a model
that may ignore them. ``functions`` and ``function_call`` (OpenAI's deprecated forms) are
refused in ``protocol._refuse_unsupported``, naming tools/tool_choice.

Messages: an assistant turn's ``tool_calls`` reach the template with ``function.arguments``
parsed from its JSON string into an object (Qwen's templates write it with ``tojson``; vLLM
does the same), and a ``tool`` turn keeps its ``tool_call_id``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from launch.server.protocol import ChatMessage, ChatRequest, bad

__all__ = ["MAX_TOOLS", "ToolUse", "check_template", "messages_of", "tools_of"]

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOOLS_VARIABLE = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools change: ``specs`` the function specs rendered into the
    prompt (None: none), ``names`` the functions whose calls are read from the output (empty:
    the output is plain content)."""

    specs: list[dict] | None = None
    names: frozenset[str] = frozenset()


def tools_of(req: ChatRequest) -> ToolUse:
    """``req``'s checked tools and tool_choice. Raises ApiError (400) naming the field."""
    specs = [_spec(i, t) for i, t in enumerate(req.tools or ())]
    if len(specs) > MAX_TOOLS:
        raise bad("tools", f"tools must hold at most {MAX_TOOLS} functions, got {len(specs)}")
    names = [s["function"]["name"] for s in specs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad(
                f"tools[{i}].function.name",
                f"tools[{i}].function.name {name!r} is given twice; names must be unique",
            )
    choice = "auto" if req.tool_choice is None else req.tool_choice
    if choice == "none" or not specs:  # no tool_choice and no tools is plain chat
        if choice != "none" and req.tool_choice is not None:  # vLLM's rule: "auto" too
            raise bad("tool_choice", f"tool_choice {choice!r} needs tools, and none are given")
        return ToolUse()
    if choice == "auto":
        return ToolUse(specs, frozenset(names))
    if choice == "required":
        raise bad(
            "tool_choice",
            "tool_choice 'required' is not supported: forcing a call needs "
            "constrained decoding, which this server lacks; use 'auto'",
        )
    fn = choice.get("function") if isinstance(choice, dict) else None
    named = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(named, str) or choice.get("type") != "function":
        raise bad(
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
            f"{choice!r:.200}",
        )
    if named not in names:
        raise bad(
            "tool_choice",
            f"tool_choice names function {named!r}, which is not in tools ({', '.join(names)})",
        )
    raise bad(
        "tool_choice",
        f"tool_choice naming a function ({named!r}) is not supported: "
        "forcing a call needs constrained decoding, which this server "
        "lacks; use 'auto'",
    )


def _spec(i: int, tool: Any) -> dict:
    """Tool ``i`` as the template takes it: {"type": "function", "function": {...}}."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad(where, f"{where} must be an object, got {tool!r:.200}")
    if tool.get("type") != "function":
        raise bad(f"{where}.type", f"{where}.type must be 'function', got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function", f"{where}.function must be an object, got {fn!r:.200}")
    name = fn.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise bad(
            f"{where}.function.name",
            f"{where}.function.name must be 1 to 64 of "
            f"a-z, A-Z, 0-9, '_' and '-', got {name!r:.200}",
        )
    for key, kind in (("description", str), ("parameters", dict)):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise bad(
                f"{where}.function.{key}",
                f"{where}.function.{key} must be "
                f"{'a string' if kind is str else 'an object'}"
                f", got {fn[key]!r:.200}",
            )
    # Only the keys the template is documented to read: a client's extras stay out of the prompt.
    kept = {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}
    return {"type": "function", "function": kept}


def messages_of(req: ChatRequest) -> list[dict[str, Any]]:
    """The chat messages as the template takes them (content parts joined; only text parts;
    null content is empty). Raises ApiError (400) naming the message's field."""
    if not req.messages:
        raise bad("messages", "messages must hold at least one message")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            kinds = sorted({part.type for part in content if part.type != "text"})
            if kinds:
                raise bad(
                    f"messages[{i}].content",
                    f"messages[{i}].content: only text parts are supported, got {', '.join(kinds)}",
                )
            content = "".join(part.text or "" for part in content)
        out.append(_message(i, m, content or ""))
    return out


def _message(i: int, m: ChatMessage, content: str) -> dict:
    """Message ``i`` as the template takes it: role and content, plus an assistant's
    ``tool_calls`` (arguments as objects) or a tool turn's ``tool_call_id``."""
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        if m.role != "assistant":
            raise bad(
                f"messages[{i}].tool_calls",
                f"messages[{i}].tool_calls: only an assistant message has tool calls, "
                f"got role {m.role!r}",
            )
        out["tool_calls"] = [_call(i, j, c) for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        if not m.tool_call_id:
            raise bad(
                f"messages[{i}].tool_call_id",
                f"messages[{i}].tool_call_id is required in a tool message (the id of the "
                f"call it answers)",
            )
        out["tool_call_id"] = m.tool_call_id
        if m.name is not None:  # the function that answered (templates may print it)
            out["name"] = m.name
    return out


def _call(i: int, j: int, call: Any) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise bad(
                f"{where}.function.arguments",
                f"{where}.function.arguments must be a JSON object, got {args!r:.200} ({e})",
            ) from e
    if not isinstance(args, dict):
        raise bad(
            f"{where}.function.arguments",
            f"{where}.function.arguments must be a JSON object, got {args!r:.200}",
        )
    fn = {"name": call.function.name, "arguments": args}
    return {"id": call.id, "type": "function", "function": fn}


def check_template(tokenizer: Any | None, model_name: str) -> None:
    """A request with tools needs a chat template that renders them: one that never reads
    ``tools`` would drop them from the prompt without a word (400 naming ``tools``). Without a
    tokenizer or template, the encoder's own error names the cause."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return
    try:  # the template transformers picks when tools are given (a "tool_use" one, if named)
        source = tokenizer.get_chat_template(tools=[{}])
    except (ValueError, TypeError):
        source = ""
    if not _TOOLS_VARIABLE.search(source or ""):
        raise bad(
            "tools",
            f"model {model_name!r}: the model's chat template does not render "
            "tools (it never reads the 'tools' variable)",
        )
