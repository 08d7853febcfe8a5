"""Attention with FlashInfer over the paged KV cache (page size 1; CUDA only).

Decode uses ``BatchDecodeWithPagedKVCacheWrapper``; under graphs, one wrapper per bucket with
``use_cuda_graph=True`` whose indptr / indices / last-page-length buffers are the leading
rows of fixed buffers allocated in ``init_capture`` (one replay runs at a time). Extend runs
eager with ``BatchPrefillWithRaggedKVCacheWrapper`` and/or ``BatchPrefillWithPagedKVCacheWrapper``
as ``choose_kv_layout`` says.

The layout is chosen by one function (``kv_layout.choose_kv_layout``) with the same inputs at
capture, replay and eager, and stored in ``FlashInferMetadata``: the planner plans the
wrappers that layout needs and the forward runs the wrappers of that layout, never a second
opinion. The decode planner takes the bucket ``bs`` it is given and reads ``[:bs]`` of longer
buffers; index lists are built on the device from host-known lengths, so a replay enqueues
without waiting for the GPU.

Hazard: FlashInfer's plan stages its scheduling metadata through a pinned host buffer per
wrapper and copies it to the device asynchronously; the next plan of that wrapper rewrites it.
The host must therefore not plan a wrapper again before the GPU has started the previous step's
copy: a step loop that reads its sampled tokens every step (a sync) is safe.

FlashInfer is imported when a backend is constructed, so this module imports without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dp_runtime.attention.kv_indices import build_kv_indices, host_indptr
from dp_runtime.attention.kv_layout import KVLayout, choose_kv_layout
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.kv_cache import KVCache

__all__ = ["FlashInferBackend", "FlashInferMetadata"]


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError("FlashInferBackend needs flashinfer-python (pip install 'dp-runtime[gpu]')") from e
    return flashinfer


@dataclass
class FlashInferMetadata:
    """The planned wrappers of one forward and the layout they were planned for."""

    layout: KVLayout
    decode: Any = None  # a planned decode wrapper (decode steps)
    paged: Any = None  # a planned paged prefill wrapper (PAGED extend, or RAGGED's prefix part)
    ragged: Any = None  # a planned ragged prefill wrapper (RAGGED extend)
    has_prefix: bool = False  # RAGGED: whether some request has cached tokens to merge in


class FlashInferBackend:
    """FlashInfer paged attention; implements ``graph.AttentionMetadataBackend`` and ``forward``.

    Args:
        kv_cache: the rank's KV cache (on CUDA).
        num_q_heads, num_kv_heads, head_dim: the attention geometry.
        deterministic: extend takes the PAGED layout (see ``choose_kv_layout``).
        use_tensor_cores: decode on the tensor-core (prefill) kernels; None for "when the GQA
            group is at least 4", where they are faster. Either way one FA2 module is JIT-built.
        workspace_bytes: FlashInfer's float workspace (split-KV partial results).
        scale: softmax scale, default ``1/sqrt(head_dim)``.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        deterministic: bool = False,
        use_tensor_cores: bool | None = None,
        workspace_bytes: int = 256 << 20,
        scale: float | None = None,
    ) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError(f"FlashInferBackend needs a CUDA KV cache, got {kv_cache.device}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"FlashInferBackend: num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self._fi = _import_flashinfer()
        self.kv_cache = kv_cache
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.deterministic = deterministic
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        if use_tensor_cores is None:
            use_tensor_cores = num_q_heads // num_kv_heads >= 4
        self.use_tensor_cores = use_tensor_cores
        device = kv_cache.device
        # Shared by every wrapper: they run one after another on one stream.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self._paged = self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self._ragged = self._fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        # Never rewritten after creation, so an asynchronous copy from it cannot race.
        self._ones_host = torch.ones(kv_cache.max_reqs + 1, dtype=torch.int32, pin_memory=True)
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_layouts: dict[int, KVLayout] = {}
        self._graph_indptr: torch.Tensor | None = None
        self._graph_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None
        self.metadata: FlashInferMetadata | None = None

    # -- planning ------------------------------------------------------------------------------
    def _layout(self, forward_mode: ForwardMode) -> KVLayout:
        # The one call site of the choice: capture, replay and eager all come through here.
        return choose_kv_layout(forward_mode, deterministic=self.deterministic)

    def _plan_kw(self) -> dict[str, Any]:
        dtype = self.kv_cache.dtype
        return {"q_data_type": dtype, "kv_data_type": dtype, "sm_scale": self.scale, "non_blocking": True}

    def _last_page_len(self, lens_cpu: torch.Tensor) -> torch.Tensor:
        # Page size 1: the last page holds 1 token, or 0 for a request with no tokens.
        n = int(lens_cpu.shape[0])
        if n <= self._ones_host.shape[0] and bool((lens_cpu > 0).all()):
            return self._ones_host[:n]
        out = torch.empty(n, dtype=torch.int32, pin_memory=True)
        out.copy_(lens_cpu > 0)
        return out

    def _plan_decode(
        self,
        wrapper: Any,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor | None,
    ) -> None:
        lens_cpu = seq_lens_cpu[:bs] if seq_lens_cpu is not None else seq_lens[:bs].cpu()
        indptr = host_indptr(lens_cpu)
        indices = build_kv_indices(self.kv_cache.req_to_token, req_pool_indices[:bs], seq_lens[:bs], int(indptr[-1]))
        wrapper.plan(indptr, indices, self._last_page_len(lens_cpu), *self._heads(), 1, **self._plan_kw())

    def _heads(self) -> tuple[int, int, int]:
        return self.num_q_heads, self.num_kv_heads, self.head_dim

    def _plan_paged(self, qo_indptr: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, lens_cpu: torch.Tensor, causal: bool) -> None:
        kv_indptr = host_indptr(lens_cpu)
        indices = build_kv_indices(self.kv_cache.req_to_token, rows, lens, int(kv_indptr[-1]))
        self._paged.plan(
            qo_indptr, kv_indptr, indices, self._last_page_len(lens_cpu), *self._heads(), 1,
            causal=causal, **self._plan_kw(),
        )

    def _plan_extend(self, layout: KVLayout, batch: Any) -> FlashInferMetadata:
        bs = batch.batch_size
        rows, seq_lens = batch.req_pool_indices[:bs], batch.seq_lens[:bs]
        seq_cpu = (batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu())[:bs]
        ext = batch.extend_seq_lens_cpu
        ext_cpu = torch.tensor(ext, dtype=torch.int64) if ext is not None else batch.extend_seq_lens[:bs].cpu()
        qo_indptr = host_indptr(ext_cpu)
        if layout is KVLayout.PAGED:
            self._plan_paged(qo_indptr, rows, seq_lens, seq_cpu, causal=True)
            return FlashInferMetadata(layout, paged=self._paged)
        self._ragged.plan(qo_indptr, qo_indptr, *self._heads(), causal=True, **self._plan_kw())
        prefix_cpu = seq_cpu - ext_cpu
        has_prefix = bool((prefix_cpu > 0).any())
        if has_prefix:
            prefix = batch.extend_prefix_lens
            prefix = prefix[:bs] if prefix is not None else seq_lens - batch.extend_seq_lens[:bs]
            self._plan_paged(qo_indptr, rows, prefix, prefix_cpu, causal=False)
        return FlashInferMetadata(layout, paged=self._paged if has_prefix else None, ragged=self._ragged, has_prefix=has_prefix)

    # -- the protocol --------------------------------------------------------------------------
    def init_forward_metadata(self, batch: Any) -> None:
        mode = batch.forward_mode
        layout = self._layout(mode)
        bs = batch.batch_size
        if mode is ForwardMode.IDLE or bs == 0:
            self.metadata = FlashInferMetadata(layout)
        elif mode is ForwardMode.DECODE:
            self._plan_decode(self._decode, bs, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu)
            self.metadata = FlashInferMetadata(layout, decode=self._decode)
        elif mode is ForwardMode.EXTEND:
            self.metadata = self._plan_extend(layout, batch)
        else:
            raise ValueError(f"FlashInferBackend: unknown forward mode {mode!r}")

    def init_capture(self, max_bs: int, max_num_tokens: int) -> None:
        device = self.kv_cache.device
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self._graph_indices = torch.zeros(max_bs * self.kv_cache.max_context_len, dtype=torch.int32, device=device)
        self._graph_wrappers.clear()
        self._graph_layouts.clear()

    def init_forward_metadata_capture(
        self, *, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, forward_mode: ForwardMode
    ) -> None:
        layout = self._layout(forward_mode)
        if forward_mode is not ForwardMode.DECODE:
            raise NotImplementedError(
                f"FlashInferBackend captures DECODE only, got {forward_mode.name} (extend runs eager)"
            )
        if self._graph_indptr is None or self._graph_indices is None or self._graph_last_page_len is None:
            raise RuntimeError("FlashInferBackend: init_capture() was not called")
        if bs + 1 > self._graph_indptr.shape[0]:
            raise ValueError(f"FlashInferBackend: bucket {bs} exceeds init_capture's max_bs {self._graph_indptr.shape[0] - 1}")
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
        )
        self._plan_decode(wrapper, bs, req_pool_indices, seq_lens, None)  # capture may sync
        self._graph_wrappers[bs] = wrapper
        self._graph_layouts[bs] = layout
        self.metadata = FlashInferMetadata(layout, decode=wrapper)

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
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            raise KeyError(
                f"FlashInferBackend: no captured wrapper for bucket {bs}; captured {sorted(self._graph_wrappers)}"
            )
        if layout is not self._graph_layouts[bs]:
            raise ValueError(
                f"FlashInferBackend: bucket {bs} was captured for layout {self._graph_layouts[bs].name}, "
                f"replay asks {layout.name}"
            )
        # Plan all bs rows: rows [raw_bs:bs) are padding (row 0, length 1) the graph still runs.
        self._plan_decode(wrapper, bs, req_pool_indices, seq_lens, seq_lens_cpu)
        self.metadata = FlashInferMetadata(layout, decode=wrapper)

    # -- attention -----------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Any) -> torch.Tensor:
        t = q.shape[0]
        if t == 0:
            return q.new_empty((0, self.num_q_heads * self.head_dim))
        self.kv_cache.set_kv(layer_id, batch.out_cache_loc, k, v)
        meta = self.metadata
        if meta is None:
            raise RuntimeError(f"FlashInferBackend: no metadata for a forward of {t} tokens")
        q = q.to(self.kv_cache.dtype).contiguous()
        paged_kv = self.kv_cache.paged(layer_id)
        if meta.layout is KVLayout.RAGGED:
            # k/v come from a split of the fused projection: make them dense rows for the kernel.
            k, v = k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
            o, lse = meta.ragged.run(q, k, v, return_lse=True)
            if meta.has_prefix:
                o_prefix, lse_prefix = meta.paged.run(q, paged_kv, return_lse=True)
                o, _ = self._fi.merge_state(o, lse, o_prefix, lse_prefix)
        elif meta.decode is not None:
            o = meta.decode.run(q, paged_kv)
        else:
            o = meta.paged.run(q, paged_kv)
        return o.reshape(t, -1)
