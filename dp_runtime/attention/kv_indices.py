"""Flattened KV index lists for paged kernels, built without a host-device sync.

For requests in rows ``req_pool_indices`` with ``lens`` tokens each, the list is
``req_to_token[row_0, :len_0] ++ req_to_token[row_1, :len_1] ++ ...`` and ``indptr`` its CSR
offsets. The host knows the lengths (``seq_lens_cpu``), so the total is a host int and the
device work has a static shape: no ``nonzero`` or boolean indexing, which would sync.

The host-side inputs of a FlashInfer plan (page size 1) are pure functions of host lengths
(``host_indptr``, ``last_page_len``, ``extend_plan_inputs``), so CPU tests pin them against
hand-computed values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExtendPlanInputs", "build_kv_indices", "extend_plan_inputs", "host_indptr",
           "last_page_len"]


def _pin() -> bool:
    return torch.cuda.is_available()


def host_indptr(lens_cpu: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """CSR offsets ``[0, l0, l0+l1, ...]`` (int32, host; pinned when CUDA is present, so a
    ``non_blocking`` copy to the device does not wait for the stream). Written into the leading
    rows of ``scratch`` when given and long enough (a pinned allocation costs tens of us; the
    caller must know the previous use has been copied)."""
    n = int(lens_cpu.shape[0])
    if scratch is not None and scratch.shape[0] > n:
        out = scratch[: n + 1]
    else:
        out = torch.empty(n + 1, dtype=torch.int32, pin_memory=_pin())
    out[0] = 0
    torch.cumsum(lens_cpu.to(torch.int32), 0, out=out[1:])
    return out


def last_page_len(lens_cpu: torch.Tensor) -> torch.Tensor:
    """FlashInfer's ``paged_kv_last_page_len`` for page size 1 (int32, host, pinned with CUDA).

    A request with tokens has 1 token on its last page; one with none (an extend with no
    cached prefix, in the prefix pass) has no page and must say 0: FlashInfer's host planner
    computes lengths as ``max(pages - 1, 0) * page_size + last_page_len`` (``get_seq_lens``),
    so a 1 there would plan a length of 1 for an empty request.
    """
    out = torch.empty(int(lens_cpu.shape[0]), dtype=torch.int32, pin_memory=_pin())
    out.copy_(lens_cpu > 0)
    return out


@dataclass(frozen=True)
class ExtendPlanInputs:
    """Host-side plan inputs of one extend batch (page size 1, int32).

    ``qo_indptr``: CSR of the new tokens (the rows of q and of the output).
    ``kv_indptr`` / ``kv_last_page_len``: the whole sequence (prefix + new) of each request:
        the PAGED layout's KV, read from the cache after this step's K/V were written.
    ``prefix_indptr`` / ``prefix_last_page_len``: the cached prefix only: the RAGGED layout's
        paged (non-causal) pass; the ragged (causal) pass uses ``qo_indptr`` for its KV too.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    prefix_indptr: torch.Tensor
    prefix_last_page_len: torch.Tensor
    prefix_lens: torch.Tensor  # int64, host
    has_prefix: bool


def extend_plan_inputs(extend_lens_cpu: torch.Tensor,
                       seq_lens_cpu: torch.Tensor) -> ExtendPlanInputs:
    """The plan inputs of an extend batch from its host lengths (``seq_lens`` include the new
    tokens). Raises ValueError when a request extends by less than 1 or more than its length."""
    ext = extend_lens_cpu.to(torch.int64)
    seq = seq_lens_cpu.to(torch.int64)
    if ext.shape != seq.shape:
        raise ValueError(f"extend_plan_inputs: {ext.shape[0]} extend lengths for {seq.shape[0]} "
                         "sequence lengths")
    prefix = seq - ext
    if bool((ext < 1).any()) or bool((prefix < 0).any()):
        raise ValueError(
            f"extend_plan_inputs: every request needs 1 <= extend_len <= seq_len; "
            f"extend_lens={ext.tolist()}, seq_lens={seq.tolist()}"
        )
    return ExtendPlanInputs(
        qo_indptr=host_indptr(ext),
        kv_indptr=host_indptr(seq),
        kv_last_page_len=last_page_len(seq),
        prefix_indptr=host_indptr(prefix),
        prefix_last_page_len=last_page_len(prefix),
        prefix_lens=prefix,
        has_prefix=bool((prefix > 0).any()),
    )


def build_kv_indices(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor, total: int,
    indptr_cpu: torch.Tensor | None = None, *, indptr_dev: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The flattened KV slots (int32, ``total``,) of the first ``lens[i]`` tokens of each row,
    written into ``out`` when given (``total`` rows of it) and returned.

    ``total`` must equal ``lens.sum()`` (the caller knows it on the host). With the host CSR
    offsets ``indptr_cpu`` on CUDA and triton importable it is one kernel (and one copy of the
    offsets, none when the caller has them on the device as ``indptr_dev``); otherwise about
    eight torch ops.
    """
    device = req_to_token.device
    if total == 0:
        return torch.empty(0, dtype=torch.int32, device=device) if out is None else out[:0]
    if indptr_cpu is not None and device.type == "cuda" and _triton_gather is not None:
        return _triton_gather(req_to_token, req_pool_indices, indptr_cpu, total, indptr_dev, out)
    lens = lens.to(torch.int64)
    ends = torch.cumsum(lens, 0)
    pos = torch.arange(total, device=device)
    row = torch.searchsorted(ends, pos, right=True)  # which request each position belongs to
    col = pos - (ends - lens)[row]
    slots = req_to_token[req_pool_indices[row], col]
    return slots if out is None else out[:total].copy_(slots)


def _load_triton_gather():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _gather_rows_kernel(req_to_token_ptr, row_stride, rows_ptr, indptr_ptr, out_ptr,
                            BLOCK: tl.constexpr):
        i = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        start = tl.load(indptr_ptr + i)
        n = tl.load(indptr_ptr + i + 1) - start
        row = tl.load(rows_ptr + i).to(tl.int64)
        slots = tl.load(req_to_token_ptr + row * row_stride + j, mask=j < n)
        tl.store(out_ptr + start + j, slots, mask=j < n)

    def gather(req_to_token: torch.Tensor, rows: torch.Tensor, indptr_cpu: torch.Tensor, total: int,
               indptr_dev: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        bs = int(indptr_cpu.shape[0]) - 1
        longest = int((indptr_cpu[1:] - indptr_cpu[:-1]).max())
        indptr = (indptr_dev if indptr_dev is not None
                  else indptr_cpu.to(req_to_token.device, non_blocking=True))
        out = (torch.empty(total, dtype=torch.int32, device=req_to_token.device) if out is None
               else out[:total])
        block = 1024
        _gather_rows_kernel[(bs, triton.cdiv(longest, block))](
            req_to_token, req_to_token.stride(0), rows, indptr, out, BLOCK=block, num_warps=4)
        return out

    return gather


# One launch for the whole index list where triton runs (decode replays build it every step).
_triton_gather = _load_triton_gather()
