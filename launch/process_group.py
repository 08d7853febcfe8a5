"""The default torch.distributed process group of one rank: backend choice, rendezvous, teardown.

Backends: ``gloo`` when the rank runs on CPU; ``cpu:gloo,cuda:nccl`` on CUDA, because the DP step
sync and object gathers use CPU tensors (gloo) while the dispatcher's collectives move CUDA
tensors (NCCL). On CUDA the device is set BEFORE the group is created, so NCCL binds the
communicator to the rank's own GPU rather than to GPU 0 of every process.

Two ways in: ``init_process_group(rank, world, addr, port, ...)`` for a launcher that chose the
rendezvous itself (the Ray actors: rank 0 publishes its node IP and a port it holds bound), and
``init_from_env`` for torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK).

Nothing listens beyond the rendezvous address. torch's own tcp:// rendezvous makes rank 0's
TCPStore listen on every interface, IPv4 and IPv6 (an unauthenticated key-value store), so the
launcher's way builds the store itself on a socket bound to ``addr`` alone (``store_socket``):
the loopback address in a private cluster, the node IP Ray uses in a joined one. gloo and NCCL
open their own listeners on the interface their environment names (``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``; by default gloo takes the address the hostname resolves to and NCCL the
first non-loopback interface): ``pin_interfaces(ip)`` names the interface holding ``ip`` unless
the user set them.
Teardown is ``destroy_process_group()``, called after the worker that used the group is closed;
``destroy_process_group(abort=True)`` after a failure, which does not wait for the peers.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = [
    "GroupInfo",
    "backend_for",
    "destroy_process_group",
    "free_port",
    "init_from_env",
    "init_process_group",
    "interface_of",
    "local_cuda_index",
    "node_ip",
    "pin_interfaces",
    "resolve_device",
    "store_socket",
]

DEFAULT_TIMEOUT_S = 300.0

logger = logging.getLogger("launch")


@dataclass(frozen=True)
class GroupInfo:
    """What one rank knows after joining: its rank, the world size, backend and device."""

    rank: int
    world_size: int
    backend: str
    device: str


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cpu``/``cuda`` pass through.

    Raises ValueError for ``cuda`` on a machine without a visible GPU, or for another value.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA GPU (use --device cpu)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return device


def backend_for(device: str) -> str:
    """The process-group backend for ranks on ``device`` (``cpu`` or ``cuda``)."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def local_cuda_index(gpu_ids: Sequence[int | str], visible: str | None) -> int:
    """The torch device index of the first GPU in ``gpu_ids`` (ids as the cluster numbers them).

    ``visible`` is CUDA_VISIBLE_DEVICES: Ray narrows it to the actor's GPUs, so the assigned GPU
    is usually index 0; when it lists more (or is unset), the index is the id's position in it
    (or the id itself). Raises ValueError when the id is not visible.
    """
    if not gpu_ids:
        raise ValueError("no GPU was assigned to this rank (the placement bundle has no GPU)")
    gid = str(gpu_ids[0])
    if not visible:
        return int(gid)
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if gid not in listed:
        raise ValueError(f"assigned GPU {gid} is not in CUDA_VISIBLE_DEVICES={visible!r}")
    return listed.index(gid)


def node_ip() -> str:
    """This node's IP as other nodes reach it (the address of the default route), or loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            # No packet is sent: connect() on UDP only picks the outgoing interface.
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; a race remains until something
    binds it: a launcher holds ``store_socket`` instead)."""
    with store_socket(host) as s:
        return s.getsockname()[1]


def store_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host`` alone (``port`` 0: the OS picks one), not yet listening:
    rank 0's TCPStore listens on it (``init_process_group(store_socket=...)``), so holding it from
    the moment its port is published to the store leaves no window for another process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own socket does
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((host.strip("[]"), port))
    except BaseException:
        s.close()
        raise
    return s


def interface_of(ip: str) -> str | None:
    """The name of this machine's network interface that holds ``ip`` (``lo`` for 127.0.0.1 on
    Linux), or None when none does (an address behind NAT) or psutil is missing (it ships with
    Ray, where the launcher's ranks run)."""
    try:
        import psutil
    except ImportError:
        return None
    want = ip.strip("[]")
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == want for a in addrs):
            return name
    return None


def pin_interfaces(ip: str, environ: dict[str, str] | None = None) -> str | None:
    """Make gloo and NCCL listen on the interface that holds ``ip`` (the node's address in the
    gang: loopback in a private cluster), by setting ``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` where the user has not set them; both are read when a group is
    created, so call this first. Returns the interface, or None (logged) when none holds
    ``ip``: then the libraries' defaults apply."""
    env = os.environ if environ is None else environ
    name = interface_of(ip)
    if name is None:
        logger.warning("no network interface holds %s: gloo and NCCL listen where their defaults "
                       "say (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to choose)", ip)
        return None
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.setdefault(key, name)
    return name


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    device: str = "cpu",
    cuda_index: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store_socket: socket.socket | None = None,
    use_env_store: bool = False,
) -> GroupInfo:
    """Join the default process group whose TCPStore is at ``master_addr:master_port``
    (collective).

    Rank 0 serves the store on ``store_socket`` (bound to ``master_port``; the store takes it
    over and closes it with the group), else on a socket it binds to ``master_addr`` alone
    (module docstring). ``use_env_store`` is torchrun's way instead: torch's tcp:// rendezvous,
    which joins the store torchrun's agent serves. ``device`` is ``cpu`` or ``cuda``; on ``cuda``
    the current device becomes ``cuda_index`` (default 0) first. ``timeout_s`` bounds the
    rendezvous and every later collective, so a rank whose peer died errors out instead of
    waiting forever. Returns the GroupInfo. Raises ValueError for a bad rank/world,
    RuntimeError when a group already exists.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process; "
                           "destroy it first")
    if device == "cuda":
        torch.cuda.set_device(cuda_index or 0)
    backend = backend_for(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if use_env_store:
        where = {"init_method": f"tcp://{_bracket(master_addr)}:{master_port}"}
    else:
        where = {"store": _store(rank, world_size, master_addr, master_port, timeout, store_socket)}
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout,
                            **where)
    return GroupInfo(rank, world_size, backend, device)


def _store(rank: int, world_size: int, addr: str, port: int, timeout: datetime.timedelta,
           sock: socket.socket | None) -> dist.TCPStore:
    """The group's TCPStore: rank 0 serves it on ``sock`` (or a socket bound to ``addr``
    alone), the others connect to ``addr:port``."""
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout)
    if sock is None:
        sock = store_socket(addr, port)
    # detach(): the store owns the descriptor from here and closes it when it is destroyed.
    return dist.TCPStore(addr, port, world_size, True, timeout, master_listen_fd=sock.detach())


def init_from_env(
    *, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
    environ: Mapping[str, str] | None = None
) -> GroupInfo:
    """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK).

    World size 1 creates no group (the worker runs without one). On ``cuda`` the device is
    LOCAL_RANK modulo the visible GPUs. Raises ValueError naming a missing variable.
    """
    env = os.environ if environ is None else environ
    missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise ValueError(f"not under torchrun: {', '.join(missing)} unset "
                         "(run with torchrun --nproc-per-node N)")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    cuda_index = None
    if device == "cuda":
        cuda_index = int(env.get("LOCAL_RANK", rank)) % max(torch.cuda.device_count(), 1)
    if world == 1:
        if device == "cuda":
            torch.cuda.set_device(cuda_index or 0)
        return GroupInfo(0, 1, "none", device)
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in env:
            raise ValueError(f"torchrun did not set {key}")
    return init_process_group(rank, world, env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                              device=device, cuda_index=cuda_index, timeout_s=timeout_s,
                              use_env_store=True)


def destroy_process_group(abort: bool = False) -> None:
    """Destroy the default group if there is one (after every user of it is closed).

    ``abort=True`` is the teardown after a failure: it does not wait for the peers and never
    raises (an error is logged at debug; the failure on its way out is the one to report).
    """
    if not dist.is_initialized():
        return
    if not abort:
        dist.destroy_process_group()
        return
    # After this rank failed, a peer may be blocked in an NCCL collective waiting for it, and a
    # plain destroy then waits for that peer forever, so the error on its way out is never
    # printed. Aborting the communicators returns at once. The abort is private torch API that
    # older torch lacks; there the plain destroy is all there is.
    abort_group = getattr(c10d, "_abort_process_group", None)
    try:
        if abort_group is not None:
            abort_group()
        else:
            dist.destroy_process_group()
    except Exception:
        logger.debug("tearing down the process group of a failed job raised", exc_info=True)


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
