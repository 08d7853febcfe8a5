"""The life of a ``dp-runtime serve`` process once its options are checked and its port bound.

1. uvicorn serves on the bound socket at once; the engine starts in a thread beside it. Until
   it is ready ``/health`` answers 503 ``starting`` and every other route 503 with
   ``Retry-After`` (``server/readiness.py``): a load balancer never sees a hang. The phases go
   to stderr (``[dp-runtime serve] ...``), for both launchers.
2. A start that fails: one ``error:`` line, then the server stops; exit 2 for a cause the input
   explains (a rank that cannot hold the model), else 1.
3. SIGTERM or Ctrl-C, at any moment: uvicorn stops accepting and the engine drains at once
   (``Engine.shutdown``): requests in flight get ``--drain-timeout`` seconds to finish, then
   the engine aborts the rest, and each ends with a named error (a stream: an error event, then
   ``data: [DONE]``; a whole response: 503 JSON), no traceback. Then the ranks stop, and a Ray
   cluster the engine started. Exit 0. During the start, the start stops what it brought up
   (``Engine.start``): on a private Ray cluster the process waits for it (the gang's launch
   and the cluster's stop are never cut in half); in-process ranks still loading, or a
   ``ray.init`` on an address that does not answer, hold nothing outside this process, which
   then ends at once (``os._exit``: their threads cannot be joined).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from typing import Any

from launch.cli_errors import EXIT_FAILED, EXIT_USAGE, is_user_error, print_error

__all__ = ["DRAIN_GRACE_S", "serve_until_stopped"]

# uvicorn waits this long past --drain-timeout for the responses of the requests the engine
# aborted at it (the engine gives their results up to 5 s) before it cuts connections.
DRAIN_GRACE_S = 10


def phase(text: str) -> None:
    print(f"[dp-runtime serve] {text}", file=sys.stderr, flush=True)


class _Life:
    """The engine's start and stop beside uvicorn (module docstring); ``exit_code`` at the end."""

    def __init__(self, engine: Any, drain_timeout_s: float, debug: bool) -> None:
        self.engine, self.drain_timeout_s, self.debug = engine, drain_timeout_s, debug
        self.exit_code = 0
        self.server: Any = None
        self._lock = threading.Lock()
        self._starter: threading.Thread | None = None
        self._started = False
        self._release = threading.Event()  # set once the engine stopped: the start thread ends
        self._stopper: threading.Thread | None = None

    def start_engine(self, serving_line: str) -> None:
        loop = asyncio.get_running_loop()  # the main thread's: signal handlers are set there

        def on_phase(text: str) -> None:
            phase(text)
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
                loop.call_soon_threadsafe(_reclaim_signals)

        def start() -> None:
            try:
                self.engine.start(on_phase=on_phase)
            except BaseException as e:
                with self._lock:
                    stopping = self._stopper is not None
                if not stopping:  # a shutdown during the start is no failure
                    print_error(e, debug=self.debug)
                    self.exit_code = EXIT_USAGE if is_user_error(e) else EXIT_FAILED
                    self.server.should_exit = True
                return
            self._started = True
            phase(serving_line)
            # Ray ties a private cluster's processes to the thread that started them (they die
            # with it): this thread lives until the engine has stopped.
            self._release.wait()

        self._starter = threading.Thread(target=start, name="engine-start", daemon=True)
        self._starter.start()

    def begin_stop(self) -> None:
        """Start draining the engine now (once): on the signal, not after uvicorn's own wait,
        so the engine's aborts end the responses before uvicorn cuts their connections."""
        with self._lock:
            if self._stopper is not None:
                return
            self._stopper = threading.Thread(target=self._stop, name="engine-stop", daemon=True)
        self._stopper.start()

    def _stop(self) -> None:
        phase(f"shutting down: draining in-flight requests (at most {self.drain_timeout_s:g} s)")
        try:
            self.engine.shutdown(drain_timeout_s=self.drain_timeout_s)
        except Exception as e:  # the exit must still come
            print_error(e, debug=self.debug)

    def wait_stopped(self) -> None:
        self.begin_stop()
        self._stopper.join()
        self._release.set()

    def join_start(self) -> None:
        self._starter.join()

    @property
    def start_running(self) -> bool:
        """The engine's start is still under way (not: its thread waiting for the release)."""
        return self._starter is not None and self._starter.is_alive() and not self._started


def _reclaim_signals() -> None:
    """Give SIGTERM and SIGINT back to uvicorn's handlers: ``ray.init`` (in the start thread)
    installs a C++ handler over them that prints a stack dump on SIGTERM. Each phase after the
    init calls this, in the main thread."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if callable(handler):
            signal.signal(sig, handler)


def serve_until_stopped(engine: Any, tokenizer: Any, sock: Any, o: dict[str, Any],
                        debug: bool) -> int:
    """Serve ``engine`` on ``sock`` until a signal or a failed start (module docstring);
    returns the exit code (or ends the process with it, see the docstring)."""
    import uvicorn

    from launch.server.app import create_app
    from launch.server.connection_timeouts import timed_h11

    life = _Life(engine, o["drain_timeout"], debug)
    url = f"http://{o['host']}:{sock.getsockname()[1]}"

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        phase(f"listening on {url}: /health answers 503 until the engine is ready")
        life.start_engine(f"serving {engine.model_name} on {url} (dp={engine.world_size})")
        try:
            yield
        finally:
            await asyncio.to_thread(life.wait_stopped)

    app = create_app(engine, tokenizer=tokenizer, api_key=o["api_key"], lifespan=lifespan,
                     max_request_bytes=o["max_request_bytes"])
    config = uvicorn.Config(
        app,
        http=timed_h11(o["header_timeout"], o["body_timeout"]),
        log_level=o["log_level"],
        timeout_graceful_shutdown=int(o["drain_timeout"]) + DRAIN_GRACE_S,
        # Longer than clients keep idle connections pooled (httpx, under the openai client: 5 s;
        # aiohttp: 15 s). At uvicorn's default of 5 s the server closes connections a client
        # still holds, and a request sent on one as it closes fails with "Server disconnected"
        # (a loaded HTTP benchmark at DP 2 lost its run to it).
        timeout_keep_alive=o["keep_alive_timeout"],
        access_log=o["log_level"] in ("debug", "info"),
    )
    server = _make_server(config, life.begin_stop)
    life.server = server
    try:
        server.run(sockets=[sock])
    finally:
        life.wait_stopped()  # uvicorn's lifespan did, unless it never ran
    if life.start_running and _starts_private_ray(o):
        # The start stops its own cluster (Engine.start): its end is this process's end.
        phase("stopping the Ray cluster the start brought up")
        life.join_start()
    phase("stopped")
    if life.start_running or _starts_private_ray(o):
        # Threads that cannot be joined (in-process ranks loading, ray.init on a silent
        # address), or Ray's C++ threads after a start stopped half-way (the interpreter's
        # finalization beside them aborts): everything this process started is stopped.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(life.exit_code)
    return life.exit_code


def _starts_private_ray(o: dict[str, Any]) -> bool:
    from launch.ray_cluster import joins_existing_cluster

    return o["launcher"] == "ray" and not joins_existing_cluster(o["ray_address"])


def _make_server(config: Any, on_signal: Any) -> Any:
    """uvicorn's Server that starts the engine's drain on SIGTERM or Ctrl-C and does not
    re-raise the signal after its shutdown (uvicorn >= 0.29 does): the command exits 0 instead
    of dying by the signal."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()
            on_signal()

    return Server(config)
