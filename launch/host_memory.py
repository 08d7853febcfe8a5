"""Whether the ranks that run on this machine's CPU fit its memory, checked before loading.

A CPU rank holds its weights and its KV cache in host memory; a model too big for it would be
an allocator traceback (or the kernel's OOM killer) once loading began. ``check_host_memory``
refuses it first, one line with the numbers: the bytes the ranks need (weights of each rank's
experts, its KV cache as ``memory_sizing.kv_slots_for_rank`` sizes it on CPU) against the bytes
available (``MemAvailable`` of /proc/meminfo: free memory plus what the kernel can reclaim).
The forward pass's own activations come on top, so passing is necessary, not sufficient.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from launch.cli_errors import UsageError

if TYPE_CHECKING:
    from dp_runtime.rank_spec import RankSpec

__all__ = ["available_host_bytes", "check_host_memory", "host_bytes_needed"]

GIB = 2**30


def host_bytes_needed(spec: RankSpec, ranks: int) -> tuple[int, int]:
    """``(weights, kv cache)`` bytes of ranks 0..ranks-1 of ``spec`` on CPU."""
    import torch

    from dp_runtime.memory_sizing import kv_cache_bytes, kv_slots_for_rank, weight_bytes_per_rank

    rt, mc = spec.runtime, spec.model_config()
    ep = rt.ep_size
    weights = sum(weight_bytes_per_rank(mc, rt.dtype, r % ep, ep) for r in range(ranks))
    slots = kv_slots_for_rank(spec, torch.device("cpu"))
    kv = ranks * kv_cache_bytes(mc, rt.kv_cache_dtype, slots, rt.max_running_requests,
                                spec.context_len)
    return weights, kv


def available_host_bytes() -> int | None:
    """Bytes of memory available to new allocations (``MemAvailable``; elsewhere the free
    physical pages), or None when the system says neither."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(spec: RankSpec, ranks_here: int, model: str,
                      available: int | None = None) -> None:
    """Raise UsageError (naming ``--model`` as typed and both numbers) when ``ranks_here`` CPU
    ranks of ``spec`` need more host memory than is available. Nothing for CUDA ranks."""
    if spec.runtime.device.type != "cpu" or ranks_here < 1:
        return
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    weights, kv = host_bytes_needed(spec, ranks_here)
    if weights + kv > available:
        ranks = f"{ranks_here} CPU ranks need" if ranks_here > 1 else "1 CPU rank needs"
        dtype = str(spec.runtime.dtype).removeprefix("torch.")
        raise UsageError(
            f"--model {model}: {ranks} {(weights + kv) / GIB:.2f} GiB of host memory "
            f"(weights {weights / GIB:.2f} GiB in {dtype}, KV cache "
            f"{kv / GIB:.2f} GiB), more than the {available / GIB:.2f} GiB available here "
            f"({weights + kv} > {available} bytes); use a smaller model, fewer ranks or "
            f"--device cuda")
