"""The HTTP response to a request's choices: one JSON body, or server-sent events.

Both read ``Choices`` (one or more engine requests) and close it when they end, which aborts
every choice the engine has not finished. The first choice to fail fails the whole request as a
single request would (500 when it failed in its step, 503 when its rank failed or the engine
aborted it) and its siblings are aborted; a client that leaves aborts them all.

Bodies: ``choices`` indexed 0..k x n - 1 for k prompts (``prompt_index * n + choice``; each
with its text or message, finish_reason, and ``token_ids`` where ``ResponseExtras.output_ids``
says: asked by ``return_token_ids``, or a server without a tokenizer); ``usage.prompt_tokens``
counts each prompt once, ``completion_tokens`` sums the choices. A stream interleaves the choices'
chunks as their tokens arrive, each chunk naming its choice's ``index``; each choice ends with its
own finish_reason chunk, then comes the usage chunk (with ``include_usage``) and one ``[DONE]``.

A chat request with tools (``tool_names``) has each choice's calls read from its text
(tool_calls.py): the whole message's ``tool_calls``, or in a stream one chunk per call as its
block closes; finish_reason ``tool_calls`` where the choice called one and ended on a stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from launch.server.bodies import Kind, chunk, response, usage
from launch.server.choices import Choices
from launch.server.logprobs import ChoiceLogprobs
from launch.server.protocol import ApiError, error_body
from launch.server.readiness import unavailable_error
from launch.server.request_flow import Event
from launch.server.tool_calls import ToolCallStream, parse_tool_calls
from launch.server.vllm_fields import ResponseExtras

__all__ = ["failure_error", "raise_for_failure", "stream_response", "whole_response"]


async def whole_response(
    choices: Choices,
    request: Request,
    kind: Kind,
    rid: str,
    model: str,
    created: int,
    lps: list[ChoiceLogprobs] | None = None,
    tool_names: frozenset[str] = frozenset(),
    extras: ResponseExtras | None = None,
) -> Response:
    """The non-streamed response, once every choice finished; 499 when the client left.
    ``lps``: each choice's logprobs object, when the request asked for logprobs;
    ``tool_names``: the functions whose calls are read from the text (none: plain text)."""
    n = len(choices.flows)
    parts: list[list[str]] = [[] for _ in range(n)]
    token_ids: list[list[int]] = [[] for _ in range(n)]
    last: list[Event | None] = [None] * n
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while not choices.finished:
            got = await _next_or_gone(choices, gone)
            if got is None:  # the client went away; nobody reads this response
                return Response(status_code=499)
            i, ev = got
            parts[i].append(ev.text)
            token_ids[i].extend(ev.token_ids)
            if ev.finish_reason is not None:
                raise_for_failure(ev)  # the finally below aborts the siblings
                last[i] = ev
    finally:
        gone.cancel()
        choices.close()
    use = usage(choices.prompt_tokens, choices.completion_tokens, choices.cached_tokens)
    bodies = [
        _body(kind, rid, model, created, "".join(parts[i]), ev.finish_reason, use, tool_names)
        for i, ev in enumerate(last)
    ]
    out = bodies[0]
    ids_out = extras is not None and extras.output_ids
    out["choices"] = [
        _choice(b["choices"][0], i, token_ids[i] if ids_out else None)
        for i, b in enumerate(bodies)
    ]
    for i, lp in enumerate(lps or ()):
        out["choices"][i]["logprobs"] = lp.next(token_ids[i], choices.flows[i].logprobs)
    if extras is not None:  # vLLM's response fields (vllm_fields.py)
        extras.whole(out)
    return JSONResponse(out)


def _body(kind: Kind, rid: str, model: str, created: int, text: str, reason: str, use: dict,
          tool_names: frozenset[str]) -> dict:
    """One choice's whole body; with ``tool_names`` its calls read from ``text``."""
    calls = None
    if tool_names:  # the calls in the text; the rest of it is the content
        text, calls = parse_tool_calls(text, tool_names)
        reason = "tool_calls" if calls and reason == "stop" else reason
    return response(kind, rid, model, created, text, reason, use, tool_calls=calls)


def _choice(body: dict, index: int, token_ids: list[int] | None) -> dict:
    body["index"] = index
    if token_ids is not None:
        body["token_ids"] = token_ids
    return body


def _failed(ev: Event) -> bool:
    return ev.finish_reason in ("error", "abort") or ev.retryable


def failure_error(last: Event) -> ApiError | None:
    """The HTTP error of a choice's last event, if it failed: 503 with Retry-After (its rank
    failed; the engine aborted it: a drain past ``--drain-timeout``, a restart), 500 (it failed
    in its step)."""
    # Its rank failed under it: the gang restarts or is gone; the client may retry.
    if last.retryable:
        reason = getattr(last.result, "error", None) or "a rank failed"
        return unavailable_error(f"the engine lost the request's rank ({reason}); retry")
    if last.finish_reason == "error":
        reason = getattr(last.result, "error", None) or "the request failed on its rank"
        return ApiError(500, f"request failed: {reason}", kind="server_error",
                        code="request_failed")
    if last.finish_reason == "abort":  # aborted by the engine itself (shutdown or restart)
        return unavailable_error(
            "the request was aborted by the engine (shutting down past the drain timeout, or "
            "restarting); retry"
        )
    return None


def raise_for_failure(last: Event) -> None:
    """Raise ``failure_error(last)`` if there is one."""
    err = failure_error(last)
    if err is not None:
        raise err


async def _next_or_gone(choices: Choices, gone: asyncio.Future) -> tuple[int, Event] | None:
    """The next event of any choice, or None when the client disconnects first."""
    step = asyncio.ensure_future(choices.next())
    await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not step.done():
        step.cancel()
        return None
    return step.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is already read, so the next
    ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream_response(
    choices: Choices,
    request: Request,
    kind: Kind,
    rid: str,
    model: str,
    created: int,
    include_usage: bool,
    lps: list[ChoiceLogprobs] | None = None,
    tool_names: frozenset[str] = frozenset(),
    extras: ResponseExtras | None = None,
) -> Response:
    """Server-sent events. The first event (of any choice) is awaited before the response
    starts, so a request that fails at once still gets its HTTP status (500/503) instead of a
    broken stream; a client that leaves while its request is still queued aborts it. A choice
    failing later is one error event, its siblings aborted, then the stream ends. With
    ``tool_names`` each choice's text goes through its own ``ToolCallStream``."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        first = await _next_or_gone(choices, gone)
    except BaseException:
        choices.close()
        raise
    finally:
        gone.cancel()
    if first is None:
        choices.close()
        return Response(status_code=499)
    if _failed(first[1]):
        choices.close()
        raise_for_failure(first[1])

    head = (kind, rid, model, created)
    ids_out = extras is not None and extras.output_ids
    calls = [ToolCallStream(tool_names) for _ in choices.flows] if tool_names else None

    def _sse(body: dict) -> str:  # every chunk gets vLLM's fields a request asked for
        if extras is not None:
            extras.chunk(body, lambda: usage(choices.prompt_tokens, choices.completion_tokens,
                                             choices.cached_tokens))
        return _event(body)

    async def sse() -> AsyncIterator[str]:
        try:
            if kind == "chat":  # OpenAI's first chat chunk of a choice carries the role alone
                for i in range(len(choices.flows)):
                    yield _sse(_indexed(chunk(kind, rid, model, created, "", None, first=True), i))
            got: tuple[int, Event] | None = first
            while got is not None:
                i, ev = got
                if _failed(ev):
                    choices.close()  # its siblings give their KV back now
                    err = failure_error(ev)
                    yield _sse(error_body(err.message, err.kind, err.param, err.code))
                    break
                # A step with ids but no text yet (held back, or no tokenizer) is still sent:
                # token-id clients read the ids (and logprobs) as they are sampled.
                if calls is not None:
                    bodies = _tool_chunks(calls[i], ev, head)
                elif ev.text or ev.token_ids or ev.finish_reason is not None:
                    bodies = [chunk(*head, ev.text, ev.finish_reason)]
                else:
                    bodies = []
                for k, body in enumerate(bodies):  # the step's ids on its first chunk
                    _indexed(body, i)
                    if ids_out:
                        body["choices"][0]["token_ids"] = list(ev.token_ids) if k == 0 else []
                    if lps is not None and k == 0:  # the entries of the ids this chunk carries
                        body["choices"][0]["logprobs"] = lps[i].next(ev.token_ids, ev.logprobs)
                    yield _sse(body)
                got = None if choices.finished else await choices.next()
            if include_usage:
                use = usage(choices.prompt_tokens, choices.completion_tokens, choices.cached_tokens)
                yield _sse(chunk(kind, rid, model, created, None, None, use=use))
            yield "data: [DONE]\n\n"
        finally:
            # Runs on completion and when the client closes the stream (the task is cancelled).
            with contextlib.suppress(Exception):
                choices.close()

    return StreamingResponse(
        sse(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _tool_chunks(calls: ToolCallStream, ev: Event, head: tuple) -> list[dict]:
    """The chunks of one event of a choice whose calls are read: its content and each call its
    text completes, in order (none while a block is held and the step has no ids); the
    finish_reason on the last."""
    parts = calls.add(ev.text, finished=ev.finish_reason is not None)
    reason = "tool_calls" if ev.finish_reason == "stop" and calls.calls else ev.finish_reason
    if not parts and not ev.token_ids and reason is None:
        return []
    parts = parts or [""]
    return [
        chunk(*head, part, reason if k == len(parts) - 1 else None)
        if isinstance(part, str)
        else chunk(*head, "", reason if k == len(parts) - 1 else None, tool_calls=[part])
        for k, part in enumerate(parts)
    ]


def _indexed(body: dict, index: int) -> dict:
    body["choices"][0]["index"] = index
    return body


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
