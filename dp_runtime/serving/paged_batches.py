"""Assembling a step's ForwardBatch over the paged KV cache: allocate the new tokens' slots,
write them into ``req_to_token``, and return the batch. The scheduler and the synthetic batches
of tests and benchmarks both build their batches here.

Shapes: B requests, T new tokens. ``rows`` are ``req_to_token`` rows; ``prefix_lens`` the tokens
each request already has in the cache (for decode: the position of its one new token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.forward_batch import ForwardBatch
from dp_runtime.serving.kv_allocator import KVAllocator

__all__ = ["decode_forward_batch", "extend_forward_batch"]


def decode_forward_batch(
    allocator: KVAllocator,
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    input_ids: Sequence[int] | torch.Tensor,
) -> ForwardBatch:
    """A decode step: one new token per request, at position ``prefix_lens[i]`` of row ``rows[i]``.

    The five per-request columns cross to the device in one copy (a decode step is bound by
    launches and host time, not bytes): ``[input_ids, positions, slots, rows, seq_lens]``."""
    cache = allocator.cache
    bs = len(rows)
    host = torch.empty((5, bs), dtype=torch.int64)
    host[0] = torch.as_tensor(input_ids, dtype=torch.int64)
    host[1] = torch.as_tensor(prefix_lens, dtype=torch.int64)
    host[2] = allocator.alloc_slots(bs, on_host=True)
    host[3] = torch.as_tensor(rows, dtype=torch.int64)
    torch.add(host[1], 1, out=host[4])
    dev = host.to(cache.device)
    ids, pos, slots, rows_t, seq_lens = dev.unbind(0)
    cache.req_to_token[rows_t, pos] = slots.to(torch.int32)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=ids,
        positions=pos,
        out_cache_loc=slots,
        req_pool_indices=rows_t,
        seq_lens=seq_lens,
        seq_lens_cpu=host[4],
    )


def extend_forward_batch(
    allocator: KVAllocator,
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    input_ids: Sequence[int] | torch.Tensor,
) -> ForwardBatch:
    """An extend step: request ``i`` appends ``extend_lens[i]`` tokens after its ``prefix_lens[i]``
    cached ones. Raises ValueError unless there is one extend length >= 1 per request."""
    cache = allocator.cache
    dev = cache.device
    ext = tuple(int(e) for e in extend_lens)
    prefix = tuple(int(p) for p in prefix_lens)
    if len(ext) != len(rows) or len(prefix) != len(rows) or min(ext, default=1) < 1:
        raise ValueError(
            f"extend batch: need one extend length >= 1 and one prefix length per request, got extend {list(ext)}, "
            f"prefix {list(prefix)} for {len(rows)} requests"
        )
    total = sum(ext)
    slots = allocator.alloc_slots(total)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext, strict=True)])
    rows_t = torch.cat([torch.full((e,), int(r)) for r, e in zip(rows, ext, strict=True)])
    cache.req_to_token[rows_t.to(dev), positions.to(dev)] = slots.to(torch.int32)
    seq_lens = torch.tensor([p + e for p, e in zip(prefix, ext, strict=True)], dtype=torch.int64)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(rows),
        input_ids=torch.as_tensor(input_ids, dtype=torch.int64).to(dev),
        positions=positions.to(dev),
        out_cache_loc=slots,
        req_pool_indices=torch.tensor(list(rows), dtype=torch.int64, device=dev),
        seq_lens=seq_lens.to(dev),
        seq_lens_cpu=seq_lens,
        extend_seq_lens=torch.tensor(ext, dtype=torch.int64, device=dev),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int64, device=dev),
        extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=prefix,
    )
