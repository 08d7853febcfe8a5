"""Synthetic requests and batches for tests and benchmarks that drive a model without a scheduler.

``add_requests`` gives each request a row of ``req_to_token`` and random K/V for its context;
``decode_batch`` / ``extend_batch`` build the step's ForwardBatch the way the scheduler does
(``paged_batches``) and advance the requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dp_runtime.serving.forward_batch import ForwardBatch
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.paged_batches import decode_forward_batch, extend_forward_batch

__all__ = ["SyntheticRequest", "add_requests", "decode_batch", "extend_batch"]


@dataclass
class SyntheticRequest:
    row: int  # its req_to_token row
    seq_len: int  # tokens in the KV cache


def add_requests(
    allocator: KVAllocator, context_lens: Sequence[int], *, seed: int = 0, std: float = 1.0
) -> list[SyntheticRequest]:
    """New requests with ``context_lens`` tokens of random K/V (``randn(seed) * std``) cached."""
    cache = allocator.cache
    out, all_slots = [], []
    for n in context_lens:
        row = allocator.alloc_row()
        slots = allocator.alloc_slots(int(n))
        cache.req_to_token[row, : int(n)] = slots.to(torch.int32)
        all_slots.append(slots)
        out.append(SyntheticRequest(row, int(n)))
    if not all_slots:
        return out
    slots = torch.cat(all_slots)
    gen = torch.Generator(device=cache.device).manual_seed(seed)
    shape = (slots.shape[0], cache.num_kv_heads, cache.head_dim)
    for layer in range(cache.num_layers):
        for pool in (cache.k[layer], cache.v[layer]):
            pool[slots] = torch.randn(shape, generator=gen, device=cache.device).mul_(std).to(pool.dtype)
    return out


def decode_batch(
    allocator: KVAllocator,
    requests: Sequence[SyntheticRequest],
    input_ids: Sequence[int] | torch.Tensor,
) -> ForwardBatch:
    """A decode step of ``requests`` (one new token each); each request's ``seq_len`` grows by 1."""
    batch = decode_forward_batch(allocator, [r.row for r in requests], [r.seq_len for r in requests], input_ids)
    for r in requests:
        r.seq_len += 1
    return batch


def extend_batch(
    allocator: KVAllocator,
    requests: Sequence[SyntheticRequest],
    extend_lens: Sequence[int],
    input_ids: Sequence[int] | torch.Tensor,
) -> ForwardBatch:
    """An extend step: request i appends ``extend_lens[i]`` tokens after its cached prefix."""
    batch = extend_forward_batch(allocator, [r.row for r in requests], [r.seq_len for r in requests], extend_lens,
                                 input_ids)
    for r, e in zip(requests, batch.extend_seq_lens_cpu, strict=True):
        r.seq_len += e
    return batch
