"""Attention with FlashInfer over the paged KV cache (page size 1; CUDA only).

Decode: ``BatchDecodeWithPagedKVCacheWrapper``. Extend (eager, also between the extend graphs'
pieces): the ragged and/or paged prefill wrappers, as ``kv_layout.choose_kv_layout`` says (the
ragged one on FA3 where sm90 has it and the step's new tokens come in long runs,
``LONG_EXTEND_TOKENS``); the layout is stored in ``FlashInferMetadata``, which plans and
forward both follow.

Two wrapper sets, never shared: eager (``init_forward_metadata``: decode, paged and ragged
prefill on the eager workspace) and graphs (``init_capture``: one decode wrapper per bucket on a
workspace of their own, over fixed index buffers for ``max_bs`` requests of ``max_context_len``
tokens). Decode buckets of ``triton_decode_min_bs`` requests and more attend with our Triton
kernel (attention/triton_decode.py) over the same fixed buffers instead: FlashInfer's decode
kernels are about 3x the bytes floor there. A batch beyond a limit raises naming it before
FlashInfer is called.

Hazard: a plan stages data in pinned host buffers that the next plan rewrites; with overlapped
steps the host plans a step while the one before may still be queued, so every plan outside a
capture waits on a fence (attention/staging_fence.py) for the previous plan's copies.
``check_indices=True`` (``RuntimeConfig.flashinfer_checks``) makes every plan outside a capture
sync and verify lengths and KV indices on the host.

The FlashInfer semantics this relies on, and the rest of the story: docs/graph.md
("FlashInferBackend"). FlashInfer is imported when a backend is constructed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dp_runtime.attention.backend import import_flashinfer
from dp_runtime.attention.flashinfer_graphs import (
    NO_SPLIT_KV_BS,
    FlashInferGraphPlans,
    FlashInferMetadata,
)
from dp_runtime.attention.kv_indices import (
    build_kv_indices,
    extend_plan_inputs,
    host_indptr,
    last_page_len,
)
from dp_runtime.attention.kv_layout import KVLayout, choose_kv_layout
from dp_runtime.attention.plan_checks import check_lens, verify_indices, verify_lens
from dp_runtime.attention.staging_fence import StagingFence
from dp_runtime.attention.triton_decode import TRITON_DECODE_MIN_BS, triton_decode_attention
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.kv_cache import KVCache

__all__ = ["LONG_EXTEND_TOKENS", "NO_SPLIT_KV_BS", "FlashInferBackend", "FlashInferMetadata"]

# A RAGGED extend whose longest request brings at least this many new tokens plans the
# wrapper on FlashInfer's "auto" backend (FA3 on sm90); shorter ones FA2. 64, not 256: a
# streamed 1 x 128 extend on an H200 went 7.50 -> 7.40 ms with FA3 (`run_gpu.sh var8`).
LONG_EXTEND_TOKENS = 64

class FlashInferBackend(FlashInferGraphPlans):
    """FlashInfer paged attention; implements ``graph.AttentionMetadataBackend`` and ``forward``
    (graph mode, ``init_capture`` and the capture and replay plans: ``FlashInferGraphPlans``).

    Args:
        kv_cache: the rank's KV cache (on CUDA), in the model's dtype or FP8 e4m3 (scale 1).
        q_dtype: the model's dtype, which queries come in and outputs go out in; None: the
            cache's (which then must not be FP8).
        num_q_heads, num_kv_heads, head_dim: the attention geometry.
        deterministic: extend takes the PAGED layout (see ``choose_kv_layout``).
        use_tensor_cores: decode on the tensor-core (prefill) kernels; None for "when the GQA
            group is at least 4", where they are faster. Either way one FA2 module is JIT-built.
        workspace_bytes: FlashInfer's float workspace (split-KV partial results), one for the
            eager wrappers and one more for the graph wrappers (allocated by ``init_capture``).
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        check_indices: verify every plan on the host (syncs; see the module docstring); the
            rank worker passes ``RuntimeConfig.flashinfer_checks``
            (``DP_RUNTIME_FLASHINFER_CHECKS``).
        flashinfer_module: the module providing the wrappers and ``merge_state``; None imports
            ``flashinfer``. Tests pass a pure-torch emulation, which may run on CPU.
        triton_decode_min_bs: decode graph buckets of at least this many requests use the
            Triton kernel; None: ``TRITON_DECODE_MIN_BS`` on CUDA, never elsewhere; 0: never.
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
        check_indices: bool = False,
        flashinfer_module: Any = None,
        triton_decode_min_bs: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> None:
        q_dtype = q_dtype or kv_cache.dtype
        if q_dtype.itemsize == 1:
            raise ValueError(f"FlashInferBackend: queries in {q_dtype}: pass q_dtype, the model's "
                             f"dtype, with an FP8 KV cache")
        if flashinfer_module is None and kv_cache.device.type != "cuda":
            raise ValueError(f"FlashInferBackend needs a CUDA KV cache, got {kv_cache.device}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"FlashInferBackend: num_q_heads={num_q_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if (kv_cache.num_kv_heads, kv_cache.head_dim) != (num_kv_heads, head_dim):
            raise ValueError(
                f"FlashInferBackend: cache has {kv_cache.num_kv_heads} KV heads of dim "
                f"{kv_cache.head_dim}, backend was given {num_kv_heads} of dim {head_dim}"
            )
        self._fi = flashinfer_module if flashinfer_module is not None else import_flashinfer()
        self.kv_cache, self.num_q_heads, self.num_kv_heads, self.head_dim = (
            kv_cache, num_q_heads, num_kv_heads, head_dim)
        self.q_dtype = q_dtype
        self.deterministic = deterministic
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.check_indices = bool(check_indices)
        if use_tensor_cores is None:
            use_tensor_cores = num_q_heads // num_kv_heads >= 4
        self.use_tensor_cores = use_tensor_cores
        if triton_decode_min_bs is None:
            triton_decode_min_bs = TRITON_DECODE_MIN_BS if kv_cache.device.type == "cuda" else 0
        self.triton_decode_min_bs = int(triton_decode_min_bs)
        self.workspace_bytes = int(workspace_bytes)
        device = kv_cache.device
        # The eager wrappers share this workspace: they run one after another on one stream.
        self.workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
        self._paged = self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")
        self._ragged = self._fi.BatchPrefillWithRaggedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")
        # Long runs of new tokens: FlashInfer's own choice, FA3 on sm90 (measured on an H200,
        # causal 32/4 heads of 128: 1.84x FA2 at 8192 tokens, 1.47x at 8 x 1024, 1.05x at
        # 64 x 128). Its query tile is 128 rows, so short runs stay on FA2.
        self._ragged_long = self._fi.BatchPrefillWithRaggedKVCacheWrapper(
            self.workspace, "NHD", backend="auto")
        # Never rewritten after creation, so an asynchronous copy from it cannot race.
        self._ones_host = torch.ones(kv_cache.max_reqs + 1, dtype=torch.int32,
                                     pin_memory=torch.cuda.is_available())
        # Decode plans' host indptr, reused: the fence orders each plan after the last one's copies.
        self._fence = StagingFence(device)
        self._indptr_host = torch.empty(kv_cache.max_reqs + 2, dtype=torch.int32,
                                        pin_memory=torch.cuda.is_available())
        # graph mode: its own workspace, wrappers and buffers (init_capture)
        self._init_graph_state()
        self.metadata: FlashInferMetadata | None = None

    # -- limits and checks ---------------------------------------------------------------------
    @property
    def decode_kernels(self) -> str:
        """Which kernels decode attends with (shown in ``RankWorker.metrics()``)."""
        if self.triton_decode_min_bs:
            return f"flashinfer below bs {self.triton_decode_min_bs}, triton from it (graphs)"
        return "flashinfer"

    # -- planning ------------------------------------------------------------------------------
    def _layout(self, forward_mode: ForwardMode) -> KVLayout:
        # The one call site of the choice: capture, replay and eager all come through here.
        return choose_kv_layout(forward_mode, deterministic=self.deterministic)

    def _plan_kw(self, kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Plan options; the KV type is the cache's unless ``kv_dtype`` (the ragged pass, whose
        K/V are the step's own, in the model's dtype). An FP8 cache is read at scale 1 (the runs
        pass no k_scale / v_scale): kv_cache.py."""
        return {"q_data_type": self.q_dtype, "kv_data_type": kv_dtype or self.kv_cache.dtype,
                "sm_scale": self.scale, "non_blocking": True}

    def _heads(self) -> tuple[int, int, int]:
        return self.num_q_heads, self.num_kv_heads, self.head_dim

    def _decode_last_page_len(self, lens_cpu: torch.Tensor) -> torch.Tensor:
        # Decode lengths are >= 1 (checked): every last page holds 1 token.
        n = int(lens_cpu.shape[0])
        return self._ones_host[:n] if n <= self._ones_host.shape[0] else last_page_len(lens_cpu)

    def _plan_decode(
        self,
        where: str,
        wrapper: Any,  # None: the Triton kernel's graph buffers (indptr and indices) instead
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor | None,
        *,
        max_bs: int,
        max_bs_name: str,
        indices_capacity: int | None,
    ) -> None:
        lens_cpu = seq_lens_cpu[:bs] if seq_lens_cpu is not None else seq_lens[:bs].cpu()
        check_lens(self.kv_cache, where, bs, lens_cpu, max_bs=max_bs, max_bs_name=max_bs_name,
                   min_len=1)
        indptr = host_indptr(lens_cpu, self._indptr_host)
        total = int(indptr[-1])
        if indices_capacity is not None and total > indices_capacity:
            raise ValueError(
                f"FlashInferBackend ({where}): {total} KV indices for bucket {bs} exceed the graph "
                f"index buffer's {indices_capacity} (init_capture's max_bs x max_context_len)"
            )
        rows, lens = req_pool_indices[:bs], seq_lens[:bs]
        verify_lens(self.check_indices, self.kv_cache, where, rows, lens, lens_cpu)
        if wrapper is None:  # the kernel reads the graph buffers themselves: no plan, no extra copy
            indptr_dev = self._graph_indptr[: bs + 1]
            indptr_dev.copy_(indptr, non_blocking=True)
            indices = build_kv_indices(self.kv_cache.req_to_token, rows, lens, total,
                                       indptr_cpu=indptr, indptr_dev=indptr_dev,
                                       out=self._graph_indices[:total])
            verify_indices(self.check_indices, self.kv_cache, where, indices)
            return
        indices = build_kv_indices(self.kv_cache.req_to_token, rows, lens, total, indptr_cpu=indptr)
        verify_indices(self.check_indices, self.kv_cache, where, indices)
        # Graph buckets only: the measured case (the eager decode wrapper keeps FlashInfer's split).
        no_split = ({"disable_split_kv": True}
                    if bs >= NO_SPLIT_KV_BS and indices_capacity is not None else {})
        wrapper.plan(indptr, indices, self._decode_last_page_len(lens_cpu), *self._heads(), 1,
                     **no_split, **self._plan_kw())

    def _plan_paged(
        self,
        where: str,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        rows: torch.Tensor,
        lens: torch.Tensor,
        lens_cpu: torch.Tensor,
        causal: bool,
    ) -> None:
        verify_lens(self.check_indices, self.kv_cache, where, rows, lens, lens_cpu)
        indices = build_kv_indices(self.kv_cache.req_to_token, rows, lens, int(kv_indptr[-1]))
        verify_indices(self.check_indices, self.kv_cache, where, indices)
        self._paged.plan(
            qo_indptr, kv_indptr, indices, kv_last_page_len, *self._heads(), 1,
            causal=causal, **self._plan_kw(),
        )

    def _plan_extend(self, layout: KVLayout, batch: Any) -> FlashInferMetadata:
        bs = batch.batch_size
        rows, seq_lens = batch.req_pool_indices[:bs], batch.seq_lens[:bs]
        seq_cpu = (batch.seq_lens_cpu if batch.seq_lens_cpu is not None
                   else batch.seq_lens.cpu())[:bs]
        ext = batch.extend_seq_lens_cpu
        ext_cpu = (torch.tensor(ext[:bs], dtype=torch.int64) if ext is not None
                   else batch.extend_seq_lens[:bs].cpu())
        check_lens(self.kv_cache, "extend", bs, seq_cpu, max_bs=self.kv_cache.max_reqs,
                   max_bs_name="max_reqs", min_len=1)
        p = extend_plan_inputs(ext_cpu, seq_cpu)
        if layout is KVLayout.PAGED:
            # The whole sequence from the cache (this step's K/V are written before the run),
            # causal: FlashInfer aligns the mask to the end, so new token i sees prefix + i + 1
            # keys.
            self._plan_paged("extend paged", p.qo_indptr, p.kv_indptr, p.kv_last_page_len, rows,
                             seq_lens, seq_cpu, True)
            return FlashInferMetadata(layout, paged=self._paged)
        # A mixed step's leading decode rows (one new token each) attend as a decode step's rows
        # do: a prefill kernel over them read their KV tile by tile for one query each, and
        # planned them into the ragged pass and the prefix pass and a merge (2.3x the decode
        # step's attention time at 64 rows beside a 256-token prompt on an H100).
        d = _leading_single_tokens(ext_cpu)
        meta = FlashInferMetadata(layout, decode_rows=d)
        if d:
            triton = (bool(self.triton_decode_min_bs) and d >= self.triton_decode_min_bs
                      and self._graph_indptr is not None and d <= self._graph_max_bs)
            if triton:  # the Triton kernel over the graph buffers (no graph reads them meanwhile)
                self._plan_decode("mixed decode rows", None, d, rows, seq_lens, seq_cpu,
                                  max_bs=self._graph_max_bs, max_bs_name="init_capture's max_bs",
                                  indices_capacity=self.graph_indices_capacity)
                meta.triton_bs = d
            else:
                self._plan_decode("mixed decode rows", self._decode, d, rows, seq_lens, seq_cpu,
                                  max_bs=self.kv_cache.max_reqs, max_bs_name="max_reqs",
                                  indices_capacity=None)
                meta.decode = self._decode
            if d == bs:
                return meta
            rows, seq_lens, seq_cpu = rows[d:], seq_lens[d:], seq_cpu[d:]
            p = extend_plan_inputs(ext_cpu[d:], seq_cpu)
        # The new tokens among themselves (this step's k/v, causal), then the cached prefix
        # (non-causal: every new token sees all of it), merged by log-sum-exp.
        ragged = self._ragged_long if int(ext_cpu[d:].max()) >= LONG_EXTEND_TOKENS else self._ragged
        ragged.plan(p.qo_indptr, p.qo_indptr, *self._heads(), causal=True,
                    **self._plan_kw(self.q_dtype))
        if p.has_prefix:
            prefix = batch.extend_prefix_lens
            prefix = prefix[d:bs] if prefix is not None else seq_lens - batch.extend_seq_lens[d:bs]
            self._plan_paged(
                "extend prefix", p.qo_indptr, p.prefix_indptr, p.prefix_last_page_len, rows, prefix,
                p.prefix_lens, False
            )
        meta.ragged, meta.has_prefix = ragged, p.has_prefix
        meta.paged = self._paged if p.has_prefix else None
        return meta

    # -- the protocol --------------------------------------------------------------------------
    def init_forward_metadata(self, batch: Any) -> None:
        mode = batch.forward_mode
        layout = self._layout(mode)
        bs = batch.batch_size
        if mode is ForwardMode.IDLE or bs == 0:
            self.metadata = FlashInferMetadata(layout)
            return
        self._fence.wait()
        if mode is ForwardMode.DECODE:
            self._plan_decode(
                "eager decode", self._decode, bs, batch.req_pool_indices, batch.seq_lens,
                batch.seq_lens_cpu, max_bs=self.kv_cache.max_reqs, max_bs_name="max_reqs",
                indices_capacity=None,
            )
            self.metadata = FlashInferMetadata(layout, decode=self._decode)
        elif mode is ForwardMode.EXTEND:
            self.metadata = self._plan_extend(layout, batch)
        else:
            raise ValueError(f"FlashInferBackend: unknown forward mode {mode!r}")
        self._fence.mark()

    # -- attention -----------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Any,
                out: torch.Tensor | None = None) -> torch.Tensor:
        t = q.shape[0]
        if t == 0:
            return q.new_empty((0, self.num_q_heads * self.head_dim)) if out is None else out
        # The paged passes read this step's K/V from the cache, where the model wrote them.
        meta = self.metadata
        if meta is None:
            raise RuntimeError(f"FlashInferBackend: no metadata for a forward of {t} tokens")
        q = q.to(self.q_dtype).contiguous()
        paged_kv = self.kv_cache.paged(layer_id)
        if meta.layout is KVLayout.RAGGED:
            # k/v may be strided views of the fused projection (v always is): FlashInfer's
            # prefill kernels take row and head strides, so no copy makes them dense.
            k, v = k.to(q.dtype), v.to(q.dtype)
            d = meta.decode_rows
            if d == 0:
                return self._ragged_run(meta, q, k, v, paged_kv, out)
            o = (q.new_empty((t, self.num_q_heads * self.head_dim)) if out is None else out)
            o_TQD = o.view(t, self.num_q_heads, self.head_dim)
            if meta.triton_bs:
                triton_decode_attention(q[:d].view(d, self.num_q_heads, self.head_dim), *paged_kv,
                                        self._graph_indptr[: d + 1], self._graph_indices,
                                        self.scale, out=o_TQD[:d])
            else:
                o_TQD[:d].copy_(
                    meta.decode.run(q[:d], paged_kv).view(d, self.num_q_heads, self.head_dim))
            if d < t:
                self._ragged_run(meta, q[d:], k[d:], v[d:], paged_kv, o[d:])
            return o
        if meta.triton_bs:
            o = triton_decode_attention(q.view(t, self.num_q_heads, self.head_dim), *paged_kv,
                                        self._graph_indptr[: t + 1], self._graph_indices,
                                        self.scale)
        elif meta.decode is not None:
            o = meta.decode.run(q, paged_kv)
        else:
            o = meta.paged.run(q, paged_kv)
        return o.reshape(t, -1) if out is None else out.copy_(o.reshape(t, -1))

    def _ragged_run(self, meta: FlashInferMetadata, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, paged_kv: Any, out: torch.Tensor | None) -> torch.Tensor:
        """The RAGGED passes of ``q`` (the new tokens after any decode rows), into ``out``."""
        t = q.shape[0]
        o_TQD = None if out is None else out.view(t, self.num_q_heads, self.head_dim)
        if meta.has_prefix:
            o, lse = meta.ragged.run(q, k, v, out=o_TQD, return_lse=True)
            o_prefix, lse_prefix = meta.paged.run(q, paged_kv, return_lse=True)
            self._fi.merge_state_in_place(o, lse, o_prefix, lse_prefix)
        else:
            o = meta.ragged.run(q, k, v, out=o_TQD)
        return o.reshape(t, -1)


def _leading_single_tokens(ext_cpu: torch.Tensor) -> int:
    """How many requests at the front of an extend batch bring one new token each (a mixed
    step's decode rows lead its batch: dp_runtime/serving/scheduler.py)."""
    ones = (ext_cpu == 1).to(torch.int64)
    return int(torch.cumprod(ones, 0).sum()) if ones.numel() else 0
