"""What the projection kernels (skinny_linear.py, stream_linear.py) take: ``x`` [M, K] and ``w``
[N, K] of one bf16/fp16 dtype on one device, unit stride along K, no bias. ``check_linear_args``
raises for what a kernel cannot take, naming the value and the limit; ``linear_layout_ok`` is
the ops seam's never-raising test of the same layout (what it refuses goes to F.linear, which
raises its own errors for shapes that do not fit).
"""

from __future__ import annotations

import os

import torch

__all__ = ["LINEAR_DTYPES", "check_linear_args", "linear_layout_ok", "linear_output"]

LINEAR_DTYPES = (torch.bfloat16, torch.float16)


def check_linear_args(kernel: str, x_MK: torch.Tensor, w_NK: torch.Tensor, *, max_rows: int,
                      max_rows_name: str) -> None:
    """Raise ValueError, starting with ``kernel``'s name, where it cannot take ``x_MK`` and
    ``w_NK`` (more than ``max_rows`` rows: the message names ``max_rows_name``). Reads only
    shapes, strides and dtypes: no device work."""
    if x_MK.dim() != 2 or w_NK.dim() != 2:
        raise ValueError(f"{kernel}: x and w must be 2-D, got x {tuple(x_MK.shape)} and "
                         f"w {tuple(w_NK.shape)}")
    m, k = x_MK.shape
    if m > max_rows:
        raise ValueError(f"{kernel}: x has {m} rows, more than {max_rows_name}={max_rows}")
    if w_NK.shape[1] != k:
        raise ValueError(f"{kernel}: x has K={k} columns but w has K={w_NK.shape[1]}")
    if x_MK.dtype not in LINEAR_DTYPES or w_NK.dtype != x_MK.dtype:
        raise ValueError(f"{kernel}: x and w must share a dtype of bfloat16/float16, got "
                         f"x {x_MK.dtype} and w {w_NK.dtype}")
    if x_MK.stride(1) != 1 or w_NK.stride(1) != 1:
        raise ValueError(f"{kernel}: x and w must be contiguous along K (stride 1), got "
                         f"strides x {x_MK.stride()} and w {w_NK.stride()}")
    if x_MK.device != w_NK.device:
        raise ValueError(f"{kernel}: x is on {x_MK.device} but w on {w_NK.device}")
    if not x_MK.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{kernel}: needs CUDA tensors, got {x_MK.device} "
                         "(TRITON_INTERPRET=1 runs it on CPU ones)")


def linear_layout_ok(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """No bias, CUDA tensors on one device, 2-D, one bf16/fp16 dtype, matching K, unit stride
    along K. Never raises."""
    return (
        b is None
        and x.is_cuda
        and x.device == w.device
        and x.dim() == 2
        and w.dim() == 2
        and x.dtype in LINEAR_DTYPES
        and w.dtype == x.dtype
        and x.shape[1] == w.shape[1]
        and x.stride(1) == 1
        and w.stride(1) == 1
    )


def linear_output(x_MK: torch.Tensor, w_NK: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(y, done)``: the [M, N] output in x's dtype, and whether it is complete without a launch
    (no rows or columns: empty; K = 0: zeros)."""
    m, k = x_MK.shape
    y_MN = torch.empty((m, w_NK.shape[0]), dtype=x_MK.dtype, device=x_MK.device)
    if y_MN.numel() == 0:
        return y_MN, True
    if k == 0:
        return y_MN.zero_(), True
    return y_MN, False
