"""What the two graph runners share (``GraphRunner`` for decode buckets, ``PiecewiseRunner`` for
extend pieces): their size and CUDA checks, the largest-first capture loop with the GC frozen,
and the slicing of padded outputs to the live rows."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm

from buffers import BufferRegistry

__all__ = ["capture_largest_first", "checked_sizes", "resolve_cuda_graph", "slice_rows"]


@contextmanager
def _gc_frozen() -> Iterator[None]:
    # torch.cuda.graph() runs gc.collect() on entry to every capture: with the heap frozen each
    # collect is quick, and no finalizer frees a tensor into the allocator mid-capture.
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def checked_sizes(owner: str, sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` sorted and unique; ValueError naming ``owner`` unless non-empty and positive."""
    out = tuple(sorted({int(s) for s in sizes}))
    if not out or out[0] < 1:
        raise ValueError(f"{owner}: sizes must be a non-empty list of positive ints, "
                         f"got {list(sizes)}")
    return out


def resolve_cuda_graph(owner: str, use_cuda_graph: bool | None, registry: BufferRegistry) -> bool:
    """Whether to capture real CUDA graphs: None means when CUDA is available and the registry is
    on CUDA; True without them raises ValueError naming ``owner``."""
    cuda_ok = torch.cuda.is_available() and registry.device.type == "cuda"
    if use_cuda_graph is None:
        return cuda_ok
    if use_cuda_graph and not cuda_ok:
        raise ValueError(f"{owner}: use_cuda_graph=True needs CUDA and a CUDA registry "
                         f"(device {registry.device})")
    return bool(use_cuda_graph)


def capture_largest_first(sizes: Sequence[int], store: dict, capture_one: Callable[[int, Any], Any],
                          *, device: torch.device, use_cuda_graph: bool, label: str,
                          show_progress: bool, on_error: Callable[[], None]) -> int:
    """``store[size] = capture_one(size, stream)`` for each size, largest first (the first capture
    sizes the shared pool's blocks and the smaller ones reuse them), the GC frozen, on one side
    stream (None without CUDA), a tqdm bar. On a failure ``on_error()`` releases what was captured
    before the error propagates. Returns the device memory grown over the captures."""
    stream, before = None, 0
    if use_cuda_graph:
        before = torch.cuda.memory_allocated(device)
        stream = torch.cuda.Stream(device=device)
    try:
        with _gc_frozen():
            bar = tqdm(list(sizes)[::-1], desc=f"capture {label}", unit="graph",
                       disable=not show_progress)
            for size in bar:
                bar.set_postfix(size=size)
                store[size] = capture_one(size, stream)
    except BaseException:
        on_error()
        raise
    return torch.cuda.memory_allocated(device) - before if use_cuda_graph else 0


def slice_rows(out: Any, padded_n: int, raw_n: int, padded_bs: int, raw_bs: int) -> Any:
    """Slice every tensor whose leading dim is the padded token/request count to the live rows."""
    if isinstance(out, torch.Tensor):
        if out.dim() == 0:
            return out
        if out.shape[0] == padded_n:
            return out[:raw_n]
        if out.shape[0] == padded_bs:
            return out[:raw_bs]
        return out
    if isinstance(out, (list, tuple)):
        items = [slice_rows(o, padded_n, raw_n, padded_bs, raw_bs) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, dict):
        return {k: slice_rows(v, padded_n, raw_n, padded_bs, raw_bs) for k, v in out.items()}
    return out
