"""GPU models the planner and the benchmarks know by name: usable memory, whether their GPUs talk
over NVLink, the dense bf16 tensor-core peak that MFU is measured against, and the HBM bandwidth
that bytes floors are measured against."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GIB", "GPUS", "GpuSpec", "gpu_spec", "gpu_spec_for_device", "measure_copy_bandwidth"]

GIB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model: the memory torch reports as its total (``total_memory``), whether its GPUs
    talk over NVLink (what ``dispatcher="auto"`` needs to pick FlashInfer), and the vendor's
    dense (not 2:4 sparse) bf16 tensor-core peak in TFLOP/s, with fp32 accumulation."""

    name: str
    mem_bytes: int
    nvlink: bool
    bf16_dense_tflops: float
    hbm_bytes_per_s: float  # the vendor's peak HBM bandwidth: the denominator of bytes floors


def _gib(x: float) -> int:
    return round(x * GIB)


# Usable memory = torch.cuda.get_device_properties(i).total_memory, which is below the marketing
# size (e.g. an "80GB" H100 reports ~79.1 GiB: "total capacity of 79.1x GiB" in OOM messages).
# Rounded figures; pass --gpu-mem-gib for an exact one. Peaks: the datasheets' dense bf16 tensor
# figures (Hopper's datasheets quote them with 2:4 sparsity: halved here).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 80GB SXM", _gib(79.1), True, 989.4, 3.35e12),
    "h100-pcie": GpuSpec("H100 80GB PCIe", _gib(79.1), False, 756.5, 2.0e12),
    "h200": GpuSpec("H200 141GB SXM", _gib(139.8), True, 989.4, 4.8e12),
    "a100-80gb": GpuSpec("A100 80GB SXM", _gib(79.15), True, 312.0, 2.039e12),
    "a100-40gb": GpuSpec("A100 40GB SXM", _gib(39.39), True, 312.0, 1.555e12),
    "l40s": GpuSpec("L40S 48GB", _gib(44.39), False, 362.1, 0.864e12),
    "rtx-4090": GpuSpec("RTX 4090 24GB", _gib(23.6), False, 165.2, 1.008e12),
}
_GPU_ALIASES = {"h100-sxm": "h100", "h100-80gb": "h100", "h200-141gb": "h200", "a100": "a100-80gb",
                "4090": "rtx-4090"}


def gpu_spec(name: str) -> GpuSpec:
    """The GpuSpec of ``name`` (case, spaces and underscores ignored: "H100", "a100_80gb").

    Raises ValueError listing the known names.
    """
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give --gpu-mem-gib)")
    return GPUS[key]


def gpu_spec_for_device(device_name: str) -> GpuSpec | None:
    """The GpuSpec of a ``torch.cuda.get_device_name()`` string ("NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 4090"), or None for a model not listed (an
    H100 NVL, whose figures differ, included)."""
    n = device_name.lower()
    if "h200" in n:
        return GPUS["h200"]
    if "h100" in n:
        return None if "nvl" in n else GPUS["h100-pcie" if "pcie" in n else "h100"]
    if "a100" in n:  # the PCIe cards' bandwidth and clocks differ from the SXM ones listed
        return None if "pcie" in n else GPUS["a100-40gb" if "40gb" in n else "a100-80gb"]
    if "l40s" in n:
        return GPUS["l40s"]
    if "4090" in n:
        return GPUS["rtx-4090"]
    return None


def measure_copy_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy on ``device`` (read + write counted):
    the bandwidth the benchmarks' bytes floors use where no spec applies, or beside it."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * n * 10 / (start.elapsed_time(end) / 1e3)
