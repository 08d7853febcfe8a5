"""What ``fused_moe_triton.fused_local_expert_sum`` takes, checked on the host before a launch
(shapes, strides and dtypes only: no device work, no sync): rows, ids and weights that agree,
expert stacks in model dtype or both FP8 (``fp8_blocks``) with the gate/up halves on whole
128-row blocks, the output buffer and the folded add+RMSNorm's residual and weight."""

from __future__ import annotations

from dp_runtime.model.fp8_blocks import Fp8BlockWeight

__all__ = ["check_expert_args"]


def check_expert_args(x_ND, local_ids_NK, weights_NK, w13_L2IH, w2_LHI, out_ND,
                      add_norm=None) -> None:
    """ValueError naming the argument, the shape it needs and the one it has."""
    if x_ND.dim() != 2:
        raise ValueError(f"x_ND: expected (N, H), got shape {tuple(x_ND.shape)}")
    n, h = x_ND.shape
    if local_ids_NK.dim() != 2 or local_ids_NK.shape[0] != n:
        raise ValueError(f"local_ids_NK: expected ({n}, K), got shape {tuple(local_ids_NK.shape)}")
    if tuple(weights_NK.shape) != tuple(local_ids_NK.shape):
        raise ValueError(f"weights_NK: expected shape {tuple(local_ids_NK.shape)}, "
                         f"got {tuple(weights_NK.shape)}")
    if isinstance(w13_L2IH, Fp8BlockWeight) != isinstance(w2_LHI, Fp8BlockWeight):
        raise ValueError("w13_L2IH and w2_LHI: both FP8 block weights or neither")
    if isinstance(w13_L2IH, Fp8BlockWeight) and (w13_L2IH.shape[1] // 2) % 128:
        raise ValueError(f"w13_L2IH: FP8 gate/up halves must end on 128-row blocks, "
                         f"got I={w13_L2IH.shape[1] // 2}")
    if len(w13_L2IH.shape) != 3 or w13_L2IH.shape[2] != h or w13_L2IH.shape[1] % 2:
        raise ValueError(f"w13_L2IH: expected (L, 2I, {h}), got shape {tuple(w13_L2IH.shape)}")
    num_local, inter = w13_L2IH.shape[0], w13_L2IH.shape[1] // 2
    if tuple(w2_LHI.shape) != (num_local, h, inter):
        raise ValueError(
            f"w2_LHI: expected {(num_local, h, inter)}, got shape {tuple(w2_LHI.shape)}")
    if out_ND is not None and (tuple(out_ND.shape) != (n, h) or out_ND.stride(1) != 1):
        raise ValueError(f"out_ND: expected ({n}, {h}) with unit column stride, got shape "
                         f"{tuple(out_ND.shape)} strides {out_ND.stride()}")
    if add_norm is not None:
        residual, norm_w, _ = add_norm
        if residual.shape != x_ND.shape or residual.stride(1) != 1 or residual.dtype != x_ND.dtype:
            raise ValueError(f"add_norm residual: expected {tuple(x_ND.shape)} {x_ND.dtype} with "
                             f"unit column stride, got {tuple(residual.shape)} {residual.dtype} "
                             f"strides {residual.stride()}")
        if norm_w.shape != (x_ND.shape[1],):
            raise ValueError(
                f"add_norm weight: expected ({x_ND.shape[1]},), got {tuple(norm_w.shape)}")
