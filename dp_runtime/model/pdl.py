"""Programmatic dependent launch (PDL) for the runtime's Triton kernels (Hopper and later).

A decode step is ~500 short kernels in a row (about ten a layer). Launched plainly, a kernel's
programs start only once the kernel before it has finished and its completion has been seen;
the GPU idles in between (a profiled bs-1 step: 584 gaps under 4 us, 0.32 ms). Launched
with PDL, a kernel's programs may be placed on the SMs while its predecessor's last programs
still run; each waits at ``gdc_wait`` until the predecessor has completed and its writes are
visible, then lets its own successor launch (``gdc_launch_dependents``).

The rule that keeps this safe: a PDL kernel calls ``pdl_entry`` before it touches memory, so it
reads nothing a predecessor writes and writes nothing a predecessor reads until that predecessor
is complete; its successor's wait then covers every kernel before it too. FlashInfer's norm and
attention kernels launch the same way on sm90 (their ``enable_pdl`` default); cuBLAS, torch's
ops and copies launch plainly and are waited for as always.

``resolve_pdl(pdl, tensor, rows)``: None (the default of every launcher) means on where the
device supports it (a CUDA device of compute capability 9.0 or later) for calls of decode size
(``PDL_MAX_ROWS``). Triton's CPU interpreter runs the kernels with PDL off.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Triton 3.4 brought the grid dependency calls (the names ``pdl_entry`` calls) and the
# ``launch_pdl`` option; older Triton launches everything plainly (a dead ``if PDL:`` branch is
# never compiled).
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
except ImportError:
    TRITON_HAS_PDL = False
else:
    TRITON_HAS_PDL = True

__all__ = [
    "PDL_MAX_ROWS",
    "TRITON_HAS_PDL",
    "pdl_entry",
    "pdl_meta",
    "pdl_supported",
    "resolve_pdl",
]


@functools.cache
def _capability_major(index: int) -> int:
    """A device's compute capability major (a hardware fact: cached, as launches are hot)."""
    return torch.cuda.get_device_capability(index)[0]


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with PDL: CUDA, compute capability >= 9.0, and a
    Triton that has it (``TRITON_HAS_PDL``)."""
    if device.type != "cuda" or not TRITON_HAS_PDL:
        return False
    return (
        _capability_major(device.index if device.index is not None else torch.cuda.current_device())
        >= 9
    )


# Calls of up to this many rows (tokens) launch with PDL by default: decode steps. On an H100
# (`run_gpu.sh pdl20`, 2026-11-27) PDL on every call took graphed decode steps at 600-token
# contexts from 4.011 / 19.325 / 19.034 ms to 3.649 / 19.165 / 18.899 at bs 1 / 64 / 256, but
# mixed steps of 64 decode rows and a 256- or 704-token prompt from 26.84 / 31.03 ms to 28.83 /
# 34.66 (+7%, +12%); why the larger calls lose is not yet understood, so they launch plainly.
PDL_MAX_ROWS = 256


def resolve_pdl(pdl: bool | None, tensor: torch.Tensor, rows: int) -> bool:
    """``pdl`` for a launch of ``rows`` rows on ``tensor``'s device: None is on where the device
    supports it (``pdl_supported``) for up to ``PDL_MAX_ROWS`` rows; True where the device
    cannot is refused, naming the device."""
    supported = pdl_supported(tensor.device)
    if pdl is None:
        return supported and rows <= PDL_MAX_ROWS
    if pdl and not supported:
        raise ValueError(
            f"pdl=True needs a CUDA device of compute capability >= 9.0 and Triton >= 3.4, got "
            f"{tensor.device} and Triton {triton.__version__}"
        )
    return bool(pdl)


@triton.jit
def pdl_entry(PDL: tl.constexpr):
    """The first statement of a PDL kernel (module docstring): wait for the kernel before to
    complete, then let the kernel after launch. No-op with ``PDL`` off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_meta(pdl: bool) -> dict[str, bool]:
    """A launch's PDL arguments: the kernel's ``PDL`` constexpr and Triton's ``launch_pdl``
    option (passed only when on: the CPU interpreter knows no such option)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
