"""Every error of the app as OpenAI's error object ``{"error": {"message", "type", "param",
"code"}}``, never FastAPI's ``{"detail": ...}`` nor a text/plain 500.

``install_error_handlers(app)`` routes: ``ApiError`` (the checks' 400s, 401, 429, 503) as it
is; pydantic's complaints (a wrong type, a missing field, a body that is not JSON) as a 400
naming the field (``messages[0].role``); Starlette's HTTP errors (404 unknown route, 405 wrong
method, a body that does not parse) with their status; any other exception as a 500
``server_error`` (a bug: uvicorn still logs its traceback).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from launch.server.protocol import ApiError, error_body

__all__ = ["error_response", "install_error_handlers"]

# pydantic names a union's member in an error's location (``prompt.str``); the client's field is
# the part before it.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none"})

# OpenAI's codes for the HTTP errors Starlette raises itself.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(err.message, err.kind, err.param, err.code),
        status_code=err.status,
        headers=err.headers,
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(http_error(request, exc))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        return error_response(
            ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error",
                     code="internal_error")
        )


def http_error(request: Request, exc: HTTPException) -> ApiError:
    """Starlette's own HTTP error (an unknown route, a wrong method, a body it cannot read)."""
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.url.path} does not take {request.method}"
    else:
        message = str(exc.detail)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return ApiError(exc.status_code, message, kind=kind, code=_HTTP_CODES.get(exc.status_code),
                    headers=dict(exc.headers or {}))


def validation_error(exc: RequestValidationError) -> ApiError:
    """Pydantic's first complaint as a 400 naming the field (``messages[0].role``): a value of
    the wrong JSON type (no coercion: ``"4"``, ``true`` or ``4.0`` for an integer), a missing
    field, a body that is not JSON."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    e = errors[0]
    if e.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {e.get('msg')}", code="invalid_json")
    loc = [p for p in e.get("loc", ()) if p != "body"]
    loc = [p for p in loc if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p))]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    given = f", got {e['input']!r}" if "input" in e and e.get("type") != "missing" else ""
    return ApiError(
        400, f"{param or 'body'}: {e.get('msg')}{given}", param=param, code=e.get("type")
    )
