"""Synthetic requests and batches for tests and benchmarks, until the scheduler exists.

``add_requests`` gives each request a row of ``req_to_token`` and random K/V for its context;
``decode_batch`` / ``extend_batch`` allocate the slots of the new tokens, write them into the
table, and return the ForwardBatch that a scheduler would build, advancing the requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dp_runtime.forward_batch import ForwardBatch
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.kv_allocator import KVAllocator

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


def _counts(n: int, global_num_tokens_cpu: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(int(c) for c in global_num_tokens_cpu) if global_num_tokens_cpu is not None else (n,)


def decode_batch(
    allocator: KVAllocator,
    requests: Sequence[SyntheticRequest],
    input_ids: Sequence[int] | torch.Tensor,
    *,
    global_num_tokens_cpu: Sequence[int] | None = None,
) -> ForwardBatch:
    """A decode step of ``requests`` (one new token each); each request's ``seq_len`` grows by 1."""
    cache = allocator.cache
    dev = cache.device
    bs = len(requests)
    slots = allocator.alloc_slots(bs)
    rows = torch.tensor([r.row for r in requests], dtype=torch.int64)
    pos = torch.tensor([r.seq_len for r in requests], dtype=torch.int64)
    cache.req_to_token[rows.to(dev), pos.to(dev)] = slots.to(torch.int32)
    for r in requests:
        r.seq_len += 1
    seq_lens = pos + 1
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=torch.as_tensor(input_ids, dtype=torch.int64).to(dev),
        positions=pos.to(dev),
        out_cache_loc=slots,
        req_pool_indices=rows.to(dev),
        seq_lens=seq_lens.to(dev),
        seq_lens_cpu=seq_lens,
        global_num_tokens_cpu=_counts(bs, global_num_tokens_cpu),
        global_num_tokens_for_logprob_cpu=_counts(bs, global_num_tokens_cpu),
    )


def extend_batch(
    allocator: KVAllocator,
    requests: Sequence[SyntheticRequest],
    extend_lens: Sequence[int],
    input_ids: Sequence[int] | torch.Tensor,
    *,
    global_num_tokens_cpu: Sequence[int] | None = None,
) -> ForwardBatch:
    """An extend step: request i appends ``extend_lens[i]`` tokens after its cached prefix."""
    cache = allocator.cache
    dev = cache.device
    ext = [int(e) for e in extend_lens]
    if len(ext) != len(requests) or min(ext, default=1) < 1:
        raise ValueError(f"extend_batch: need one extend length >= 1 per request, got {ext} for {len(requests)}")
    total = sum(ext)
    slots = allocator.alloc_slots(total)
    prefix = [r.seq_len for r in requests]
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext, strict=True)])
    rows_t = torch.cat([torch.full((e,), r.row) for r, e in zip(requests, ext, strict=True)])
    cache.req_to_token[rows_t.to(dev), positions.to(dev)] = slots.to(torch.int32)
    for r, e in zip(requests, ext, strict=True):
        r.seq_len += e
    seq_lens = torch.tensor([r.seq_len for r in requests], dtype=torch.int64)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(requests),
        input_ids=torch.as_tensor(input_ids, dtype=torch.int64).to(dev),
        positions=positions.to(dev),
        out_cache_loc=slots,
        req_pool_indices=torch.tensor([r.row for r in requests], dtype=torch.int64, device=dev),
        seq_lens=seq_lens.to(dev),
        seq_lens_cpu=seq_lens,
        extend_seq_lens=torch.tensor(ext, dtype=torch.int64, device=dev),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int64, device=dev),
        extend_seq_lens_cpu=tuple(ext),
        extend_prefix_lens_cpu=tuple(prefix),
        global_num_tokens_cpu=_counts(total, global_num_tokens_cpu),
        global_num_tokens_for_logprob_cpu=_counts(total, global_num_tokens_cpu),
    )
