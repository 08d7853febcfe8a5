"""A pure-torch stand-in for the parts of flashinfer 0.7.2.post1 that FlashInferBackend uses.

It follows FlashInfer's documented and source semantics (read in the 0.7.2.post1 wheel):

- ``plan`` signatures and positional order: decode ``(indptr, indices, last_page_len,
  num_qo_heads, num_kv_heads, head_dim, page_size, **kw)`` (further positionals deprecated);
  paged prefill ``(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
  num_qo_heads, num_kv_heads, head_dim_qk, page_size, ...)``; ragged prefill ``(qo_indptr,
  kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, ...)``;
- a request's KV length is ``0`` with no pages, else ``(pages - 1) * page_size +
  last_page_len`` (the kernel's ``paged_kv_t::get_length``);
- causal masks are aligned to the end of the KV: query ``i`` of ``qo_len`` sees keys
  ``<= kv_len - qo_len + i``;
- ``return_lse`` gives the base-2 log-sum-exp, which ``merge_state`` takes;
- CUDA-graph decode wrappers keep the caller's fixed buffers, refuse another batch size and
  index lists longer than their buffer (same checks, same messages), and ``run`` reads the
  buffers as they are at run time.

On top of FlashInfer it checks what the kernels would turn into illegal memory accesses or
silent garbage: int32 index tensors, monotone indptrs that end at the index count, last-page
lengths in range (0 exactly for requests without pages), indices inside the KV pool, and q/k/v
row counts equal to the planned ones. Arithmetic is float32, so it doubles as a reference.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

__all__ = ["emulated_flashinfer"]

_NEG_INF = float("-inf")


def _host_i32(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise TypeError(f"emulated flashinfer: {name} must be int32, got {t.dtype}")
    return t.detach().to("cpu", torch.int64).clone()


def _check_indptr(indptr: torch.Tensor, name: str, total: int | None = None) -> None:
    if indptr.numel() < 1 or int(indptr[0]) != 0:
        raise ValueError(f"emulated flashinfer: {name} must start at 0, got {indptr.tolist()}")
    if bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"emulated flashinfer: {name} must be non-decreasing, got {indptr.tolist()}")
    if total is not None and int(indptr[-1]) != total:
        raise ValueError(f"emulated flashinfer: {name}[-1]={int(indptr[-1])} but {total} entries were given")


def _kv_lens(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    pages = indptr[1:] - indptr[:-1]
    if last_page_len.shape[0] != pages.shape[0]:
        raise ValueError(
            f"emulated flashinfer: last_page_len has {last_page_len.shape[0]} entries for {pages.shape[0]} requests"
        )
    for i, (p, lpl) in enumerate(zip(pages.tolist(), last_page_len.tolist(), strict=True)):
        if p == 0 and lpl != 0:
            raise ValueError(
                f"emulated flashinfer: request {i} has no pages but last_page_len {lpl} "
                f"(the host planner would size it as {lpl} tokens)"
            )
        if p > 0 and not 1 <= lpl <= page_size:
            raise ValueError(f"emulated flashinfer: request {i} has last_page_len {lpl}, page_size {page_size}")
    return torch.where(pages > 0, (pages - 1) * page_size + last_page_len, torch.zeros_like(pages))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (Q, Hq, D), k/v (L, Hkv, D) -> o (Q, Hq, D) float32, lse (Q, Hq) base 2."""
    qo_len, hq, d = q.shape
    kv_len, hkv = k.shape[0], k.shape[1]
    if kv_len == 0:
        return q.new_zeros((qo_len, hq, d), dtype=torch.float32), torch.full((qo_len, hq), _NEG_INF)
    g = hq // hkv
    kf = k.float().repeat_interleave(g, dim=1)  # (L, Hq, D)
    vf = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # (Hq, Q, L)
    if causal:
        qi = torch.arange(qo_len)[:, None]
        kj = torch.arange(kv_len)[None, :]
        s = s.masked_fill(~(kj <= kv_len - qo_len + qi), _NEG_INF)
    lse = torch.logsumexp(s, dim=-1)  # natural log, (Hq, Q)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key
    o = torch.einsum("hqk,khd->qhd", p, vf)
    return o, (lse / math.log(2)).transpose(0, 1)


def _gather_pages(paged_kv, indices: torch.Tensor, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = paged_kv if isinstance(paged_kv, (tuple, list)) else (paged_kv[:, 0], paged_kv[:, 1])
    if kv_layout != "NHD":
        raise NotImplementedError("emulated flashinfer: NHD only")
    num_pages = k_cache.shape[0]
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_pages):
        raise IndexError(
            f"emulated flashinfer: page indices span [{int(indices.min())}, {int(indices.max())}], "
            f"the KV pool has {num_pages} pages (an illegal memory access on the GPU)"
        )
    idx = indices.to(k_cache.device)
    k = k_cache[idx].reshape(-1, k_cache.shape[-2], k_cache.shape[-1])
    v = v_cache[idx].reshape(-1, v_cache.shape[-2], v_cache.shape[-1])
    return k, v


class _Base:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **_: object) -> None:
        self._kv_layout = kv_layout
        self.device = float_workspace_buffer.device
        self._planned = False

    def _common(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, kw: dict) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError("emulated flashinfer: num_qo_heads must be a multiple of num_kv_heads")
        self._heads = (num_qo_heads, num_kv_heads, head_dim)
        sm_scale = kw.get("sm_scale")
        self._scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self._q_dtype = kw.get("q_data_type", torch.float16)
        self._kv_dtype = kw.get("kv_data_type", self._q_dtype)
        self._planned = True

    def _check_kv(self, paged_kv_cache) -> None:
        """The real kernels reinterpret the cache's bytes as the planned KV type: a wrong plan
        reads garbage (an FP8 cache planned as bf16), so the emulator refuses it."""
        k_cache = paged_kv_cache[0] if isinstance(paged_kv_cache, (tuple, list)) else paged_kv_cache
        if k_cache.dtype != self._kv_dtype:
            raise ValueError(f"emulated flashinfer: the KV cache is {k_cache.dtype}, the plan said {self._kv_dtype}")

    def _check_q(self, q: torch.Tensor, rows: int) -> None:
        if not self._planned:
            raise RuntimeError("emulated flashinfer: run() before plan()")
        hq, _, d = self._heads
        if tuple(q.shape) != (rows, hq, d):
            raise ValueError(f"emulated flashinfer: q has shape {tuple(q.shape)}, the plan expects {(rows, hq, d)}")
        if q.dtype != self._q_dtype:
            raise ValueError(f"emulated flashinfer: q is {q.dtype}, the plan said {self._q_dtype}")


class BatchDecodeWithPagedKVCacheWrapper(_Base):
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        **kw: object,
    ) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self.is_cuda_graph_enabled = use_cuda_graph
        if use_cuda_graph:
            for name, buf in (
                ("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer),
            ):
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self._indptr_buf = paged_kv_indptr_buffer
        self._indices_buf = paged_kv_indices_buffer
        self._last_page_len_buf = paged_kv_last_page_len_buffer

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *extra, **kw) -> None:
        if extra:
            raise TypeError("emulated flashinfer: decode plan() options after page_size must be keywords")
        indptr_h = _host_i32(indptr, "indptr")
        if indices.dtype != torch.int32:
            raise TypeError(f"emulated flashinfer: indices must be int32, got {indices.dtype}")
        lpl_h = _host_i32(last_page_len, "last_page_len")
        _check_indptr(indptr_h, "indptr", int(indices.numel()))
        _kv_lens(indptr_h, lpl_h, page_size)
        batch_size = len(last_page_len)
        if self.is_cuda_graph_enabled:
            if batch_size != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch_size} "
                    f" mismatches the batch size set during initialization {self._fixed_batch_size}"
                )
            if len(indices) > len(self._indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self._indptr_buf.copy_(indptr)
            self._last_page_len_buf.copy_(last_page_len)
            self._indices_buf[: len(indices)].copy_(indices)
        else:
            self._indptr_buf, self._indices_buf, self._last_page_len_buf = indptr.clone(), indices.clone(), last_page_len.clone()
        self._page_size = page_size
        self._common(num_qo_heads, num_kv_heads, head_dim, kw)

    def run(self, q: torch.Tensor, paged_kv_cache, **kw) -> torch.Tensor:
        bs = len(self._last_page_len_buf)
        self._check_q(q, bs)
        self._check_kv(paged_kv_cache)
        indptr = self._indptr_buf.detach().to("cpu", torch.int64)
        lpl = self._last_page_len_buf.detach().to("cpu", torch.int64)
        kv_lens = _kv_lens(indptr, lpl, self._page_size)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for b in range(bs):
            pages = self._indices_buf[int(indptr[b]) : int(indptr[b + 1])]
            k, v = _gather_pages(paged_kv_cache, pages, self._kv_layout)
            n = int(kv_lens[b])
            o, _ = _attend(q[b : b + 1], k[:n], v[:n], False, self._scale)
            out[b] = o[0]
        return out.to(q.dtype)


class BatchPrefillWithPagedKVCacheWrapper(_Base):
    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim_qk, page_size, *extra, causal: bool = False, **kw,
    ) -> None:
        if extra:
            raise TypeError("emulated flashinfer: pass paged prefill plan() options after page_size as keywords")
        self._qo = _host_i32(qo_indptr, "qo_indptr")
        self._kv = _host_i32(paged_kv_indptr, "paged_kv_indptr")
        if paged_kv_indices.dtype != torch.int32:
            raise TypeError(f"emulated flashinfer: paged_kv_indices must be int32, got {paged_kv_indices.dtype}")
        _check_indptr(self._qo, "qo_indptr")
        _check_indptr(self._kv, "paged_kv_indptr", int(paged_kv_indices.numel()))
        if self._qo.shape != self._kv.shape:
            raise ValueError("emulated flashinfer: qo_indptr and paged_kv_indptr must have batch_size + 1 entries")
        self._kv_lens = _kv_lens(self._kv, _host_i32(paged_kv_last_page_len, "paged_kv_last_page_len"), page_size)
        self._indices = paged_kv_indices.clone()
        self._causal = causal
        self._common(num_qo_heads, num_kv_heads, head_dim_qk, kw)

    def run(self, q: torch.Tensor, paged_kv_cache, *, return_lse: bool = False, **kw):
        self._check_q(q, int(self._qo[-1]))
        self._check_kv(paged_kv_cache)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        for b in range(self._qo.shape[0] - 1):
            q0, q1 = int(self._qo[b]), int(self._qo[b + 1])
            k, v = _gather_pages(paged_kv_cache, self._indices[int(self._kv[b]) : int(self._kv[b + 1])], self._kv_layout)
            n = int(self._kv_lens[b])
            o, s = _attend(q[q0:q1], k[:n], v[:n], self._causal, self._scale)
            out[q0:q1], lse[q0:q1] = o, s
        out = out.to(q.dtype)
        return (out, lse.to(q.device)) if return_lse else out


class BatchPrefillWithRaggedKVCacheWrapper(_Base):
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, *extra, causal: bool = False, **kw) -> None:
        if extra:
            raise TypeError("emulated flashinfer: pass ragged plan() options after head_dim_qk as keywords")
        self._qo = _host_i32(qo_indptr, "qo_indptr")
        self._kv = _host_i32(kv_indptr, "kv_indptr")
        _check_indptr(self._qo, "qo_indptr")
        _check_indptr(self._kv, "kv_indptr")
        if self._qo.shape != self._kv.shape:
            raise ValueError("emulated flashinfer: qo_indptr and kv_indptr must have batch_size + 1 entries")
        self._causal = causal
        self._common(num_qo_heads, num_kv_heads, head_dim_qk, kw)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: torch.Tensor | None = None,
            return_lse: bool = False, **kw):
        self._check_q(q, int(self._qo[-1]))
        self._check_kv((k, v))
        if k.shape[0] != int(self._kv[-1]) or v.shape[0] != int(self._kv[-1]):
            raise ValueError(f"emulated flashinfer: k/v have {k.shape[0]}/{v.shape[0]} rows, kv_indptr ends at {int(self._kv[-1])}")
        # The kernels take row and head strides but read each head's D values densely.
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("emulated flashinfer: k/v must have a dense last dimension")
        if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
            raise ValueError(f"emulated flashinfer: out is {tuple(out.shape)} {out.dtype}, q {tuple(q.shape)} {q.dtype}")
        acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        for b in range(self._qo.shape[0] - 1):
            q0, q1, k0, k1 = int(self._qo[b]), int(self._qo[b + 1]), int(self._kv[b]), int(self._kv[b + 1])
            o, s = _attend(q[q0:q1], k[k0:k1], v[k0:k1], self._causal, self._scale)
            acc[q0:q1], lse[q0:q1] = o, s
        out = acc.to(q.dtype) if out is None else out.copy_(acc)
        return (out, lse.to(q.device)) if return_lse else out


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor):
    """Merge two partial attention states with base-2 log-sum-exps (FlashInfer's convention)."""
    s_a, s_b = s_a.float(), s_b.float()
    s_max = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp2(s_a - s_max), torch.exp2(s_b - s_max)
    total = w_a + w_b
    v = (v_a.float() * (w_a / total)[..., None] + v_b.float() * (w_b / total)[..., None]).to(v_a.dtype)
    return v, s_max + torch.log2(total)


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor) -> None:
    """``merge_state`` written into ``v`` and ``s`` (FlashInfer's in-place form)."""
    merged_v, merged_s = merge_state(v, s, v_other, s_other)
    v.copy_(merged_v)
    s.copy_(merged_s)


def emulated_flashinfer() -> SimpleNamespace:
    """A module-like object to pass as ``FlashInferBackend(flashinfer_module=...)``."""
    return SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper,
        merge_state=merge_state,
        merge_state_in_place=merge_state_in_place,
        __version__="emulated-0.7.2.post1",
    )
