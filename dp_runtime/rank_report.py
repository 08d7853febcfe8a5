"""What ``RankWorker.metrics()`` reports beside its step counters: the rank's queue and KV state
and the facts of its build (kernels, dispatcher, graphs, KV dtype, quantization, memory)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["rank_report"]


def rank_report(w: Any) -> dict[str, Any]:
    """``w``: a built RankWorker (not imported here: rank_worker.py imports this module)."""
    return dict(
        rank=w.rank, waiting=w.scheduler.num_waiting, running=len(w.scheduler.running),
        dispatcher=w.dispatcher_kind, attention=w.attention_kind, elementwise=w.model.ops.name,
        experts=w.model.experts.name, choices=dataclasses.asdict(w.choices),
        decode_attention=getattr(w.attention, "decode_kernels", w.attention_kind),
        graphs=w.graphs is not None, kv_slots=w.kv_cache.num_slots,
        kv_cache_dtype=str(w.kv_cache.dtype).removeprefix("torch."),
        quantization="none" if w.model_config.quantization is None else "fp8",
        memory=w.memory_report(), **w.scheduler.kv_metrics())
