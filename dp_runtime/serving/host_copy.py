"""Small tensors between host and device without waiting: the one way a step's host-built
tensors (rows, seeds, bias and count indices) reach the logits' device, and its results (ids,
flags, logprobs) come back, so neither direction syncs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["device_to_host", "host_to_device"]


def host_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, through pinned memory on CUDA: the copy is queued
    on the stream without waiting for it (a step's host work overlaps the step before)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def device_to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of CUDA tensor ``t``, queued on the stream: read it after an event
    recorded behind it."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
