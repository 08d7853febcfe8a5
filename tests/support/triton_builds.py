"""How many kernels Triton has built for one ``@triton.jit`` function: the GPU tests that a new
step size builds nothing count them before and after."""

from __future__ import annotations

import pytest
import torch


def compiled_variants(kernel) -> int:
    """Kernels Triton has built for ``kernel`` on the current GPU (its per-device cache), or
    skip the test where this Triton keeps no such cache."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel cache to count")
    return len(caches[torch.cuda.current_device()][0])
