"""`dp-runtime serve`: start the DP gang and serve it over HTTP with the OpenAI protocol.

The model, launcher, device, dtype, dp, Ray and batch options are ``dp-runtime run``'s and are
checked by the same code (``cli_run.check_launch``, ``RunConfig``); serve adds ``--host``
(default 127.0.0.1: loopback unless asked), ``--port`` (8000), ``--api-key`` (or
``DP_RUNTIME_API_KEY``), ``--max-queued``, ``--context-len``, ``--drain-timeout``,
``--keep-alive-timeout`` and ``--sampling-defaults`` (``model``: a request's unset temperature, top_p, top_k, min_p and
repetition_penalty take the checkpoint's generation_config.json values; ``none``: OpenAI's).

Order: every option is checked, the checkpoint's generation_config.json and tokenizer read and
the port bound before anything slow starts, so a user error (a bad option, a sampling default
out of its field's limits, a port in use, a broken tokenizer) is one line on stderr and exit 2
with no gang started. A gang that fails to start is one line and exit 2 (a cause the input
explains, e.g. a rank that cannot hold the model) or 1; Ctrl-C while it starts is 130. Then the
engine starts (the phases on stderr, the sampling defaults it found among them), uvicorn serves
on the bound socket, and SIGTERM or Ctrl-C stops accepting, lets in-flight requests finish
(uvicorn's graceful shutdown, at most ``--drain-timeout`` seconds), shuts the engine down
(drain, abort the rest, stop the ranks and a Ray cluster it started) and exits 0.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from typing import Any

import typer

from launch.cli_errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    UsageError,
    check_choice,
    is_user_error,
    print_error,
)

__all__ = ["serve"]


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
        envvar="DP_RUNTIME_API_KEY",
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
        None, "--max-restarts", help="Gang restarts allowed after a rank fails [default: 2]."
    ),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16.",
    ),
    dispatcher: str = typer.Option(
        "auto", "--dispatcher", help="auto | local | all_gather | all_to_all | flashinfer."
    ),
    max_running_requests: int = typer.Option(
        64, "--max-running-requests", help="Decode batch cap per rank."
    ),
    chunked_prefill_size: int = typer.Option(
        2048, "--chunked-prefill-size", help="Prefill chunk in tokens per rank."
    ),
    schedule_policy: str = typer.Option(
        "fcfs",
        "--schedule-policy",
        help="Admission order: fcfs (arrival) | lof (longest output first: the most max_tokens).",
    ),
    mixed_step_tokens: str = typer.Option(
        "auto",
        "--mixed-step-tokens",
        show_default="auto: the largest extend graph",
        help="Most tokens of a mixed prefill+decode step: 1..--chunked-prefill-size.",
    ),
    kv_cache_dtype: str = typer.Option(
        "auto",
        "--kv-cache-dtype",
        help="KV cache storage: auto (the model's dtype) | fp8_e4m3 (FP8, scale 1: half the bytes "
        "per token, twice the slots; K/V rounded to e4m3).",
    ),
    prefix_caching: bool = typer.Option(
        True,
        "--prefix-caching/--no-prefix-caching",
        help="Reuse the KV of prompt prefixes cached from earlier requests on the same rank.",
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
    sampling_defaults: str = typer.Option(
        "model",
        "--sampling-defaults",
        help="model: unset temperature/top_p/top_k/min_p/repetition_penalty take the checkpoint's "
        "generation_config.json values | none: OpenAI's defaults.",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of a preset's random weights."),
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
        max_queued=max_queued,
        context_len=context_len,
        drain_timeout=drain_timeout,
        keep_alive_timeout=keep_alive_timeout,
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
    _serve(prepared, opts, debug)


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
    if o["api_key"] is not None and not o["api_key"].strip():
        raise UsageError("--api-key (or DP_RUNTIME_API_KEY) must not be empty")
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


def _serve(p: dict[str, Any], o: dict[str, Any], debug: bool) -> None:
    import uvicorn

    from launch.server.app import create_app

    engine = p["engine"]

    def phase(text: str) -> None:
        print(f"[dp-runtime serve] {text}", file=sys.stderr, flush=True)

    given = engine.sampling_defaults.items()
    if given:
        phase(
            "unset sampling fields take the checkpoint's generation_config.json: "
            + ", ".join(f"{k}={v}" for k, v in given.items())
        )

    try:
        engine.start(on_phase=phase)
    except BaseException as e:
        with contextlib.suppress(Exception):
            engine.shutdown(drain_timeout_s=0)  # the ranks and a Ray cluster it started
        if isinstance(e, KeyboardInterrupt):
            print("interrupted", file=sys.stderr, flush=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        if not isinstance(e, Exception):
            raise
        print_error(e, debug=debug)  # a rank that cannot be built for this model, the gang failing
        raise typer.Exit(EXIT_USAGE if is_user_error(e) else EXIT_FAILED) from None
    port = p["sock"].getsockname()[1]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        phase(f"serving {engine.model_name} on http://{o['host']}:{port} (dp={engine.world_size})")
        try:
            yield
        finally:
            import asyncio

            phase("shutting down: draining in-flight requests")
            # In a thread: the drain waits for steps whose outputs this loop still delivers.
            await asyncio.to_thread(engine.shutdown, drain_timeout_s=o["drain_timeout"])
            phase("stopped")

    app = create_app(engine, tokenizer=p["tokenizer"], api_key=o["api_key"], lifespan=lifespan)
    config = uvicorn.Config(
        app,
        log_level=o["log_level"],
        timeout_graceful_shutdown=max(1, int(o["drain_timeout"])),
        # Longer than clients keep idle connections pooled (httpx, under the openai client: 5 s;
        # aiohttp: 15 s). At uvicorn's default of 5 s the server closes connections a client
        # still holds, and a request sent on one as it closes fails with "Server disconnected"
        # (a loaded HTTP benchmark at DP 2 lost its run to it).
        timeout_keep_alive=o["keep_alive_timeout"],
        access_log=o["log_level"] in ("debug", "info"),
    )
    server = _make_server(config)
    try:
        server.run(sockets=[p["sock"]])
    finally:
        if engine.health().state != "stopped":
            engine.shutdown(drain_timeout_s=0)


def _make_server(config: Any) -> Any:
    """uvicorn's Server without re-raising the signal it shut down on: after a drained SIGTERM
    or Ctrl-C the command exits 0 instead of dying by the signal (uvicorn >= 0.29 re-raises)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return Server(config)
