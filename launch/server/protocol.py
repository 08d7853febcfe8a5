"""The OpenAI protocol of ``dp-runtime serve``: request models and their checks (the response
bodies are ``bodies.py``).

Every check here runs in the server process before any rank sees the request, and a bad field
is an ``ApiError`` (HTTP 400) whose body is OpenAI's error object, naming the field (``param``),
the limit and the value::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_value"}}

A sampling field the request leaves unset (absent or null) takes the checkpoint's recommended
value where it has one (``defaults``: ``Engine.sampling_defaults``, from generation_config.json
unless ``--sampling-defaults none``), else OpenAI's (temperature 1, top_p 1; completions'
max_tokens 16, chat's the rest of the context); a field the client sets, even to OpenAI's
default, is the client's. ``top_k``, ``min_p`` ([0, 1], 0 off), ``seed``-less determinism,
``stop_token_ids`` and ``ignore_eos`` follow vLLM's extras: top_k -1 or 0 is off; no seed draws
a random one.

A completion's ``prompt`` may be a batch (prompts.py); the sampling fields are checked for each
of its prompts, so ``max_tokens`` fits every one (its message names the prompt it does not fit).
``logprobs``/``top_logprobs`` (logprobs.py) and ``logit_bias`` (logit_bias.py: token-id strings
to biases in [-100, 100], at most 300) are checked once per request, in their own modules.
``presence_penalty`` and ``frequency_penalty`` are OpenAI's: finite, in [-2, 2], 0 or null off
(the engine's rule: ``SamplingParams``). ``repetition_penalty`` is vLLM's extra: finite, > 0, 1
off; unset or null takes the checkpoint's default, else 1. ``min_tokens`` is vLLM's extra: in
[0, max_tokens], null 0; the first min_tokens tokens are no stop or EOS token and end at no stop
string.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from dp_runtime.model.sampling_defaults import SamplingDefaults
from dp_runtime.serving.request import PENALTY_MAX
from launch.server.vllm_extras import VllmExtras

__all__ = [
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "Sampling",
    "error_body",
    "sampling_of",
]

SEED_LIMIT = 2**64
# A temperature below this samples as greedy (vLLM's _SAMPLING_EPS): the limit of the softmax at
# T -> 0 is the argmax, while logits / T overflows float32 (the draw fails) far above 1e-45.
GREEDY_BELOW = 1e-5
MAX_N = 16  # choices per prompt; each is one engine request (launch/server/choices.py)


class ApiError(Exception):
    """An HTTP error with OpenAI's error body; ``headers`` e.g. Retry-After for 429."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )
        self.headers = headers or {}


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Types are strict, as JSON has them: no coercion, so ``"4"``, ``true`` or ``4.0`` for an integer
# field and ``"yes"`` or ``1`` for a boolean one are 400s naming the field (an integer for a
# float field is a number, and is taken).
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk (vllm_fields.py)


class _Common(VllmExtras):
    # Unknown fields are ignored (clients send many); the ones this server cannot honour are
    # refused by name in ``_refuse_unsupported``.
    model_config = _STRICT

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None  # vLLM's extra (SamplingParams.repetition_penalty)
    min_tokens: int | None = None  # vLLM's extra (SamplingParams.min_tokens)
    logit_bias: dict[str, Any] | None = None  # checked in logit_bias.py (400 naming it)
    user: str | None = None


class CompletionRequest(_Common):
    # A text, token ids, texts or token-id lists: checked in prompts.py, which names `prompt`
    # where pydantic's union would name one of its members.
    prompt: str | list[Any]
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string (chat_request.py)


class ToolCall(BaseModel):
    """A call an assistant message made (a turn the client sends back with the tool's answer)."""

    model_config = _STRICT
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    # Structured output changes what a response must be: refused, never ignored.
    response_format: dict[str, Any] | None = None
    # Checked in chat_request.py (400 naming e.g. tools[2].function.name).
    tools: list[Any] | None = None
    tool_choice: Any = None
    # OpenAI's deprecated forms of tools/tool_choice: refused, naming those.
    functions: list[Any] | None = None
    function_call: Any = None


@dataclass(frozen=True)
class Sampling:
    """A request's checked sampling fields, as the engine's SamplingParams takes them, plus
    the server's own: stop strings and the stream options."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    extra: dict = field(default_factory=dict)
    logprobs: int | None = None  # top alternatives per token (None: no logprobs; logprobs.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs (logit_bias.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def params(self) -> dict[str, Any]:
        """The keywords of ``SamplingParams``."""
        return dict(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            logit_bias=self.logit_bias,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
        )


def check_prompt_ids(ids: list[int], *, vocab_size: int, context_len: int, param: str) -> None:
    """Token ids inside the vocabulary, and a prompt leaving room for one new token."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise bad(
                param,
                f"{param}[{i}] must be a token id in [0, {vocab_size}) (the model's vocab_size), "
                f"got {t}",
            )
    if len(ids) >= context_len:
        raise bad(
            param,
            f"the prompt has {len(ids)} tokens; the context length is {context_len} (prompt + "
            f"max_tokens <= {context_len}, at least one new token)",
            code="context_length_exceeded",
        )


def sampling_of(
    req: _Common,
    *,
    prompt_len: int,
    context_len: int,
    vocab_size: int,
    default_max_tokens: int | None,
    prompt_name: str = "the prompt",
    defaults: SamplingDefaults | None = None,
) -> Sampling:
    """Check ``req``'s sampling fields against the model for one prompt of ``prompt_len``
    tokens (``prompt_name`` in messages: ``prompt[2]`` of a batch); returns them resolved, the
    unset ones from ``defaults`` (the checkpoint's; None: none) or OpenAI's. Raises ApiError
    (400) naming the first bad field, its limit and its value. ``default_max_tokens`` None means
    the rest of the context (chat)."""
    _refuse_unsupported(req)
    defaults = defaults or SamplingDefaults()
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise bad("n", f"n must be in [1, {MAX_N}] (choices per request), got {req.n}")
    room = context_len - prompt_len
    max_tokens = req.max_tokens
    name = "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens <= 0:
        raise bad(name, f"{name} must be >= 1, got {max_tokens}")
    elif max_tokens > room:
        raise bad(
            name,
            f"{name} must be <= {room} (context length {context_len} minus {prompt_name}'s "
            f"{prompt_len} tokens), got {max_tokens}",
            code="context_length_exceeded",
        )
    min_tokens = 0 if req.min_tokens is None else req.min_tokens
    if not 0 <= min_tokens <= max_tokens:
        raise bad("min_tokens",
                  f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    temperature = defaults.pick("temperature", req.temperature, 1.0)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise bad("temperature", f"temperature must be a finite number >= 0, got {temperature}")
    temperature = 0.0 if temperature < GREEDY_BELOW else temperature
    top_p = defaults.pick("top_p", req.top_p, 1.0)
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise bad("top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = defaults.pick("top_k", req.top_k, 0)
    top_k = 0 if top_k == -1 else top_k
    if top_k < 0:
        raise bad("top_k", f"top_k must be -1 or 0 (off) or >= 1, got {req.top_k}")
    min_p = defaults.pick("min_p", req.min_p, 0.0)
    if not (math.isfinite(min_p) and 0 <= min_p <= 1):
        raise bad("min_p", f"min_p must be a finite number in [0, 1] (0: off), got {min_p}")
    repetition = defaults.pick("repetition_penalty", req.repetition_penalty, 1.0)
    if not (math.isfinite(repetition) and repetition > 0):
        raise bad("repetition_penalty",
                  f"repetition_penalty must be a finite number > 0 (1: off), got {repetition}")
    seed = secrets.randbelow(2**63) if req.seed is None else req.seed
    if not 0 <= seed < SEED_LIMIT:
        raise bad("seed", f"seed must be in [0, 2**64), got {seed}")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s for s in stop):
        raise bad("stop", f"stop strings must not be empty, got {list(stop)}")
    stop_ids = tuple(req.stop_token_ids or ())
    for i, t in enumerate(stop_ids):
        if not 0 <= t < vocab_size:
            raise bad(
                "stop_token_ids",
                f"stop_token_ids[{i}] must be a token id in [0, {vocab_size}), got {t}",
            )
    penalties = {name: _penalty(req, name) for name in ("presence_penalty", "frequency_penalty")}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options", "stream_options applies only with stream: true")
    return Sampling(
        max_new_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stop_token_ids=stop_ids,
        ignore_eos=bool(req.ignore_eos),
        stop=stop,
        stream=bool(req.stream),
        include_usage=include_usage,
        min_p=float(min_p),
        repetition_penalty=float(repetition),
        min_tokens=min_tokens,
        **penalties,
    )


def _penalty(req: _Common, name: str) -> float:
    """``presence_penalty`` or ``frequency_penalty``: finite, in [-2, 2]; null is 0 (off)."""
    value = getattr(req, name)
    value = 0.0 if value is None else value
    if not (math.isfinite(value) and abs(value) <= PENALTY_MAX):
        raise bad(name, f"{name} must be a finite number in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}], "
                        f"got {value}")
    return float(value)


def _refuse_unsupported(req: _Common) -> None:
    """Fields a client may set that this server does not implement: refused, never ignored
    (``logprobs`` and ``top_logprobs`` are checked in logprobs.py, ``logit_bias`` in
    logit_bias.py, the penalties in ``sampling_of``)."""
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise bad("echo", "echo is not supported (nor prompt logprobs), got true")
        if req.best_of not in (None, 1):
            raise bad("best_of", f"best_of must be 1, got {req.best_of}")
        if req.suffix:
            raise bad("suffix", "suffix is not supported")
    else:
        fmt = req.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            raise bad("response_format",
                      f"response_format {fmt.get('type')!r} is not supported (only text)")
        for name, now in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(req, name) not in (None, []):
                raise bad(name, f"{name} is not supported (OpenAI's deprecated form): use {now}")
