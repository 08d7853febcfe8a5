"""Flattened KV index lists for paged kernels, built without a host-device sync.

For requests in rows ``req_pool_indices`` with ``lens`` tokens each, the list is
``req_to_token[row_0, :len_0] ++ req_to_token[row_1, :len_1] ++ ...`` and ``indptr`` its CSR
offsets. The host knows the lengths (``seq_lens_cpu``), so the total is a host int and the
device work has a static shape: no ``nonzero`` or boolean indexing, which would sync.
"""

from __future__ import annotations

import torch

__all__ = ["build_kv_indices", "host_indptr"]


def host_indptr(lens_cpu: torch.Tensor) -> torch.Tensor:
    """CSR offsets ``[0, l0, l0+l1, ...]`` (int32, host; pinned when CUDA is present, so a
    ``non_blocking`` copy to the device does not wait for the stream)."""
    n = int(lens_cpu.shape[0])
    out = torch.empty(n + 1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    out[0] = 0
    torch.cumsum(lens_cpu.to(torch.int32), 0, out=out[1:])
    return out


def build_kv_indices(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor, total: int
) -> torch.Tensor:
    """The flattened KV slots (int32, ``total``,) of the first ``lens[i]`` tokens of each row.

    ``total`` must equal ``lens.sum()`` (the caller knows it on the host).
    """
    device = req_to_token.device
    if total == 0:
        return torch.empty(0, dtype=torch.int32, device=device)
    lens = lens.to(torch.int64)
    ends = torch.cumsum(lens, 0)
    pos = torch.arange(total, device=device)
    row = torch.searchsorted(ends, pos, right=True)  # which request each position belongs to
    col = pos - (ends - lens)[row]
    return req_to_token[req_pool_indices[row], col]
