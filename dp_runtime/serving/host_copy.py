"""Host values onto the device without waiting: the one way a step's small host-built tensors
(rows, seeds, bias and count indices) reach the logits' device, so building them never syncs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["host_to_device"]


def host_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, through pinned memory on CUDA: the copy is queued
    on the stream without waiting for it (a step's host work overlaps the step before)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
