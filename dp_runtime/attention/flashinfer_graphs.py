"""Graph mode of FlashInferBackend (attention/flashinfer_backend.py): a workspace of its own, one
decode wrapper per bucket over fixed index buffers for ``max_bs`` requests of
``max_context_len`` tokens (or, from ``triton_decode_min_bs`` requests, the Triton kernel over
those buffers), planned at capture and again before each replay. Also the plan record both
modes share (``FlashInferMetadata``).

``FlashInferGraphPlans`` is the backend's graph half, kept in a file of its own: it uses the
backend's planning (``_plan_decode``, ``_layout``), its FlashInfer module and its staging fence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dp_runtime.attention.kv_layout import KVLayout
from dp_runtime.forward_mode import ForwardMode

__all__ = ["NO_SPLIT_KV_BS", "FlashInferGraphPlans", "FlashInferMetadata"]

# Decode graph buckets of at least this many requests plan without splitting a request's KV: with
# 4+ KV heads per request there are enough (request, head) work items to fill the GPU, and
# the split's merge kernel (a launch per layer, captured into every graph) goes away.
NO_SPLIT_KV_BS = 64


@dataclass
class FlashInferMetadata:
    """The planned wrappers of one forward and the layout they were planned for."""

    layout: KVLayout
    decode: Any = None  # a planned decode wrapper (decode steps)
    paged: Any = None  # a planned paged prefill wrapper (PAGED extend, or RAGGED's prefix part)
    ragged: Any = None  # a planned ragged prefill wrapper (RAGGED extend)
    has_prefix: bool = False  # RAGGED: whether some request has cached tokens to merge in
    # a decode bucket (or a mixed step's decode rows) attended by the Triton kernel over the graph
    # buffers
    triton_bs: int = 0
    # RAGGED: the leading one-token requests, attended as decode rows (decode / triton_bs)
    decode_rows: int = 0


class FlashInferGraphPlans:
    """The graph half of ``FlashInferBackend`` (module docstring): ``init_capture``,
    ``init_forward_metadata_capture``, ``init_forward_metadata_replay``."""

    def _init_graph_state(self) -> None:
        self.graph_workspace: torch.Tensor | None = None
        self._graph_max_bs = 0
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_layouts: dict[int, KVLayout] = {}
        self._graph_indptr: torch.Tensor | None = None
        self._graph_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None

    @property
    def graph_indices_capacity(self) -> int:
        """KV indices the graph wrappers' fixed buffer holds (0 before ``init_capture``)."""
        return 0 if self._graph_indices is None else int(self._graph_indices.numel())

    def init_capture(self, max_bs: int, max_num_tokens: int) -> None:
        if max_bs < 1:
            raise ValueError(f"FlashInferBackend.init_capture: max_bs must be >= 1, got {max_bs}")
        device = self.kv_cache.device
        if self.graph_workspace is None:
            self.graph_workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8,
                                               device=device)
        self._graph_max_bs = int(max_bs)
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self._graph_indices = torch.zeros(max_bs * self.kv_cache.max_context_len, dtype=torch.int32,
                                          device=device)
        self._graph_wrappers.clear()
        self._graph_layouts.clear()

    def init_forward_metadata_capture(
        self, *, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        forward_mode: ForwardMode
    ) -> None:
        layout = self._layout(forward_mode)
        if forward_mode is not ForwardMode.DECODE:
            raise NotImplementedError(
                f"FlashInferBackend captures DECODE only, got {forward_mode.name} "
                "(extend runs eager)"
            )
        if (self._graph_indptr is None or self._graph_indices is None
                or self._graph_last_page_len is None):
            raise RuntimeError("FlashInferBackend: init_capture() was not called")
        if bs > self._graph_max_bs:
            raise ValueError(f"FlashInferBackend (capture): bucket {bs} exceeds init_capture's "
                             f"max_bs={self._graph_max_bs}")
        triton = bool(self.triton_decode_min_bs) and bs >= self.triton_decode_min_bs
        wrapper = None if triton else self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.graph_workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
        )
        self._plan_decode(  # capture may sync (no host lengths here)
            "capture", wrapper, bs, req_pool_indices, seq_lens, None,
            max_bs=self._graph_max_bs, max_bs_name="init_capture's max_bs",
            indices_capacity=self.graph_indices_capacity,
        )
        self._graph_wrappers[bs] = wrapper
        self._graph_layouts[bs] = layout
        self.metadata = FlashInferMetadata(layout, decode=wrapper, triton_bs=bs if triton else 0)

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
        layout = self._layout(forward_mode)
        if bs not in self._graph_wrappers:
            raise KeyError(
                f"FlashInferBackend: no captured wrapper for bucket {bs}; "
                f"captured {sorted(self._graph_wrappers)}"
            )
        if layout is not self._graph_layouts[bs]:
            raise ValueError(
                f"FlashInferBackend: bucket {bs} was captured for layout "
                f"{self._graph_layouts[bs].name}, replay asks {layout.name}"
            )
        if raw_bs > bs:
            raise ValueError(
                f"FlashInferBackend (replay): {raw_bs} live requests exceed bucket {bs}")
        # Plan all bs rows: rows [raw_bs:bs) are padding (row 0, length 1) the graph still runs.
        wrapper = self._graph_wrappers[bs]
        self._fence.wait()
        self._plan_decode(
            "replay", wrapper, bs, req_pool_indices, seq_lens, seq_lens_cpu,
            max_bs=bs, max_bs_name="the bucket", indices_capacity=self.graph_indices_capacity,
        )
        self._fence.mark()
        self.metadata = FlashInferMetadata(layout, decode=wrapper,
                                           triton_bs=0 if wrapper is not None else bs)
