"""Assembling a step's ForwardBatch over the paged KV cache: allocate the new tokens' slots,
write them into ``req_to_token``, and return the batch. The scheduler and the synthetic batches
of tests and benchmarks both build their batches here.

Shapes: B requests, T new tokens. ``rows`` are ``req_to_token`` rows; ``prefix_lens`` the tokens
each request already has in the cache (for decode: the position of its one new token).
A mixed step is an extend batch whose leading requests are decode rows (``decode_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.forward_batch import ForwardBatch
from dp_runtime.serving.kv_allocator import KVAllocator

__all__ = ["decode_forward_batch", "extend_forward_batch", "write_prefix"]


def _host_block(cache, n: int) -> torch.Tensor:
    # Pinned on CUDA, so the one copy to the device is asynchronous: building step N+1's batch
    # must not wait for step N (overlap). Each block is fresh from torch's pinned-memory cache,
    # which reuses a block only after the copy out of it has completed.
    return torch.empty(n, dtype=torch.int64, pin_memory=cache.device.type == "cuda")


def decode_forward_batch(
    allocator: KVAllocator,
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    input_ids: Sequence[int] | torch.Tensor | None = None,
    *,
    token_table: torch.Tensor | None = None,
) -> ForwardBatch:
    """A decode step: one new token per request, at position ``prefix_lens[i]`` of row ``rows[i]``.

    The input ids are ``input_ids`` (host values) or, with ``token_table`` (one entry per
    ``req_to_token`` row, on the device), ``token_table[rows]`` gathered on the device: the
    token each row sampled last, which the host may not have read yet. The per-request columns
    cross to the device in one asynchronous copy: ``[input_ids, positions, slots, rows,
    seq_lens]``."""
    if (input_ids is None) == (token_table is None):
        raise ValueError("decode_forward_batch: give exactly one of input_ids and token_table")
    cache = allocator.cache
    bs = len(rows)
    host = _host_block(cache, 5 * bs).view(5, bs)
    host[0] = 0 if input_ids is None else torch.as_tensor(input_ids, dtype=torch.int64)
    host[1] = torch.as_tensor(prefix_lens, dtype=torch.int64)
    host[2] = allocator.alloc_slots(bs, on_host=True)
    host[3] = torch.as_tensor(rows, dtype=torch.int64)
    torch.add(host[1], 1, out=host[4])
    allocator.record(host[3], host[1], host[2])
    dev = host.to(cache.device, non_blocking=True)
    ids, pos, slots, rows_t, seq_lens = dev.unbind(0)
    if token_table is not None:
        ids = token_table[rows_t]
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
    *,
    decode_rows: int = 0,
    token_table: torch.Tensor | None = None,
) -> ForwardBatch:
    """An extend step: request ``i`` appends ``extend_lens[i]`` tokens after its ``prefix_lens[i]``
    cached ones. Every column crosses to the device in one asynchronous copy.

    A mixed step (docs/model.md, "Mixed steps"): the first ``decode_rows`` requests are decode
    rows, one token each, whose ids are ``token_table[rows[:decode_rows]]`` gathered on the
    device (the token each row sampled last, which the host may not have read yet);
    ``input_ids`` then holds the ids of the tokens after them only. Raises ValueError unless
    there is one extend length >= 1 per request, the decode rows extend by 1, ``token_table``
    is given iff there are decode rows, and there is one input id per host-known token."""
    cache = allocator.cache
    ext = tuple(int(e) for e in extend_lens)
    prefix = tuple(int(p) for p in prefix_lens)
    if len(ext) != len(rows) or len(prefix) != len(rows) or min(ext, default=1) < 1:
        raise ValueError(
            "extend batch: need one extend length >= 1 and one prefix length per request, got "
            f"extend {list(ext)}, prefix {list(prefix)} for {len(rows)} requests"
        )
    d = int(decode_rows)
    if (not 0 <= d <= len(rows) or any(e != 1 for e in ext[:d])
            or (d > 0) != (token_table is not None)):
        raise ValueError(
            f"extend batch: decode_rows={d} must lie in [0, {len(rows)}], lead requests of extend "
            f"length 1 (got {list(ext[:d])}) and come with a token_table "
            f"(given: {token_table is not None})"
        )
    ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1).cpu()
    t, b = sum(ext), len(rows)
    if ids.numel() != t - d:
        raise ValueError(
            f"extend batch: {ids.numel()} input ids for {t - d} new tokens of known id "
            f"(extend lengths {list(ext)}, {d} decode rows)"
        )
    host = _host_block(cache, 4 * t + 4 * b)
    ids_h, pos_h, slots_h, tok_rows_h = host[: 4 * t].view(4, t).unbind(0)
    rows_h, seq_h, ext_h, prefix_h = host[4 * t :].view(4, b).unbind(0)
    ids_h[:d] = 0  # placeholders: the device gather below writes the decode rows' ids
    ids_h[d:].copy_(ids)
    rows_h.copy_(torch.as_tensor(rows, dtype=torch.int64))
    ext_h.copy_(torch.tensor(ext, dtype=torch.int64))
    prefix_h.copy_(torch.tensor(prefix, dtype=torch.int64))
    torch.add(prefix_h, ext_h, out=seq_h)
    # numpy, not torch: torch's CPU repeat_interleave took 1.6 ms a call on the H100 machine's
    # host (its thread pool), on the path of every extend step; np.repeat takes microseconds.
    ext_n = ext_h.numpy()
    tok_rows_h.numpy()[:] = np.repeat(rows_h.numpy(), ext_n)
    # Token j of request i sits at prefix_i + j: a ramp, shifted per request.
    first = np.cumsum(ext_n) - ext_n
    pos_h.numpy()[:] = np.arange(t) + np.repeat(prefix_h.numpy() - first, ext_n)
    slots_h.copy_(allocator.alloc_slots(t, on_host=True))
    allocator.record(tok_rows_h, pos_h, slots_h)
    dev = host.to(cache.device, non_blocking=True)
    ids_d, pos_d, slots_d, tok_rows_d = dev[: 4 * t].view(4, t).unbind(0)
    rows_d, seq_d, ext_d, prefix_d = dev[4 * t :].view(4, b).unbind(0)
    if d:
        # Stream order: after the step that sampled these tokens wrote the table. Decode rows
        # lead the batch, so their tokens are the first d and their rows the first d rows.
        # (On the CPU ``dev`` is the host block itself: harmless, it belongs to this batch.)
        torch.index_select(token_table, 0, rows_d[:d], out=ids_d[:d])
    cache.req_to_token[tok_rows_d, pos_d] = slots_d.to(torch.int32)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=b,
        input_ids=ids_d,
        positions=pos_d,
        out_cache_loc=slots_d,
        req_pool_indices=rows_d,
        seq_lens=seq_d,
        seq_lens_cpu=seq_h,
        extend_seq_lens=ext_d,
        extend_prefix_lens=prefix_d,
        extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=prefix,
    )


def write_prefix(allocator: KVAllocator, row: int, slots: torch.Tensor) -> None:
    """Row ``row``'s first ``len(slots)`` tokens live in ``slots`` (host int64: a prefix cache
    match, K/V already written): the allocator's host record, and one asynchronous copy and
    write of ``req_to_token[row, :n]`` (stream order puts it after the steps that used the row
    before and before the request's first step)."""
    cache = allocator.cache
    n = int(slots.numel())
    host = _host_block(cache, n)
    host.copy_(slots)
    allocator.record(torch.full((n,), int(row), dtype=torch.int64), torch.arange(n), host)
    cache.req_to_token[row, :n] = host.to(cache.device, non_blocking=True).to(torch.int32)
