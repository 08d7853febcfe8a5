"""`dp-runtime serve`: start the DP gang and serve it over HTTP with the OpenAI protocol.

The model, launcher, device, dtype, dp, Ray and batch options are ``dp-runtime run``'s and are
checked by the same code (``cli_options.check_gang_options``); serve adds ``--host`` (default
127.0.0.1: loopback unless asked; beyond it without a key, a warning), ``--port`` (8000),
``--api-key`` (or ``DP_RUNTIME_API_KEY``; empty or blank is refused from either),
``--max-queued``, ``--context-len``, ``--drain-timeout``, ``--keep-alive-timeout``,
``--max-request-bytes``, ``--header-timeout``, ``--body-timeout`` and ``--sampling-defaults``
(``model``: a request's unset temperature, top_p, top_k, min_p and repetition_penalty take the
checkpoint's generation_config.json values; ``none``: OpenAI's).

Order: every option is checked, the checkpoint's generation_config.json and tokenizer read and
the port bound before anything slow starts, so a user error (a bad option, a sampling default
out of its field's limits, a port in use, a broken tokenizer) is one line on stderr and exit 2
with no gang started. Then uvicorn serves at once while the engine starts beside it
(``serve_lifecycle.py``: 503 until ready, the phases on stderr, a failed start one line and exit
2 or 1, SIGTERM or Ctrl-C at any moment a drain, the ranks and a Ray cluster it started
stopped, exit 0).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import typer

from dp_runtime.options import DEFAULTS as D
from launch.cli_errors import (
    EXIT_USAGE,
    UsageError,
    check_choice,
    is_user_error,
    print_error,
)

__all__ = ["serve"]

API_KEY_ENV = "DP_RUNTIME_API_KEY"
# launch/server/body_limit.py's (no FastAPI import here)
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def serve(
    model: str = typer.Option(
        "tiny", "--model", help="Preset name (tiny, qwen3-30b-a3b) or a HF checkpoint dir."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (0.0.0.0 opens it to the network)."
    ),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: str = typer.Option(
        None,
        "--api-key",
        envvar=API_KEY_ENV,
        help="Require 'Authorization: Bearer <key>' on every route but /health.",
    ),
    dp: int = typer.Option(
        None, "--dp", help="DP ranks (default: 2 with --launcher ray, 1 with local)."
    ),
    launcher: str = typer.Option(
        "ray", "--launcher", help="ray (one actor per rank) | local (1 rank, in-process)."
    ),
    ray_address: str = typer.Option(
        None,
        "--ray-address",
        help="Default: a private local cluster; 'auto' or host:port joins a running one.",
    ),
    max_restarts: int = typer.Option(
        None,
        "--max-restarts",
        help=f"Gang restarts allowed after a rank fails [default: {D.max_restarts}].",
    ),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    dtype: str = typer.Option(
        D.dtype,
        "--dtype",
        help="auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16.",
    ),
    dispatcher: str = typer.Option(
        D.dispatcher, "--dispatcher", help="auto | local | all_gather | all_to_all | flashinfer."
    ),
    max_running_requests: int = typer.Option(
        D.max_running_requests, "--max-running-requests", help="Decode batch cap per rank."
    ),
    chunked_prefill_size: int = typer.Option(
        D.chunked_prefill_size, "--chunked-prefill-size", help="Prefill chunk in tokens per rank."
    ),
    schedule_policy: str = typer.Option(
        D.schedule_policy,
        "--schedule-policy",
        help="Admission order: fcfs (arrival) | lof (longest output first: the most max_tokens).",
    ),
    mixed_step_tokens: str = typer.Option(
        str(D.mixed_step_tokens),
        "--mixed-step-tokens",
        show_default="auto: the largest extend graph",
        help="Most tokens of a mixed prefill+decode step: 1..--chunked-prefill-size.",
    ),
    kv_cache_dtype: str = typer.Option(
        D.kv_cache_dtype,
        "--kv-cache-dtype",
        help="KV cache storage: auto (the model's dtype) | fp8_e4m3 (FP8, scale 1: half the bytes "
        "per token, twice the slots; K/V rounded to e4m3).",
    ),
    prefix_caching: bool = typer.Option(
        D.prefix_caching,
        "--prefix-caching/--no-prefix-caching",
        help="Reuse the KV of prompt prefixes cached from earlier requests on the same rank.",
    ),
    quantization: str = typer.Option(
        D.quantization,
        "--quantization",
        help="Weights: none (as the checkpoint stores them; an FP8 checkpoint is served FP8) | "
        "fp8 (float weights quantized at load to FP8 in 128x128 blocks).",
    ),
    max_queued: int = typer.Option(
        1024, "--max-queued", help="Requests waiting beyond the running ones; more get 429."
    ),
    context_len: int = typer.Option(
        None,
        "--context-len",
        help="Longest prompt + output of one request (default: the model's limit, at most 4096).",
    ),
    drain_timeout: float = typer.Option(
        30.0, "--drain-timeout", help="Seconds in-flight requests get on SIGTERM/Ctrl-C."
    ),
    keep_alive_timeout: int = typer.Option(
        30,
        "--keep-alive-timeout",
        help="Seconds an idle HTTP connection stays open for its client's next request.",
    ),
    max_request_bytes: int = typer.Option(
        DEFAULT_MAX_REQUEST_BYTES,
        "--max-request-bytes",
        help="The largest request body; a larger one is a 413.",
    ),
    header_timeout: float = typer.Option(
        10.0,
        "--header-timeout",
        help="Seconds a connection gets to send its request line and headers; then it is closed.",
    ),
    body_timeout: float = typer.Option(
        30.0,
        "--body-timeout",
        help="Seconds a request's body may stall between two reads; then the connection is closed.",
    ),
    sampling_defaults: str = typer.Option(
        "model",
        "--sampling-defaults",
        help="model: unset temperature/top_p/top_k/min_p/repetition_penalty take the checkpoint's "
        "generation_config.json values | none: OpenAI's defaults.",
    ),
    seed: int = typer.Option(D.seed, "--seed", help="Seed of a preset's random weights."),
    log_level: str = typer.Option("warning", "--log-level", help="debug | info | warning | error."),
    debug: bool = typer.Option(False, "--debug", help="Print the traceback of an error."),
) -> None:
    """Serve a model over HTTP (OpenAI-compatible: /v1/completions, /v1/chat/completions)."""
    opts = dict(
        model=model,
        host=host,
        port=port,
        api_key=api_key,
        dp=dp,
        launcher=launcher,
        ray_address=ray_address,
        max_restarts=max_restarts,
        device=device,
        dtype=dtype,
        dispatcher=dispatcher,
        max_running_requests=max_running_requests,
        chunked_prefill_size=chunked_prefill_size,
        schedule_policy=schedule_policy,
        mixed_step_tokens=mixed_step_tokens,
        kv_cache_dtype=kv_cache_dtype,
        prefix_caching=prefix_caching,
        quantization=quantization,
        max_queued=max_queued,
        context_len=context_len,
        drain_timeout=drain_timeout,
        keep_alive_timeout=keep_alive_timeout,
        max_request_bytes=max_request_bytes,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        sampling_defaults=sampling_defaults,
        seed=seed,
        log_level=log_level,
    )
    try:
        prepared = _prepare(opts)
    except Exception as e:
        if not is_user_error(e):
            raise
        print_error(e, debug=debug)
        raise typer.Exit(EXIT_USAGE) from None
    from launch.serve_lifecycle import phase, serve_until_stopped

    if not _is_loopback(prepared["sock"]) and not opts["api_key"]:
        print(f"warning: listening on {host} (beyond loopback) without an API key: anyone who "
              f"can reach port {port} can use the model (set --api-key or DP_RUNTIME_API_KEY)",
              file=sys.stderr, flush=True)
    given = prepared["engine"].sampling_defaults.items()
    if given:
        phase("unset sampling fields take the checkpoint's generation_config.json: "
              + ", ".join(f"{k}={v}" for k, v in given.items()))
    code = serve_until_stopped(prepared["engine"], prepared["tokenizer"], prepared["sock"], opts,
                               debug)
    if code:
        raise typer.Exit(code)


def _prepare(o: dict[str, Any]) -> dict[str, Any]:
    """Every check that needs no gang: options, spec, the engine (not started: it reads the
    sampling defaults), tokenizer, the listening socket. Raises UsageError (or another
    ValueError/OSError) for a user error."""
    from launch.engine_types import SAMPLING_DEFAULTS
    from launch.extras import SERVE_MODULES, require_extra

    require_extra("serve", SERVE_MODULES, "dp-runtime serve")  # before anything imports them
    # The server's own options first: they need no torch (a second of imports) to be checked.
    check_choice("--sampling-defaults", o["sampling_defaults"], SAMPLING_DEFAULTS)
    if o["max_queued"] < 1:
        raise UsageError(f"--max-queued must be an integer >= 1, got {o['max_queued']}")
    if not (o["drain_timeout"] >= 0 and o["drain_timeout"] < float("inf")):
        raise UsageError(
            f"--drain-timeout must be a number of seconds >= 0, got {o['drain_timeout']}"
        )
    if o["keep_alive_timeout"] < 1:
        raise UsageError(
            f"--keep-alive-timeout must be an integer number of seconds >= 1, "
            f"got {o['keep_alive_timeout']}"
        )
    if not 1 <= o["port"] <= 65535:
        raise UsageError(f"--port must be in [1, 65535], got {o['port']}")
    # Click reads an empty DP_RUNTIME_API_KEY as unset: a keyless server the user did not ask
    # for. Empty or blank, from the option or the environment, is refused alike.
    if o["api_key"] is None and API_KEY_ENV in os.environ:
        o["api_key"] = os.environ[API_KEY_ENV]
    if o["api_key"] is not None and not o["api_key"].strip():
        raise UsageError(f"--api-key (or {API_KEY_ENV}) must not be empty")
    if o["max_request_bytes"] < 1024:
        raise UsageError(f"--max-request-bytes must be an integer >= 1024, got "
                         f"{o['max_request_bytes']}")
    for name in ("header_timeout", "body_timeout"):
        if not (o[name] > 0 and o[name] < float("inf")):
            raise UsageError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got "
                             f"{o[name]}")
    from launch.cli_options import check_gang_options
    from launch.engine import Engine, EngineOptions

    # The options `run` shares, checked by the same function (one line, exit 2, before Ray).
    checked = check_gang_options(
        model=o["model"],
        launcher=o["launcher"],
        device=o["device"],
        dtype=o["dtype"],
        dp=o["dp"],
        dispatcher=o["dispatcher"],
        ray_address=o["ray_address"],
        max_running_requests=o["max_running_requests"],
        chunked_prefill_size=o["chunked_prefill_size"],
        schedule_policy=o["schedule_policy"],
        mixed_step_tokens=o["mixed_step_tokens"],
        kv_cache_dtype=o["kv_cache_dtype"],
        prefix_caching=o["prefix_caching"],
        quantization=o["quantization"],
        context_len=o["context_len"],
        max_restarts=o["max_restarts"],
        log_level=o["log_level"],
        seed=o["seed"],
    )
    cfg, choice, spec = checked.cfg, checked.launch, checked.spec
    options = EngineOptions(
        launcher=choice["launcher"],
        ray_address=choice["ray_address"],
        max_queued=o["max_queued"],
        max_restarts=choice["max_restarts"],
        drain_timeout_s=o["drain_timeout"],
        sampling_defaults=o["sampling_defaults"],
    )
    engine = Engine(spec, options)  # reads generation_config.json: its errors are exit 2 here
    from launch.server.text import load_tokenizer

    model_dir = None if spec.is_preset else spec.model
    try:
        tokenizer = load_tokenizer(model_dir)
    except Exception as e:
        raise UsageError(f"--model {o['model']}: its tokenizer does not load: {e}") from e
    if tokenizer is not None and len(tokenizer) > spec.model_config().vocab_size:
        raise UsageError(
            f"--model {o['model']}: the tokenizer has {len(tokenizer)} ids, more than the model's "
            f"vocab_size {spec.model_config().vocab_size}"
        )
    return dict(cfg=cfg, engine=engine, tokenizer=tokenizer, sock=_bind(o["host"], o["port"]))


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so that a port in use is a user error before the gang
    starts (uvicorn serves on this very socket)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} does not resolve: {e}") from e
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(
            f"--host {host} --port {port}: cannot listen there: {e.strerror or e}"
        ) from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _is_loopback(sock: socket.socket) -> bool:
    import ipaddress

    return ipaddress.ip_address(sock.getsockname()[0]).is_loopback
