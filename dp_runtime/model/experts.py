"""Routed experts of one MoE layer on one rank: grouped GEMM, or a dense loop where it is not.

Shapes: T tokens (N rows a dispatcher delivered), K experts per token, E experts (L local to
this rank), H hidden, I expert intermediate size. Weights: ``w13_E2IH`` (gate and up, stacked,
nn.Linear layout) and ``w2_EHI``.

Either may be Fp8BlockWeight stacks (``fp8_blocks``): they are dequantized here, the float
reference of the FP8 expert kernels. Both paths are capturable (no host sync, static shapes)
and deterministic: each token's K expert outputs are put back in (token, k) order and summed in
float32, never scattered with atomics, so replay and eager reduce in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dp_runtime.model.fp8_blocks import Fp8BlockWeight

__all__ = ["grouped_mm_supported", "local_expert_sum"]


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` serves this device and dtype (CUDA sm90+, bf16)."""
    if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16 or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _grouped(x_TH: torch.Tensor, ids_TK: torch.Tensor, w13_E2IH: torch.Tensor,
             w2_EHI: torch.Tensor) -> torch.Tensor:
    t, k = ids_TK.shape
    e = w13_E2IH.shape[0]
    flat = ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (T*K,) rows grouped by expert
    x_sorted = x_TH[order // k]
    # Group ends: how many sorted rows have expert id <= e (searchsorted: no host sync).
    offs = torch.searchsorted(flat[order], torch.arange(e, device=flat.device),
                              right=True).to(torch.int32)
    h = torch._grouped_mm(x_sorted, w13_E2IH.transpose(1, 2), offs=offs)
    del x_sorted  # intermediates go as soon as they are used: this runs on T*K rows
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate).mul_(up)
    del h, gate, up
    y_sorted = torch._grouped_mm(act, w2_EHI.transpose(1, 2), offs=offs)
    del act
    return torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(t, k, -1)


def _expert(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s weight in ``dtype``: an FP8 one dequantized (the reference path)."""
    return w.select(e).dequantize(dtype) if isinstance(w, Fp8BlockWeight) else w[e]


def _dense(x_TH: torch.Tensor, ids_TK: torch.Tensor, w13_E2IH, w2_EHI) -> torch.Tensor:
    # Every expert on every token, the result kept only where routed: E times the work, for
    # CPU tests and devices without grouped GEMM. FP8 experts are dequantized one at a time.
    t, k = ids_TK.shape
    out = x_TH.new_zeros((t, k, w2_EHI.shape[1]))
    for e in range(w13_E2IH.shape[0]):
        gate, up = (x_TH @ _expert(w13_E2IH, e, x_TH.dtype).T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ _expert(w2_EHI, e, x_TH.dtype).T
        out = torch.where((ids_TK == e)[..., None], y[:, None, :], out)
    return out


def local_expert_sum(
    x_ND: torch.Tensor,
    local_ids_NK: torch.Tensor,
    weights_NK: torch.Tensor,
    w13_L2IH: torch.Tensor,
    w2_LHI: torch.Tensor,
    *,
    use_grouped_mm: bool,
    out_ND: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rank-local half of an EP MoE layer: ``sum_k w[n, k] * expert_{id[n, k]}(x[n])`` over the
    picks this rank serves, for rows a dispatcher delivered (``dispatcher.ExpertInputs``).

    ``local_ids_NK`` holds rank-local expert ids; an id outside [0, L) (negative, or a later
    rank's expert in global ids shifted by this rank's first) marks a pick that belongs to
    another rank or a padding row, and adds nothing. Invalid picks are routed to a
    sink group ``L`` past the last expert (the grouped GEMM never computes it, the dense loop
    never visits it) and their terms are *selected* away, not multiplied by zero: rows that
    padding or a communication workspace left uninitialised may hold NaN. Writes ``out_ND`` when
    given (a dispatcher's expert output buffer) and returns it; capturable, no host sync.
    """
    n = x_ND.shape[0]
    if out_ND is None:
        out_ND = x_ND.new_empty((n, w2_LHI.shape[1]))
    if n == 0:
        return out_ND
    num_local = w13_L2IH.shape[0]
    if use_grouped_mm and isinstance(w13_L2IH, Fp8BlockWeight):
        # torch's grouped GEMM takes no block scales: the whole stack dequantized, per call (a
        # fallback: the Triton path runs FP8 experts where it runs)
        w13_L2IH, w2_LHI = w13_L2IH.dequantize(x_ND.dtype), w2_LHI.dequantize(x_ND.dtype)
    valid_NK = (local_ids_NK >= 0) & (local_ids_NK < num_local)
    ids_NK = torch.where(valid_NK, local_ids_NK.long(), num_local)
    # One (N, K, H) fp32 tensor, weighted and masked in place: at a full prefill chunk each
    # extra copy costs N*K*H*4 bytes (0.5 GiB for 8192 tokens of Qwen3-30B-A3B).
    terms_NKH = (_grouped if use_grouped_mm else _dense)(x_ND, ids_NK, w13_L2IH, w2_LHI).float()
    terms_NKH.mul_(weights_NK.float()[..., None]).masked_fill_(~valid_NK[..., None], 0.0)
    out_ND.copy_(terms_NKH.sum(1))
    return out_ND
