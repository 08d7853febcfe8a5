"""The checks a FlashInfer plan is guarded by: the batch's limits (always, on the host lengths
the plan is sized with) and, for debugging (``RuntimeConfig.flashinfer_checks``), device lengths
and KV indices against the host copies and the cache (these sync; skipped during a capture)."""

from __future__ import annotations

import torch

from dp_runtime.serving.kv_cache import KVCache

__all__ = ["check_lens", "verify_indices", "verify_lens"]


def check_lens(cache: KVCache, where: str, bs: int, lens_cpu: torch.Tensor, *, max_bs: int,
               max_bs_name: str, min_len: int) -> None:
    """A batch of ``bs`` requests with host KV lengths ``lens_cpu`` fits ``max_bs`` and the
    cache."""
    if bs > max_bs:
        raise ValueError(f"FlashInferBackend ({where}): a batch of {bs} requests exceeds "
                         f"{max_bs_name}={max_bs}")
    if int(lens_cpu.shape[0]) < bs:
        raise ValueError(f"FlashInferBackend ({where}): {int(lens_cpu.shape[0])} host sequence "
                         f"lengths for {bs} requests")
    if bs == 0:
        return
    lens = lens_cpu[:bs]
    longest, shortest = int(lens.max()), int(lens.min())
    limit = cache.max_context_len
    if longest > limit:
        raise ValueError(
            f"FlashInferBackend ({where}): request {int(lens.argmax())} has {longest} KV tokens, "
            f"more than the cache's max_context_len={limit}"
        )
    if shortest < min_len:
        raise ValueError(f"FlashInferBackend ({where}): request {int(lens.argmin())} has "
                         f"{shortest} KV tokens; at least {min_len} needed")


def _checking(enabled: bool, t: torch.Tensor) -> bool:
    return enabled and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def verify_lens(enabled: bool, cache: KVCache, where: str, rows: torch.Tensor, lens: torch.Tensor,
                lens_cpu: torch.Tensor) -> None:
    """Before the index list is built from them: the device lengths are the host ones the plan
    is sized with, the rows exist. Syncs."""
    if not _checking(enabled, lens):
        return
    dev_lens = lens.detach().to("cpu", torch.int64)
    host_lens = lens_cpu.to(torch.int64)
    if not torch.equal(dev_lens, host_lens):
        raise RuntimeError(
            f"FlashInferBackend ({where}): device sequence lengths {dev_lens.tolist()} differ from "
            f"the host copy {host_lens.tolist()} the plan was sized with"
        )
    rows_cpu = rows.detach().to("cpu", torch.int64)
    max_row = cache.req_to_token.shape[0] - 1
    if rows_cpu.numel() and (int(rows_cpu.min()) < 0 or int(rows_cpu.max()) > max_row):
        raise RuntimeError(f"FlashInferBackend ({where}): request rows {rows_cpu.tolist()} "
                           f"outside [0, {max_row}]")


def verify_indices(enabled: bool, cache: KVCache, where: str, indices: torch.Tensor) -> None:
    """Every KV index lies in the cache. Syncs."""
    if not _checking(enabled, indices) or not indices.numel():
        return
    idx = indices.detach().to("cpu", torch.int64)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi > cache.num_slots:
        raise RuntimeError(
            f"FlashInferBackend ({where}): KV indices span [{lo}, {hi}], outside the cache's slots "
            f"[0, {cache.num_slots}]"
        )
