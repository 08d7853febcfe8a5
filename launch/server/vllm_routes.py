"""vLLM's routes beside OpenAI's: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
and ``GET /v1/models/{id}``, with vLLM's request and response shapes; ``model_card`` is one
entry of ``GET /v1/models`` (``root``: the checkpoint directory or the preset's name, as vLLM's
``root`` is the model's path).

- ``/tokenize``: ``{"prompt": text}`` (the tokenizer's special tokens added, as a completion's
  prompt) or ``{"messages": [...], "tools": [...]}`` (the chat template with the assistant's turn
  opened, as a chat request's prompt: the same ids the completion routes would run); ``model``
  optional; ``return_token_strs`` adds the tokens' strings. Answers ``{"count", "max_model_len",
  "tokens", "token_strs"}``. ``add_special_tokens`` or ``add_generation_prompt`` other than what
  the generation routes do would tokenize differently from them: refused by name.
- ``/detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens kept, as vLLM's).
- ``/version``: ``{"version": dp-runtime's}``.

Every error is OpenAI's error object (400 naming the field; an unknown model id is a 404).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from dp_runtime.version import __version__
from launch.server.chat_request import check_template, messages_of, tools_of
from launch.server.protocol import ApiError, ChatMessage, ChatRequest, bad
from launch.server.text import TokenizerMissing

__all__ = ["add_vllm_routes", "model_card"]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def model_card(engine: Any) -> dict[str, Any]:
    """The served model as ``/v1/models`` lists it."""
    return {
        "id": engine.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "dp-runtime",
        "root": str(engine.spec.model),
        "parent": None,
        "max_model_len": engine.context_len,
    }


def add_vllm_routes(app: FastAPI, state: Any) -> None:
    """Register the routes of the module docstring on ``app`` (``state``: the app's
    ``ServerState``)."""
    engine = state.engine

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != engine.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist (this server serves "
                                f"{engine.model_name!r})", param="model", code="model_not_found")
        return model_card(engine)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(engine, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad("prompt", "give either prompt (a text) or messages (a chat), not both "
                                "or neither")
        chat = body.messages is not None
        for name, same in (("add_special_tokens", not chat), ("add_generation_prompt", True)):
            value = getattr(body, name)
            if value is not None and value is not same:
                raise bad(name, f"{name} {str(value).lower()} is not supported: the generation "
                                f"routes tokenize with {str(same).lower()}")
        try:
            if chat:
                req = ChatRequest(model=engine.model_name, messages=body.messages,
                                  tools=body.tools)
                tools = tools_of(req)
                if tools.specs is not None:
                    check_template(state.tokenizer, engine.model_name)
                ids = await state.encoder.chat(messages_of(req), tools.specs)
            else:
                ids = await state.encoder.text(body.prompt)
        except TokenizerMissing as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt",
                           code="no_tokenizer") from e
        except ValueError as e:  # no chat template, or one that refuses the messages
            raise bad("messages", str(e)) from e
        strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.context_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(engine, body.model)
        if state.tokenizer is None:
            raise ApiError(400, f"the model {engine.model_name!r} has no tokenizer: there is no "
                                f"text for token ids", param="tokens", code="no_tokenizer")
        for i, t in enumerate(body.tokens):
            if not 0 <= t < engine.vocab_size:
                raise bad(f"tokens[{i}]", f"tokens[{i}] must be a token id in [0, "
                                          f"{engine.vocab_size}), got {t}")
        return {"prompt": state.tokenizer.decode(body.tokens)}


def _check_model(engine: Any, name: str | None) -> None:
    if name is not None and name != engine.model_name:
        raise ApiError(400, f"model must be {engine.model_name!r} (the model this server "
                            f"serves), got {name!r}", param="model", code="model_not_found")
