"""Which Ray cluster a run uses, and which device its ranks get.

``connect_ray(address)``:

- ``None``: inside a Ray job (``ray job submit`` sets RAY_ADDRESS) join that cluster; otherwise
  start a private local one (``address="local"``: never silently join a cluster someone else
  started on this machine), with no dashboard and ``num_cpus`` logical CPUs;
- ``"auto"``: join the running cluster found on this node (error if none);
- anything else (``host:port``, ``ray://...``): join that address.

Returns True when this call started Ray, so the caller knows to ``ray.shutdown()`` it.
"""

from __future__ import annotations

import os

__all__ = ["cluster_device", "connect_ray"]


def connect_ray(address: str | None = None, *, num_cpus: int | None = None, log_to_driver: bool = True) -> bool:
    """Connect this process to Ray (module docstring); True when Ray was initialised here."""
    import ray

    if ray.is_initialized():
        return False
    if address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
                 configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=log_to_driver, configure_logging=False)
    return True


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
