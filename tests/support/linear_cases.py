"""Inputs and the error bound of the projection kernels' tests (tests/test_skinny_linear.py,
tests/test_stream_linear.py: each states why its summation term is what it is)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["UNIT_ROUNDOFF", "check_against_fp64", "linear_case"]

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def linear_case(m, n, k, dtype, device, seed=0):
    """``x`` [m, k] and ``w`` [n, k] of ``dtype`` on ``device``, outputs of order 1 as a
    layer's; the same seed gives the same tensors."""
    g = torch.Generator().manual_seed(seed * 7919 + m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    return x.to(device), w.to(device)


def check_against_fp64(y, x, w, *, sum_term: float, truncating: bool = False) -> None:
    """Each element of ``y`` within ``u * |ref| + sum_term * (|x| @ |w|.T)`` of float64 math on
    the same inputs; u is the output dtype's unit roundoff, twice it where the final cast
    truncates (Triton's CPU interpreter)."""
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype and y.device == x.device
    ref = F.linear(x.double(), w.double())
    sum_abs = F.linear(x.double().abs(), w.double().abs())
    u = UNIT_ROUNDOFF[x.dtype] * (2 if truncating else 1)
    excess = (y.double() - ref).abs() - (u * ref.abs() + sum_term * sum_abs)
    assert excess.max().item() <= 0, f"worst element exceeds its bound by {excess.max().item():.3g}"
