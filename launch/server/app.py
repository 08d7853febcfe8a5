"""The FastAPI app of ``dp-runtime serve``: OpenAI routes over a started Engine.

``create_app(engine, tokenizer=..., api_key=...)`` builds the app around an engine that is
already running (``launch/cli_serve.py`` starts it, and shuts it down when uvicorn's lifespan
ends). Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (200 only while ``engine.health().ok``, else 503), ``GET /metrics``.

With an API key every route but /health needs ``Authorization: Bearer <key>`` (401 otherwise,
compared in constant time). Errors are OpenAI's error object (``protocol.ApiError``); a body
that does not parse, or a field of the wrong type, is 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from launch.server.logprobs import ChoiceLogprobs, logprobs_of
from launch.server.metrics import CONTENT_TYPE, ServerMetrics
from launch.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Kind,
    check_prompt_ids,
    chunk,
    error_body,
    messages_of,
    now,
    prompt_of,
    response,
    sampling_of,
    usage,
)
from launch.server.request_flow import Event, Flow, submit
from launch.server.text import TokenizerMissing, encode_chat, encode_text

__all__ = ["ServerState", "create_app"]

_COMPLETION_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat's is the rest of the context
)


@dataclass
class ServerState:
    """What the routes share: the engine, the tokenizer (None: token ids only), the metrics,
    the API key, and the background tasks that record aborted requests."""

    engine: Any
    tokenizer: Any | None
    metrics: ServerMetrics
    api_key: str | None = None
    tasks: set = field(default_factory=set)


def create_app(
    engine: Any, *, tokenizer: Any | None = None, api_key: str | None = None, lifespan: Any = None
) -> FastAPI:
    """The app serving ``engine``; ``lifespan`` (an async context manager factory) runs around
    it (the CLI's drains and stops the engine on shutdown)."""
    state = ServerState(engine, tokenizer, ServerMetrics(engine), api_key or None)
    app = FastAPI(
        title="dp-runtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = state

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, exc.kind, exc.param, exc.code),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if state.api_key is not None and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), state.api_key.encode()
            ):
                return _error_response(
                    ApiError(
                        401,
                        "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        kind="authentication_error",
                        code="invalid_api_key",
                    )
                )
        return await call_next(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        h = engine.health()
        return JSONResponse(
            {"status": "ok" if h.ok else h.state, "state": h.state, "detail": h.detail},
            status_code=200 if h.ok else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "dp-runtime",
                    "max_model_len": engine.context_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(engine, body.model)
        prompt = prompt_of(body)
        if isinstance(prompt, str):
            ids = _encode(lambda: encode_text(tokenizer, engine.model_name, prompt), "prompt")
        else:
            ids = list(prompt)
        return await _serve(
            state, request, "completion", body, ids, "prompt", _COMPLETION_MAX_TOKENS
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(engine, body.model)
        messages = messages_of(body)
        ids = _encode(lambda: encode_chat(tokenizer, engine.model_name, messages), "messages")
        return await _serve(state, request, "chat", body, ids, "messages", None)

    return app


def _check_model(engine: Any, name: str) -> None:
    if name != engine.model_name:
        raise ApiError(
            400,
            f"model must be {engine.model_name!r} (the model this server serves), got {name!r}",
            param="model",
            code="model_not_found",
        )


def _encode(fn, param: str) -> list[int]:
    try:
        return fn()
    except TokenizerMissing as e:
        raise ApiError(400, str(e), param=param, code="no_tokenizer") from e
    except ValueError as e:  # no chat template, or a template that refuses the messages
        raise ApiError(400, str(e), param=param, code="invalid_value") from e


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(err.message, err.kind, err.param, err.code),
        status_code=err.status,
        headers=err.headers,
    )


def _validation_error(exc: RequestValidationError) -> ApiError:
    """Pydantic's first complaint as a 400 naming the field (``messages[0].role``)."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if e.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {e.get('msg')}", code="invalid_json")
    given = f", got {e['input']!r}" if "input" in e and e.get("type") != "missing" else ""
    return ApiError(
        400, f"{param or 'body'}: {e.get('msg')}{given}", param=param, code=e.get("type")
    )


async def _serve(
    state: ServerState,
    request: Request,
    kind: Kind,
    body: Any,
    ids: list[int],
    param: str,
    default_max_tokens: int | None,
):
    engine = state.engine
    check_prompt_ids(ids, vocab_size=engine.vocab_size, context_len=engine.context_len, param=param)
    sampling = sampling_of(
        body,
        prompt_len=len(ids),
        context_len=engine.context_len,
        vocab_size=engine.vocab_size,
        default_max_tokens=default_max_tokens,
    )
    sampling = replace(sampling, logprobs=logprobs_of(body))
    lp = None if sampling.logprobs is None else ChoiceLogprobs(kind, state.tokenizer)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    flow = submit(state, rid, ids, sampling)
    created = now()
    if sampling.stream:
        return await _stream(flow, request, kind, body.model, created, sampling.include_usage, lp)
    try:
        parts, token_ids, last = await _until_done(flow, request)
    finally:
        flow.close()
    if last is None:  # the client went away; nobody reads this response
        return Response(status_code=499)
    _raise_for_failure(last)
    out = response(
        kind,
        rid,
        body.model,
        created,
        "".join(parts),
        last.finish_reason,
        usage(flow.prompt_len, flow.completion_tokens),
    )
    # The ids too: a model without a tokenizer has no text.
    out["choices"][0]["token_ids"] = token_ids
    if lp is not None:
        out["choices"][0]["logprobs"] = lp.next(token_ids, flow.logprobs)
    return JSONResponse(out)


def _raise_for_failure(last: Event) -> None:
    # Its rank failed under it: the gang restarts or is gone; the client may retry.
    if last.retryable:
        reason = getattr(last.result, "error", None) or "a rank failed"
        raise ApiError(
            503,
            f"the engine lost the request's rank ({reason}); retry",
            kind="service_unavailable",
            code="engine_unavailable",
        )
    if last.finish_reason == "error":
        reason = getattr(last.result, "error", None) or "the request failed on its rank"
        raise ApiError(500, f"request failed: {reason}", kind="server_error", code="request_failed")
    if last.finish_reason == "abort":  # aborted by the engine itself (shutdown or restart)
        raise ApiError(
            503,
            "the request was aborted by the engine (shutting down or restarting)",
            kind="service_unavailable",
            code="engine_unavailable",
        )


async def _until_done(flow: Flow, request: Request) -> tuple[list[str], list[int], Event | None]:
    """Every event of a non-streamed request, or (…, None) when the client disconnects first."""
    parts: list[str] = []
    token_ids: list[int] = []
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        events = flow.events()
        while True:
            step = asyncio.ensure_future(anext(events))
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                return parts, token_ids, None
            ev = step.result()
            parts.append(ev.text)
            token_ids.extend(ev.token_ids)
            if ev.finish_reason is not None:
                return parts, token_ids, ev
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is already read, so the next
    ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(
    flow: Flow,
    request: Request,
    kind: Kind,
    model: str,
    created: int,
    include_usage: bool,
    lp: ChoiceLogprobs | None = None,
) -> Response:
    """Server-sent events. The first event is awaited before the response starts, so a request
    that fails at once still gets its HTTP status (500/503) instead of a broken stream; a client
    that leaves while its request is still queued aborts it."""
    events = flow.events()
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        step = asyncio.ensure_future(anext(events))
        await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not step.done():
            step.cancel()
            flow.close()
            return Response(status_code=499)
        first = step.result()
    except BaseException:
        flow.close()
        raise
    finally:
        gone.cancel()
    if first.finish_reason in ("error", "abort") or first.retryable:
        flow.close()
        _raise_for_failure(first)

    async def sse() -> AsyncIterator[str]:
        try:
            if kind == "chat":  # OpenAI's first chat chunk carries the role alone
                yield _sse(chunk(kind, flow.rid, model, created, "", None, first=True))
            ev: Event | None = first
            while ev is not None:
                if ev.finish_reason in ("error", "abort"):
                    yield _sse(
                        error_body(
                            f"request {ev.finish_reason}: "
                            f"{getattr(ev.result, 'error', None) or ev.finish_reason}",
                            "server_error",
                            None,
                            "request_failed",
                        )
                    )
                    break
                # A step with ids but no text yet (held back, or no tokenizer) is still sent:
                # token-id clients read the ids as they are sampled.
                if ev.text or ev.token_ids or ev.finish_reason is not None:
                    body = chunk(kind, flow.rid, model, created, ev.text, ev.finish_reason)
                    body["choices"][0]["token_ids"] = list(ev.token_ids)
                    if lp is not None:  # the entries of the ids this chunk carries
                        body["choices"][0]["logprobs"] = lp.next(ev.token_ids, ev.logprobs)
                    yield _sse(body)
                if ev.finish_reason is not None:
                    break
                ev = await anext(events, None)
            if include_usage:
                yield _sse(
                    chunk(
                        kind,
                        flow.rid,
                        model,
                        created,
                        None,
                        None,
                        use=usage(flow.prompt_len, flow.completion_tokens),
                    )
                )
            yield "data: [DONE]\n\n"
        finally:
            # Runs on completion and when the client closes the stream (the task is cancelled).
            flow.close()
            with contextlib.suppress(Exception):
                await events.aclose()

    return StreamingResponse(
        sse(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
