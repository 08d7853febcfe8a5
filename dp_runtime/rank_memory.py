"""A rank's GPU memory, measured before its KV cache is sized and checked before it serves.

The KV cache takes what is left, so every other consumer must be known first (vLLM sizes its
cache after a profiling forward for the same reason). On CUDA, with no ``kv_cache_tokens`` given:

1. **Profile** (``profile_largest_step``): after the weights, the dispatcher and its warm-up,
   eager forwards of the largest steps the rank accepts (``run_largest_step``: the token budget
   spread over ``max_running_requests`` requests, and as one request within the context) against a
   one-request KV cache with its own attention backend; the peak allocation growth over it,
   that cache and that backend's workspaces included, is what the real step will need on top
   of the real cache (whose backend takes the same workspaces).
2. **Size** (``memory_sizing.kv_budget_bytes``): ``kv_mem_fraction`` of what is free after the
   profile, less the peak and less the graphs' reserve (``graph_reserve_bytes``: the graphs are
   captured after the cache, whose addresses they bake in, so they are reserved from an estimate
   with a margin, ``memory_estimates``, and their measured size is reported beside it). What
   else is held then is recorded too: torch's reserved memory beyond the weights, the
   penalties' count and mark tables (``serving/penalty_counts.py``, allocated before the profile)
   and the pool (``allocator_cache``, ``memory_estimates.allocator_cache_bytes``) and the memory
   outside torch (``cuda_context``: the CUDA context and kernel modules).
3. **Check** (``check_largest_step``): once the graphs are captured, the largest step runs once
   more, eagerly, against the real cache. A configuration that cannot run it is refused at start
   with the numbers, never out of memory mid-serving.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from buffers.pool import BufferPool
from dp_runtime import memory_estimates as me
from dp_runtime import memory_sizing as ms
from dp_runtime.attention import make_attention_backend
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.forward_batch import capture_batch
from dp_runtime.serving.kv_cache import KVCache
from dp_runtime.serving.step_tokens import worst_case_draw
from dp_runtime.sync.step_plan import plan_step
from dp_runtime.sync.step_table import StepTable
from graph import AttentionSplit

__all__ = ["check_largest_step", "eager_step", "graph_reserve_bytes", "make_kv_cache",
           "measured_kv_slots", "profile_largest_step", "run_largest_step"]

logger = logging.getLogger("dp_runtime")

_GIB = 2**30


def run_largest_step(eager: Any, cfg: Any, device: torch.device, context_len: int) -> None:
    """One eager forward of each largest step and its costliest draw, on every rank alike (a
    collective when the dispatcher exchanges; the batch carries the plan it lays out from): the
    token budget over the most requests (``memory_sizing.largest_step_tokens``: the most logit
    rows); as one request as long as the context allows (an attention backend that forms a
    request's scores, SDPA's, needs most for the longest request); and as one request's last
    chunk after a prefix that fills the context (a prompt's later chunk or a cached prefix: the
    attention then also reads the prefix, and FlashInfer merges a second pass over it). Its
    requests all read request row 0 and KV slot 0, the padding targets, as a graph capture's do:
    nothing live is touched."""
    tokens, requests = ms.largest_step_tokens(cfg, context_len)
    last = min(tokens, context_len - 1)
    shapes = ([(tokens, requests, 0), (min(tokens, context_len), 1, 0)]
              + ([(last, 1, context_len - last)] * (last > 0)))
    # dict.fromkeys: one forward where two shapes are one (a single request of the budget)
    for n, reqs, prefix in dict.fromkeys(shapes):
        plan = plan_step(StepTable.from_counts([n] * cfg.dp_size, can_run_graph=False,
                                               is_extend=True), cfg)
        batch = capture_batch(reqs, n, plan, device=device, forward_mode=ForwardMode.EXTEND,
                              prefix_len=prefix)
        worst_case_draw(eager.run(batch))


def profile_largest_step(run_with_kv: Callable[[Any], None], make_kv: Callable[[], Any],
                         device: torch.device) -> int:
    """Peak bytes allocated over ``run_with_kv(kv)`` on a fresh ``make_kv()`` (a one-request
    cache), counted from what was allocated before the cache; everything it made is freed after
    (module docstring, step 1)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    kv = make_kv()
    try:
        run_with_kv(kv)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    finally:
        del kv
        gc.collect()  # the probe backend and runner hold the probe cache through cycles
        torch.cuda.empty_cache()


def graph_reserve_bytes(spec: Any, graphs: bool, attention: str) -> int:
    """What the rank's graphs are expected to take, with the margin:
    ``memory_estimates.graph_reserve_bytes`` of ``rank_graph_pool_bytes_estimate`` (0 without
    graphs), the function the planner predicts with."""
    estimate = me.rank_graph_pool_bytes_estimate(spec.model_config(), spec.runtime,
                                                 spec.context_len, attention=attention,
                                                 graphs=graphs)
    return me.graph_reserve_bytes(estimate)


def check_largest_step(run: Callable[[], None], device: torch.device,
                       memory: dict[str, int]) -> None:
    """Run the largest step against the real cache (module docstring, step 3). RuntimeError
    naming every component in GiB when it runs out of memory."""
    try:
        run()
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        free, total = torch.cuda.mem_get_info(device)
        parts = ", ".join(f"{k} {v / _GIB:.2f}" for k, v in memory.items())
        raise RuntimeError(
            f"RankWorker: the largest step does not fit on {device} ({total / _GIB:.2f} "
            f"GiB, {free / _GIB:.2f} free after it failed; components in GiB: {parts}): lower "
            "chunked_prefill_size, max_running_requests or kv_mem_fraction"
        ) from None


def eager_step(eager: Any, batch: Any, device: torch.device,
               memory: dict[str, int]) -> torch.Tensor:
    """``eager.run(batch)``'s logits; on CUDA its allocation growth raises
    ``memory["activation_peak"]`` where larger (what a serving step really took)."""
    if device.type != "cuda":
        return eager.run(batch)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    logits = eager.run(batch)
    peak = torch.cuda.max_memory_allocated(device) - before
    memory["activation_peak"] = max(memory["activation_peak"], int(peak))
    return logits


def make_kv_cache(spec: Any, num_slots: int, device: torch.device,
                  max_reqs: int | None = None) -> KVCache:
    """The rank's paged KV cache of ``num_slots`` slots (``max_reqs``: its request rows, by
    default ``max_running_requests``)."""
    mc = spec.model_config()
    return KVCache(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                   num_slots=num_slots, max_reqs=max_reqs or spec.runtime.max_running_requests,
                   max_context_len=spec.context_len, dtype=spec.runtime.kv_cache_dtype,
                   device=device)


def measured_kv_slots(spec: Any, model: Any, device: torch.device, choices: Any,
                      eager_runner: Callable[[Any, Any], Any], pool: BufferPool,
                      memory: dict[str, int], on_phase: Callable[[str], None]) -> int:
    """The KV slots of a rank: ``memory_sizing.kv_slots_for_rank`` when they are given or the
    device is not CUDA; else measured (module docstring, steps 1-2), with ``activation_peak``,
    ``graph_reserve``, ``allocator_cache`` (torch's reserved memory less ``memory["weights"]``,
    ``memory["penalty_counts"]`` and the device bytes of ``pool``, the rank's buffer pool) and
    ``cuda_context`` (device memory outside torch's allocator: total - free - reserved) recorded
    in ``memory``: total - free at sizing is those two, the weights, the penalty tables and the
    pool. ``eager_runner(model, backend)`` makes the rank's eager runner of a model over an
    attention backend; the profile runs a copy of ``model`` bound to a probe backend and cache, so
    ``model`` itself stays unbound (it is bound once, to the real cache). RuntimeError with the
    numbers when one request of the full context does not fit."""
    cfg, mc = spec.runtime, spec.model_config()
    memory["activation_peak"] = 0
    if spec.kv_cache_tokens is not None or device.type != "cuda":
        return ms.kv_slots_for_rank(spec, device)
    on_phase("profiling memory")

    def run_with_kv(kv: KVCache) -> None:
        backend = make_attention_backend(choices.attention, kv, mc, q_dtype=cfg.dtype)
        probe = model.with_attention(AttentionSplit(backend))
        run_largest_step(eager_runner(probe, backend), cfg, device, spec.context_len)

    peak = profile_largest_step(run_with_kv, lambda: make_kv_cache(spec, 1, device), device)
    reserve = graph_reserve_bytes(spec, choices.graphs, choices.attention)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    budget = ms.kv_budget_bytes(free, peak, reserve, spec.kv_mem_fraction)
    slots = ms.kv_slots_for_budget(mc, cfg.kv_cache_dtype, budget, cfg.max_running_requests,
                                   spec.context_len)
    memory.update(activation_peak=int(peak), graph_reserve=reserve,
                  cuda_context=int(total - free - reserved),
                  allocator_cache=int(reserved - memory["weights"] - memory.get("penalty_counts", 0)
                                      - ms.pool_device_bytes(pool)))
    if slots < spec.context_len:
        raise RuntimeError(
            f"RankWorker: {free / _GIB:.2f} GiB free after the weights, less the largest "
            f"step's {peak / _GIB:.2f} GiB and the graphs' reserve {reserve / _GIB:.2f} GiB, times "
            f"kv_mem_fraction={spec.kv_mem_fraction}, gives {slots} KV slots; one request of "
            f"max_context_len={spec.context_len} needs more (lower chunked_prefill_size or "
            "max_running_requests)")
    return slots
