"""Which Ray cluster a run uses, and which device its ranks get.

``connect_ray(address)``:

- ``None``: inside a Ray job (``ray job submit`` sets RAY_ADDRESS) join that cluster; otherwise
  start a private local one (``address="local"``: never silently join a cluster someone else
  started on this machine), with no dashboard and ``num_cpus`` logical CPUs;
- ``"auto"``: join the running cluster found on this node (error if none);
- anything else (``host:port``, ``ray://...``): join that address.

Returns True when this call started Ray, so the caller knows to ``stop_ray()`` it.

Ctrl-C while Ray starts or stops is held until that step is over (``interrupts.held_sigint``):
then Ray is shut down and KeyboardInterrupt raised, so an interrupt never leaves a half-started
node's processes behind.
"""

from __future__ import annotations

import os

from launch.interrupts import held_sigint

__all__ = ["cluster_device", "connect_ray", "joins_existing_cluster", "stop_ray"]


def joins_existing_cluster(address: str | None) -> bool:
    """Whether ``connect_ray(address)`` joins a running cluster (an address, or RAY_ADDRESS set by
    ``ray job submit``) rather than starting a private one."""
    return address is not None or bool(os.environ.get("RAY_ADDRESS"))


def connect_ray(address: str | None = None, *, num_cpus: int | None = None, log_to_driver: bool = True) -> bool:
    """Connect this process to Ray (module docstring); True when Ray was initialised here.
    Raises KeyboardInterrupt after a clean shutdown when Ctrl-C came while Ray started."""
    import ray

    if ray.is_initialized():
        return False
    try:
        with held_sigint():
            if not joins_existing_cluster(address):
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
                         configure_logging=False)
            else:
                ray.init(address=address, log_to_driver=log_to_driver, configure_logging=False)
    except BaseException:
        # Interrupted, or init failed part-way: whatever it started goes with it.
        stop_ray()
        raise
    return True


def stop_ray() -> None:
    """``ray.shutdown()`` with Ctrl-C held until it is done (a second Ctrl-C while the cluster
    stops must not leave its agents running)."""
    import ray

    with held_sigint():
        ray.shutdown()


def cluster_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when the connected cluster has a GPU, else ``cpu``; ``cpu``/``cuda``
    pass through (``cuda`` on a cluster without GPUs raises ValueError naming the resources)."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if requested == "auto":
        return "cuda" if gpus >= 1 else "cpu"
    if requested == "cuda" and gpus < 1:
        raise ValueError(f"device='cuda' but the Ray cluster has no GPU (resources: {ray.cluster_resources()})")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    return requested
