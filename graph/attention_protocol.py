"""The attention-metadata protocol: what a runner asks of an attention backend.

A backend turns a batch's request table (``req_pool_indices``, ``seq_lens``) into whatever its
kernels read (index lists, masks, planned wrappers). Three entry points:

- eager: ``init_forward_metadata(batch)`` before every eager forward;
- capture: ``init_capture(max_bs, max_num_tokens)`` once (allocate fixed buffers the graphs
  will point into), then ``init_forward_metadata_capture(...)`` for each bucket before its
  warm-up runs and capture;
- replay: ``init_forward_metadata_replay(...)`` before every replay, writing into the buffers
  the graph of that bucket captured.

Two rules, each pinned by a test because an upstream engine broke both:

1. ``bs`` is passed explicitly (the bucket) together with ``raw_bs`` (the live requests). A
   backend never re-derives the batch size from a tensor's length: the runner may hand it
   buffers longer than the bucket (a 256-row ``req_pool_indices`` for bucket 8), and it reads
   ``[:bs]``.
2. Any choice that changes which kernels run (e.g. FlashInfer's ragged vs paged prefill) is
   computed once, by one function, from the same inputs at capture, replay and eager, and then
   stored in the metadata that both the planner and the forward read.

The runner calls these methods with keyword arguments only.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from graph.forward_mode import ForwardMode

__all__ = ["AttentionMetadataBackend"]


@runtime_checkable
class AttentionMetadataBackend(Protocol):
    def init_forward_metadata(self, batch: Any) -> None:
        """Prepare metadata for an eager forward of ``batch`` (live sizes, no padding)."""

    def init_capture(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the fixed buffers every captured graph will read (once, before capture)."""

    def init_forward_metadata_capture(
        self,
        *,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
    ) -> None:
        """Prepare the metadata of bucket ``bs`` before its warm-up runs and capture."""

    def init_forward_metadata_replay(
        self,
        *,
        bs: int,
        raw_bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        forward_mode: ForwardMode,
        seq_lens_cpu: torch.Tensor | None,
    ) -> None:
        """Refresh bucket ``bs``'s captured metadata for a replay with ``raw_bs`` live rows.

        ``req_pool_indices``/``seq_lens``/``seq_lens_cpu`` hold at least ``bs`` rows (rows
        ``[raw_bs:bs)`` are padding: request row 0, length 1); read ``[:bs]``.
        ``seq_lens_sum`` is the sum of ``seq_lens[:bs]``, known on the host.
        """
