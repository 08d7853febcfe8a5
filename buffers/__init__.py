"""buffers/: the per-rank input-buffer pool and the graph input registry (torch only).

This layer knows no model and no ForwardBatch class: it works on any dataclass by field name.
"""

from buffers.builders import build_decode_registry, build_prefill_registry
from buffers.pool import BufferNeed, BufferPool, PoolEntry
from buffers.registry import BufferRegistry
from buffers.share import share_input_buffers_in
from buffers.slot import KEEP, ZERO, Axis, FillSizes, Padding, Slot, fill, fill_once

__all__ = [
    "KEEP",
    "ZERO",
    "Axis",
    "BufferNeed",
    "BufferPool",
    "BufferRegistry",
    "FillSizes",
    "Padding",
    "PoolEntry",
    "Slot",
    "build_decode_registry",
    "build_prefill_registry",
    "fill",
    "fill_once",
    "share_input_buffers_in",
]
