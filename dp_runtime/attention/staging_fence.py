"""A fence for host staging buffers that every plan rewrites.

A FlashInfer plan stages its work split in a pinned host buffer of its wrapper and copies it to
the device asynchronously; our decode plans stage their index offsets in a reused pinned buffer
too. With overlapped steps the host plans step N+1 while step N may still be queued, so it must
not rewrite those buffers before step N's copies out of them have run. ``wait`` (before a plan
rewrites them) blocks until the event ``mark`` recorded after the previous plan's copies has
passed: by then the GPU has finished the step before, which the host has waited for anyway, so
the fence costs nothing in the steady state. Without CUDA (or while a graph is being captured,
where events cannot be waited on) it does nothing.
"""

from __future__ import annotations

import torch

__all__ = ["StagingFence"]


class StagingFence:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._marked = False

    def _active(self) -> bool:
        return self._event is not None and not torch.cuda.is_current_stream_capturing()

    def wait(self) -> None:
        """Block until the copies before the last ``mark`` have run."""
        if self._marked and self._active():
            self._event.synchronize()

    def mark(self) -> None:
        """Call after a plan has queued its copies out of the staging buffers."""
        if self._active():
            # This device's stream, whichever device the calling thread has current.
            self._event.record(torch.cuda.current_stream(self._device))
            self._marked = True
