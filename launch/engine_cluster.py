"""The Ray cluster of one engine: joined (left alone at shutdown), or a private one on loopback
that the engine starts and stops.

Both calls run in the thread that starts the engine (``stop`` also at a shutdown after the
start): ``ray.shutdown`` beside a thread still inside Ray's calls can abort the process. A
private cluster's start is never cut in half; once stopped, Ray's auto-init is off, so a call
still on its way fails instead of bringing up a new cluster.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["EngineCluster"]


class EngineCluster:
    def __init__(self, options: Any, world_size: int) -> None:
        """``options``: the engine's (``EngineOptions``); no cluster unless its launcher is
        ``ray`` (then connect and stop do nothing)."""
        self.uses_ray = options.launcher == "ray"
        self.address = options.ray_address
        self.num_cpus = options.ray_num_cpus or max(world_size, os.cpu_count() or 1)
        self.ray_kwargs = dict(log_to_driver=options.log_to_driver, log_level=options.log_level)
        self._lock = threading.Lock()  # held while a private cluster starts or stops
        self._private = False  # a private cluster is starting or started (set before the lock)
        self._started = False

    def connect(self, on_phase: Callable[[str], None] | None, check: Callable[[], None]) -> None:
        """Join the cluster, or start the private one; ``check()`` raises when the engine is
        being shut down (then nothing starts)."""
        if not self.uses_ray:
            return
        from launch.ray_cluster import connect_ray, joins_existing_cluster

        joins = joins_existing_cluster(self.address)
        if on_phase is not None:
            on_phase(f"connecting to Ray ({self.address or 'RAY_ADDRESS'})" if joins
                     else f"starting Ray (a private local cluster, {self.num_cpus} CPUs)")
        if joins:
            connect_ray(self.address, num_cpus=self.num_cpus, **self.ray_kwargs)
            return
        self._private = True
        with self._lock:
            check()
            self._started = connect_ray(None, num_cpus=self.num_cpus, **self.ray_kwargs)

    def stop(self) -> None:
        """Stop the private cluster, if one was started (after its start is through)."""
        if not self._private:
            return
        with self._lock:
            if self._started:
                from ray._private import auto_init_hook

                from launch.ray_cluster import stop_ray

                auto_init_hook.enable_auto_connect = False  # module docstring
                stop_ray()
                self._started = False
