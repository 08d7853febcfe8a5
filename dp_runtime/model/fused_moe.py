"""Whether the Triton fused MoE (``fused_moe_triton``) and routing (``routing_triton``) kernels
serve a device and dtype; importable without triton, so callers can decide and log the reason."""

from __future__ import annotations

import importlib

import torch

__all__ = ["fused_moe_supported"]


def fused_moe_supported(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """``(True, what runs)`` when the Triton expert and routing kernels serve activations of
    ``dtype`` on ``device``; else ``(False, why not)``, one line naming the missing piece."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"device is {device.type}: the Triton fused MoE needs a CUDA GPU"
    if dtype != torch.bfloat16:
        return False, f"dtype is {dtype}: the Triton fused MoE serves torch.bfloat16 only"
    try:
        triton = importlib.import_module("triton")
    except ImportError as exc:
        return False, f"triton is not importable ({exc})"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, f"GPU is sm{major}{minor}: bf16 tensor-core dots need sm80 or newer"
    return True, f"triton {triton.__version__} on sm{major}{minor}"
