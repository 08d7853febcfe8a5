"""Which Ray cluster a run uses, and which device its ranks get.

``connect_ray(address)``:

- ``None``: inside a Ray job (``ray job submit`` sets RAY_ADDRESS) join that cluster; otherwise
  start a private local one (``address="local"``: never silently join a cluster someone else
  started on this machine), with no dashboard and ``num_cpus`` logical CPUs, whose GCS, raylet,
  agents and workers listen on loopback only (``_loopback_node``);
- ``"auto"``: join the running cluster found on this node (error if none);
- anything else (``host:port``, ``ray://...``): join that address.

Returns True when this call started Ray, so the caller knows to ``stop_ray()`` it. A cluster
that cannot be joined raises ``RayConnectError`` (a ValueError: the address is the user's input)
naming the address and the cause Ray gives (nothing listening, a missing or wrong auth token).

``log_level`` (``debug``/``info``/...) configures this project's loggers in every Ray worker
process of the job (a ``worker_process_setup_hook``), so rank logs reach the driver's stderr at
the level ``--log-level`` asks for (with ``log_to_driver``).

Ctrl-C, and SIGTERM where the command asked for it (``interrupts.sigterm_raises``), while Ray
starts or stops is held until that step is over (``interrupts.held_interrupts``): then Ray is
shut down and KeyboardInterrupt (or Terminated) raised, so an interrupt never leaves a
half-started node's processes behind. ``ray.init`` in the main thread sets its own SIGTERM
handler as it begins (``sys.exit``, which would cut the start half-way); where a handler of ours
takes SIGTERM, it is kept (``_sigterm_kept``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from launch.interrupts import held_interrupts, interrupt_error

__all__ = ["LOGGERS", "RayConnectError", "check_reachable", "cluster_device", "connect_ray",
           "joins_existing_cluster", "rank_logging", "stop_ray"]

LOGGERS = ("launch", "dp_runtime", "dispatcher", "graph", "buffers")  # this project's packages
LOOPBACK = "127.0.0.1"


class RayConnectError(ValueError):
    """The Ray cluster at an address could not be joined; the message names the address and
    Ray's reason."""


def joins_existing_cluster(address: str | None) -> bool:
    """Whether ``connect_ray(address)`` joins a running cluster (an address, or RAY_ADDRESS set by
    ``ray job submit``) rather than starting a private one."""
    return address is not None or bool(os.environ.get("RAY_ADDRESS"))


def connect_ray(address: str | None = None, *, num_cpus: int | None = None,
                log_to_driver: bool = True, log_level: str | None = None) -> bool:
    """Connect this process to Ray (module docstring); True when Ray was initialised here.
    Raises RayConnectError when a given cluster cannot be joined, KeyboardInterrupt (Terminated:
    SIGTERM under ``sigterm_raises``) after a clean shutdown when it came while Ray started."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"worker_process_setup_hook": _logging_hook(log_level)} if log_level else None
    joins = joins_existing_cluster(address)
    where = address or os.environ.get("RAY_ADDRESS", "")
    interrupts: list[int] = []
    try:
        with _sigterm_kept(), held_interrupts() as interrupts:
            if not joins:
                with _loopback_node():
                    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                             log_to_driver=log_to_driver, configure_logging=False,
                             runtime_env=runtime_env, _node_ip_address=LOOPBACK)
            else:
                check_reachable(where)
                ray.init(address=address, log_to_driver=log_to_driver, configure_logging=False,
                         runtime_env=runtime_env)
    except RayConnectError:
        raise
    except Exception as e:
        stop_ray()
        if interrupts:
            # A terminal's Ctrl-C reaches the whole process group, Ray's starting servers too;
            # ray.init then fails on their loss. The user's interrupt is the cause, not Ray.
            raise interrupt_error(interrupts) from e
        if not joins:
            raise
        # Ray's AuthenticationError says which token is missing and where it is looked for.
        raise RayConnectError(f"cannot join the Ray cluster at {where}: {_cause(e)}") from e
    except BaseException:
        # Interrupted, or init failed part-way: whatever it started goes with it.
        stop_ray()
        raise
    return True


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise RayConnectError unless something accepts a TCP connection at ``address``
    (``host:port``; ``auto`` and ``ray://`` addresses are left to Ray). Ray itself retries an
    unreachable GCS for minutes before it gives up with no cause."""
    if address in ("", "auto", "local") or "://" in address or ":" not in address:
        return
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise RayConnectError(f"--ray-address {address!r} must be auto or host:port (the port is "
                              f"not a number)") from None
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise RayConnectError(f"cannot join the Ray cluster at {address}: nothing answers at "
                              f"{host}:{port} ({why}); is `ray start --head --port {port}` running "
                              f"there, and the port open?") from None


@contextmanager
def _loopback_node() -> Iterator[None]:
    """Let ``ray.init`` start a node on 127.0.0.1. Ray replaces a loopback node IP by the
    machine's outward one (``services.resolve_ip_for_localhost``), and with it every server of
    the node (GCS, raylet, agents, workers) listens on every interface; given 127.0.0.1 as it
    is, they listen on loopback only. A private cluster has no other node to reach it, so nothing
    is lost. (A private hook of Ray: tests/test_cli_ray_door.py checks the listening sockets.)"""
    from ray._private import services

    original = getattr(services, "resolve_ip_for_localhost", None)
    if original is None:
        yield
        return
    services.resolve_ip_for_localhost = lambda host: host
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


@contextmanager
def _sigterm_kept() -> Iterator[None]:
    """Keep SIGTERM's Python handler, where there is one, through the block: ``ray.init`` in
    the main thread sets its own as it begins (it exits at once: a start cut half-way leaves
    Ray's agents running), and ``held_interrupts`` holds SIGTERM for ours until the start is
    over. Without a handler of ours Ray's is set as Ray sets it. A private hook of Ray, like
    ``_loopback_node``: tests/test_cli_interrupt.py sends SIGTERM while Ray starts."""
    from ray._private import utils

    original = getattr(utils, "set_sigterm_handler", None)
    if original is None or not callable(signal.getsignal(signal.SIGTERM)):
        yield
        return
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original


def _cause(exc: BaseException) -> str:
    """Ray's reason for a failed join, with its own cause (the auth or connection error) when it
    wraps one, as one line."""
    parts: list[str] = []
    e: BaseException | None = exc
    while e is not None and len(parts) < 3:
        text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
        if text and text not in parts:
            parts.append(text)
        e = e.__cause__ or e.__context__
    return "; ".join(parts) or type(exc).__name__


def _logging_hook(level: str):
    """``rank_logging(level)`` as the argument-less function Ray's setup hook takes (a named
    function: Ray exports the hook by name, which a functools.partial lacks)."""

    def setup_rank_logging() -> None:
        rank_logging(level)

    return setup_rank_logging


def rank_logging(level: str | None) -> None:
    """Send this project's logs of a Ray worker process to its stderr at ``level`` (Ray forwards
    a worker's stderr to the driver). Runs in every worker as its setup hook."""
    if not level:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in LOGGERS:
        log = logging.getLogger(name)
        log.addHandler(handler)
        log.setLevel(level.upper())
        log.propagate = False


def stop_ray() -> None:
    """``ray.shutdown()`` with Ctrl-C held until it is done (a second Ctrl-C while the cluster
    stops must not leave its agents running)."""
    import ray

    with held_interrupts():
        ray.shutdown()


def cluster_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when the connected cluster has a GPU, else ``cpu``; ``cpu``/``cuda``
    pass through (``cuda`` on a cluster without GPUs raises ValueError naming the resources)."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if requested == "auto":
        return "cuda" if gpus >= 1 else "cpu"
    if requested == "cuda" and gpus < 1:
        raise ValueError(f"device='cuda' but the Ray cluster has no GPU "
                         f"(resources: {ray.cluster_resources()})")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    return requested
