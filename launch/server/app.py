"""The FastAPI app of ``dp-runtime serve``: OpenAI routes over a started Engine.

``create_app(engine, tokenizer=..., api_key=...)`` builds the app around an engine that is
already running (``launch/cli_serve.py`` starts it, and shuts it down when uvicorn's lifespan
ends). Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (200 only while ``engine.health().ok``, else 503), ``GET /metrics``, and vLLM's
``/tokenize``, ``/detokenize``, ``/version``, ``GET /v1/models/{id}`` (``vllm_routes.py``).

With an API key every route but /health needs ``Authorization: Bearer <key>`` (401 otherwise,
compared in constant time). While the engine is not ready every route but /health and /metrics
is 503 with Retry-After (``readiness.py``). Every error is OpenAI's error object
(``error_handlers.py``); a body that does not parse, or a field of the wrong type, is 400
naming the field.
"""

from __future__ import annotations

import contextlib
import secrets
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from launch.server.bodies import Kind, now
from launch.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from launch.server.chat_request import check_template, messages_of, tools_of
from launch.server.choices import submit_choices
from launch.server.error_handlers import error_response, install_error_handlers
from launch.server.logit_bias import logit_bias_of
from launch.server.logprobs import ChoiceLogprobs, logprobs_of
from launch.server.metrics import CONTENT_TYPE, ServerMetrics
from launch.server.prompt_encoder import PromptEncoder
from launch.server.prompts import prompt_params, prompts_of
from launch.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    check_prompt_ids,
    sampling_of,
)
from launch.server.readiness import ALWAYS_OPEN, unavailable
from launch.server.respond import stream_response, whole_response
from launch.server.text import TokenizerMissing
from launch.server.vllm_fields import ResponseExtras, refuse_unimplemented, truncate
from launch.server.vllm_routes import add_vllm_routes, model_card

__all__ = ["ServerState", "create_app"]

_COMPLETION_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat's is the rest of the context
)


@dataclass
class ServerState:
    """What the routes share: the engine, the tokenizer (None: token ids only) and the thread
    that encodes prompts with it, the metrics, the API key, and the background tasks that
    record aborted requests."""

    engine: Any
    tokenizer: Any | None
    encoder: PromptEncoder
    metrics: ServerMetrics
    api_key: str | None = None
    tasks: set = field(default_factory=set)


def create_app(
    engine: Any,
    *,
    tokenizer: Any | None = None,
    api_key: str | None = None,
    lifespan: Any = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The app serving ``engine`` (started or starting); ``lifespan`` (an async context
    manager factory) runs around it (the CLI's starts the engine, and drains and stops it on
    shutdown); the app's prompt encoder closes after it. A body over ``max_request_bytes`` is
    a 413 (``body_limit.py``)."""
    encoder = PromptEncoder(tokenizer, engine.model_name)
    state = ServerState(engine, tokenizer, encoder, ServerMetrics(engine), api_key or None)

    @contextlib.asynccontextmanager
    async def owned(app_):
        try:
            if lifespan is None:
                yield
            else:
                async with lifespan(app_):
                    yield
        finally:
            encoder.close()

    app = FastAPI(
        title="dp-runtime", lifespan=owned, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = state
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)

    install_error_handlers(app)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        # Not ready (starting, restarting, draining): 503 + Retry-After before anything else.
        if request.url.path not in ALWAYS_OPEN and (err := unavailable(engine)) is not None:
            return error_response(err)
        if state.api_key is not None and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), state.api_key.encode()
            ):
                return error_response(
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
        return {"object": "list", "data": [model_card(engine)]}

    add_vllm_routes(app, state)  # /tokenize, /detokenize, /version, /v1/models/{id}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(engine, body.model)
        prompts = prompts_of(body)
        params = prompt_params(len(prompts))
        ids = [
            await _encode(state.encoder.text(p), param) if isinstance(p, str) else p
            for p, param in zip(prompts, params, strict=True)
        ]
        return await _serve(
            state, request, "completion", body, ids, params, _COMPLETION_MAX_TOKENS
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(engine, body.model)
        messages, tools = messages_of(body), tools_of(body)
        if tools.specs is not None:
            check_template(state.tokenizer, engine.model_name)
        ids = await _encode(state.encoder.chat(messages, tools.specs), "messages")
        return await _serve(
            state, request, "chat", body, [ids], ["messages"], None, tools.names
        )

    return app


def _check_model(engine: Any, name: str) -> None:
    if name != engine.model_name:
        raise ApiError(
            400,
            f"model must be {engine.model_name!r} (the model this server serves), got {name!r}",
            param="model",
            code="model_not_found",
        )


async def _encode(encoding, param: str) -> list[int]:
    """The ids ``encoding`` (a ``PromptEncoder`` call) gives; its errors as 400s naming
    ``param``."""
    try:
        return await encoding
    except TokenizerMissing as e:
        raise ApiError(400, str(e), param=param, code="no_tokenizer") from e
    except ValueError as e:  # no chat template, or a template that refuses the messages
        raise ApiError(400, str(e), param=param, code="invalid_value") from e


async def _serve(
    state: ServerState,
    request: Request,
    kind: Kind,
    body: Any,
    prompts: list[list[int]],
    params: list[str],
    default_max_tokens: int | None,
    tool_names: frozenset[str] = frozenset(),
):
    """Check each prompt (``params``: how errors name it) and the fields for it, submit ``n``
    choices of each, and answer (reading calls of ``tool_names`` from a chat's text)."""
    engine = state.engine
    refuse_unimplemented(body)  # vLLM's extras this server does not implement: 400 by name
    prompts = [
        truncate(ids, body, engine.context_len, p) for ids, p in zip(prompts, params, strict=True)
    ]
    for ids, param in zip(prompts, params, strict=True):
        check_prompt_ids(
            ids, vocab_size=engine.vocab_size, context_len=engine.context_len, param=param
        )
    # Each prompt's sampling: max_tokens (its default, its limit) is the room its prompt leaves.
    samplings = [
        sampling_of(
            body,
            prompt_len=len(ids),
            context_len=engine.context_len,
            vocab_size=engine.vocab_size,
            default_max_tokens=default_max_tokens,
            prompt_name="the prompt" if len(prompts) == 1 else param,
            defaults=engine.sampling_defaults,
        )
        for ids, param in zip(prompts, params, strict=True)
    ]
    logprobs, bias = logprobs_of(body), logit_bias_of(body, engine.vocab_size)
    checked = [
        (ids, replace(s, logprobs=logprobs, logit_bias=bias))
        for ids, s in zip(prompts, samplings, strict=True)
    ]
    sampling = checked[0][1]
    for _, s in checked:  # vLLM's request_params_* histograms: one per prompt
        state.metrics.vllm.observe_params(body.n or 1, s.max_new_tokens)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    n = body.n or 1  # sampling_of checked it
    lps = None  # each choice's logprobs object (launch/server/logprobs.py), when asked
    if sampling.logprobs is not None:
        as_ids = bool(body.return_tokens_as_token_ids)
        lps = [ChoiceLogprobs(kind, state.tokenizer, as_ids) for _ in range(len(prompts) * n)]
    choices = submit_choices(state, rid, checked, n, seeded=body.seed is not None)
    created = now()
    extras = ResponseExtras.of(body, kind, prompts, n, has_text=state.tokenizer is not None)
    if sampling.stream:
        return await stream_response(
            choices, request, kind, rid, body.model, created, sampling.include_usage, lps,
            tool_names, extras=extras,
        )
    return await whole_response(
        choices, request, kind, rid, body.model, created, lps, tool_names, extras=extras
    )
