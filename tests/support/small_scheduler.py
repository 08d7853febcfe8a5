"""A Scheduler over a one-layer CPU KV cache: the scheduler's rules tested without a model (the
tests play the worker: they write ``last_tokens`` and hand tokens to ``advance``)."""

from __future__ import annotations

import torch

from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import KVCache
from dp_runtime.serving.scheduler import Scheduler


def small_scheduler(*, num_slots: int = 64, max_context_len: int = 32, max_running: int = 4,
                    chunk: int = 64, **scheduler_kw) -> Scheduler:
    """``num_slots`` KV slots, ``max_running`` request rows of ``max_context_len`` tokens,
    ``chunk`` the chunked-prefill size; ``scheduler_kw`` go to Scheduler (e.g. ``mixed_steps``,
    ``eos_token_ids``)."""
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=num_slots, max_reqs=max_running,
                    max_context_len=max_context_len, dtype=torch.float32, device="cpu")
    return Scheduler(KVAllocator(cache), max_running_requests=max_running, chunked_prefill_size=chunk,
                     **scheduler_kw)
