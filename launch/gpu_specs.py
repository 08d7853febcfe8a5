"""GPU models the planner knows by name: usable memory and whether their GPUs talk over NVLink."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GIB", "GPUS", "GpuSpec", "gpu_spec"]

GIB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model: the memory torch reports as its total (``total_memory``), and whether its
    GPUs talk over NVLink (what ``dispatcher="auto"`` needs to pick FlashInfer)."""

    name: str
    mem_bytes: int
    nvlink: bool


def _gib(x: float) -> int:
    return round(x * GIB)


# Usable memory = torch.cuda.get_device_properties(i).total_memory, which is below the marketing
# size (e.g. an "80GB" H100 reports ~79.1 GiB: "total capacity of 79.1x GiB" in OOM messages).
# Rounded figures; pass --gpu-mem-gib for an exact one.
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 80GB SXM", _gib(79.1), True),
    "h100-pcie": GpuSpec("H100 80GB PCIe", _gib(79.1), False),
    "h200": GpuSpec("H200 141GB SXM", _gib(139.8), True),
    "a100-80gb": GpuSpec("A100 80GB SXM", _gib(79.15), True),
    "a100-40gb": GpuSpec("A100 40GB SXM", _gib(39.39), True),
    "l40s": GpuSpec("L40S 48GB", _gib(44.39), False),
    "rtx-4090": GpuSpec("RTX 4090 24GB", _gib(23.6), False),
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
