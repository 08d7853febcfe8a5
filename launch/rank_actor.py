"""RankActor: the Ray actor that hosts one rank (a process group member and its RankSession).

A plain class; the gang makes it remote with ``ray.remote(RankActor).options(...)`` at launch, so
importing this module needs no Ray. Every method is lifecycle, never per step:

- ``where()``: node IP, node id, assigned GPU ids, pid (ranks are assigned from these, after
  placement);
- ``rendezvous_port()``: a port on this node's Ray address, held bound until rank 0's
  TCPStore listens on it (asked of the actor that becomes rank 0);
- ``setup(spec, rank, world_size, master_addr, master_port, ...)``: the process group (NCCL+gloo
  on CUDA with the device set from the GPU Ray assigned, gloo on CPU), its store and gloo's and
  NCCL's listeners on the interface of the node's Ray address only (loopback in a private
  cluster: ``process_group``'s docstring), then the RankWorker; collective: every actor of the
  gang is called together;
- ``submit`` / ``start`` / ``collect`` / ``health`` / ``stop``: RankSession's lifecycle;
- serving (the engine): ``serve``, then ``submit`` / ``abort`` / ``wake`` with the driver's
  message numbers, and ``poll``, which waits for a step's outputs: the engine calls it in the
  ``outputs`` concurrency group, so a waiting poll never holds up a submit;
- ``phases()``: the set-up phases entered so far, the current one last (``starting``,
  ``joining the process group``, ``loading weights``, ``warming up the dispatcher``,
  ``capturing graphs``, ``ready``). The gang declares a ``progress`` concurrency group, and the
  launcher calls ``phases`` in it, so the answer comes while ``setup`` still runs (the start-up
  line).

The step loop runs in the session's thread; Ray calls (one thread, one at a time) only read
what it produced, so a collect costs the loop nothing but a lock.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request
from launch import process_group
from launch.rank_session import RankSession, RankStatus

__all__ = ["RankActor"]


class RankActor:
    """One rank in a Ray actor (see the module docstring)."""

    def __init__(self) -> None:
        self._session: RankSession | None = None
        self._rank: int | None = None
        # Replaced whole (never mutated): phases() reads it from the progress group's thread.
        self._phases: tuple[str, ...] = ("starting",)
        self._store_socket: socket.socket | None = None  # rank 0's, from rendezvous_port to setup

    def where(self) -> dict[str, Any]:
        """Where this actor landed: ``node_ip``, ``node_id``, ``gpu_ids`` (cluster numbering),
        ``pid``, ``hostname``."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def rendezvous_port(self) -> int:
        """A port bound (not yet listening) on this node's Ray address; setup() serves the
        group's store on it, so no other process can take it in between."""
        import ray

        if self._store_socket is None:
            self._store_socket = process_group.store_socket(ray.util.get_node_ip_address())
        return self._store_socket.getsockname()[1]

    def setup(self, spec: RankSpec, rank: int, world_size: int, master_addr: str, master_port: int,
              *, pg_timeout_s: float = process_group.DEFAULT_TIMEOUT_S,
              num_threads: int | None = None, show_progress: bool = False,
              worker_factory: Callable[[RankSpec, int, int], Any] | None = None) -> dict[str, Any]:
        """Join the process group and build the worker (collective). Returns the GroupInfo as a
        dict. ``num_threads`` caps torch's intra-op threads (the CPUs of the rank's bundle: more
        threads than cores makes every rank's small CPU ops many times slower)."""
        import ray
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        device = spec.runtime.device.type
        cuda_index = None
        if device == "cuda":
            cuda_index = process_group.local_cuda_index(ray.get_gpu_ids(),
                                                        os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._rank = rank
        self._set_phase("joining the process group")
        if world_size > 1:
            process_group.pin_interfaces(ray.util.get_node_ip_address())
            held, self._store_socket = self._store_socket, None
            info = process_group.init_process_group(rank, world_size, master_addr, master_port,
                                                    device=device, cuda_index=cuda_index,
                                                    timeout_s=pg_timeout_s,
                                                    store_socket=held if rank == 0 else None)
        else:
            if device == "cuda":
                torch.cuda.set_device(cuda_index or 0)
            info = process_group.GroupInfo(0, 1, "none", device)
        self._session = RankSession(spec, rank, world_size, show_progress=show_progress,
                                    worker_factory=worker_factory, on_phase=self._set_phase)
        self._set_phase("ready")
        return {"rank": info.rank, "world_size": info.world_size, "backend": info.backend,
                "device": info.device, "cuda_index": cuda_index}

    def _set_phase(self, name: str) -> None:
        self._phases = (*self._phases, name)

    def phases(self) -> tuple[str, ...]:
        """The set-up phases so far, the current one last (module docstring)."""
        return self._phases

    def submit(self, requests: Sequence[Request], wake: int | None = None) -> int:
        return self._live().submit(requests, wake)

    def start(self) -> None:
        self._live().start()

    def serve(self) -> None:
        self._live().serve()

    def abort(self, rids: Sequence[str], wake: int | None = None) -> None:
        self._live().abort(rids, wake)

    def wake(self, number: int, stop: bool = False) -> None:
        self._live().wake(number, stop)

    def collect(self) -> RankStatus:
        return self._live().collect()

    def poll(self, timeout_s: float) -> RankStatus:
        return self._live().poll(timeout_s)

    def health(self) -> dict[str, Any]:
        """Cheap liveness probe: pid and the session state (``none`` before setup)."""
        state = self._session.state() if self._session is not None else "none"
        return {"pid": os.getpid(), "rank": self._rank, "state": state}

    def stop(self, timeout_s: float = 10.0) -> str:
        """Close the worker, then destroy the process group (that order: the worker's graphs and
        sync use the group). Returns the session's final state."""
        final = "none"
        if self._session is not None:
            final = self._session.close(timeout_s)
        process_group.destroy_process_group()
        return final

    def _live(self) -> RankSession:
        if self._session is None:
            raise RuntimeError("RankActor: setup() has not run")
        return self._session
