"""RMSNorm and rotary embedding, as torch ops or as FlashInfer's fused kernels.

At batch size 1 a decode step of a 48-layer MoE is bound by kernel count, not bytes: written
with torch ops an RMSNorm is about 8 kernels and a rotary embedding about 15, four norms and
one rotary per layer. FlashInfer's ``rmsnorm`` and ``apply_rope_with_cos_sin_cache_inplace``
do each in one. ``elementwise_ops(device, dtype)`` picks them where they run (CUDA, bf16/fp16,
flashinfer importable) and the torch versions elsewhere; the model asks once, at construction.
Both compute in float32 inside and return the input dtype; they differ only in rounding order.
"""

from __future__ import annotations

import importlib.util

import torch

from dp_runtime.model.layers import RotaryEmbedding, rms_norm

__all__ = ["FlashInferOps", "TorchOps", "elementwise_ops"]


class TorchOps:
    """The torch versions (CPU, float32, or without flashinfer)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @staticmethod
    def rope(rotary: RotaryEmbedding, q_THD: torch.Tensor, k_THD: torch.Tensor,
             positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.apply(q_THD, k_THD, positions_T)


class FlashInferOps:
    """FlashInfer's fused kernels (one launch each)."""

    name = "flashinfer"

    def __init__(self) -> None:
        import flashinfer

        self._norm = flashinfer.norm.rmsnorm
        self._rope = flashinfer.rope.apply_rope_with_cos_sin_cache_inplace

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.shape[0] == 0:  # an IDLE rank's eager forward: the kernel refuses an empty grid
            return torch.empty_like(x)
        # q and k arrive as strided views of the fused QKV output: the kernel wants rows.
        return self._norm(x.contiguous(), weight, eps)

    def rope(self, rotary: RotaryEmbedding, q_THD: torch.Tensor, k_THD: torch.Tensor,
             positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = q_THD.contiguous(), k_THD.contiguous()
        t, d = q.shape[0], q.shape[-1]
        if t == 0:
            return q, k
        self._rope(positions_T, q.view(t, -1), k.view(t, -1), d, rotary.cos_sin_PD, is_neox=True)
        return q, k


def elementwise_ops(device: torch.device, dtype: torch.dtype) -> TorchOps | FlashInferOps:
    """FlashInfer's kernels on CUDA in bf16/fp16 when flashinfer imports, else torch's."""
    if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and importlib.util.find_spec("flashinfer") is not None):
        return FlashInferOps()
    return TorchOps()
