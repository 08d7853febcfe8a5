"""Attention with torch's scaled_dot_product_attention over the paged KV cache (CPU and GPU).

Decode gathers a fixed window of ``max_context_len`` slots per request (``req_to_token`` rows)
and masks the positions at or beyond each request's length. The window is the same in eager
and in graphs, so both run the same arithmetic, and its shape never depends on the step, so
decode is capturable. Under graphs the gathered indices and the mask live in fixed buffers
(``init_capture``) that replay metadata rewrites in place. Extend runs eager only, one request
at a time, causal with the prefix offset.

Shapes: T tokens, B requests, W = max_context_len, Hq/Hkv query/KV heads (G = Hq / Hkv), D
head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.kv_cache import KVCache

__all__ = ["TorchSDPABackend"]


@dataclass
class _DecodeMeta:
    kv_indices_BW: torch.Tensor  # int32 KV slots of each request's window (masked ones: its first)
    valid_BW: torch.Tensor  # bool, position < seq_len


@dataclass
class _ExtendMeta:
    rows_BW: torch.Tensor  # req_to_token rows of the batch
    seq_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]


class TorchSDPABackend:
    """Paged attention with SDPA; implements ``graph.AttentionMetadataBackend`` and ``forward``."""

    def __init__(
        self,
        kv_cache: KVCache,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
    ) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"TorchSDPABackend: num_q_heads={num_q_heads} is not a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        if (kv_cache.num_kv_heads, kv_cache.head_dim) != (num_kv_heads, head_dim):
            raise ValueError(
                f"TorchSDPABackend: cache has {kv_cache.num_kv_heads} KV heads of dim "
                f"{kv_cache.head_dim}, backend was given {num_kv_heads} of dim {head_dim}"
            )
        self.kv_cache = kv_cache
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self._window = torch.arange(kv_cache.max_context_len, device=kv_cache.device)
        self.metadata: _DecodeMeta | _ExtendMeta | None = None
        self._graph_buffers: _DecodeMeta | None = None
        self._graph_meta: dict[int, _DecodeMeta] = {}

    # -- metadata ------------------------------------------------------------------------------
    def _decode_meta(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        into: _DecodeMeta | None
    ) -> _DecodeMeta:
        # bs is the caller's: the buffers may hold more rows than this batch (never len(buffer)).
        # Window positions at or past a request's length point at slot 0, which padded rows
        # write: it may hold anything, even NaN, and a masked NaN still poisons SDPA (NaN plus
        # -inf is NaN, zero weight times NaN is NaN). They are pointed at the request's own
        # first token instead, a live slot, and masked.
        rows, lens = req_pool_indices[:bs], seq_lens[:bs]
        if into is None:
            idx = self.kv_cache.req_to_token.index_select(0, rows)
            valid = self._window < lens[:, None]
            return _DecodeMeta(torch.where(valid, idx, idx[:, :1]), valid)
        idx, valid = into.kv_indices_BW, into.valid_BW
        torch.index_select(self.kv_cache.req_to_token, 0, rows, out=idx)
        torch.lt(self._window, lens[:, None], out=valid)
        torch.where(valid, idx, idx[:, :1].clone(), out=idx)
        return into

    def init_forward_metadata(self, batch: Any) -> None:
        bs = batch.batch_size
        mode = batch.forward_mode
        if mode is ForwardMode.IDLE or bs == 0:
            self.metadata = None
        elif mode is ForwardMode.DECODE:
            self.metadata = self._decode_meta(bs, batch.req_pool_indices, batch.seq_lens, None)
        elif mode is ForwardMode.EXTEND:
            extend_lens = batch.extend_seq_lens_cpu
            if extend_lens is None:  # the eager path may sync; graphs never take it
                extend_lens = tuple(batch.extend_seq_lens[:bs].tolist())
            seq_lens = (
                batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
            )
            self.metadata = _ExtendMeta(
                self.kv_cache.req_to_token.index_select(0, batch.req_pool_indices[:bs]),
                tuple(int(x) for x in seq_lens[:bs].tolist()),
                tuple(int(x) for x in extend_lens),
            )
        else:
            raise ValueError(f"TorchSDPABackend: unknown forward mode {mode!r}")

    def init_capture(self, max_bs: int, max_num_tokens: int) -> None:
        w = self.kv_cache.max_context_len
        device = self.kv_cache.device
        self._graph_buffers = _DecodeMeta(
            torch.zeros((max_bs, w), dtype=torch.int32, device=device),
            torch.zeros((max_bs, w), dtype=torch.bool, device=device),
        )
        self._graph_meta.clear()

    def _graph_slot(self, bs: int) -> _DecodeMeta:
        buffers = self._graph_buffers
        if buffers is None:
            raise RuntimeError("TorchSDPABackend: init_capture() was not called")
        if bs > buffers.kv_indices_BW.shape[0]:
            raise ValueError(
                f"TorchSDPABackend: bucket {bs} exceeds init_capture's max_bs "
                f"{buffers.kv_indices_BW.shape[0]}"
            )
        # Every bucket uses the leading rows of the same buffers: one replay runs at a time.
        return _DecodeMeta(buffers.kv_indices_BW[:bs], buffers.valid_BW[:bs])

    @staticmethod
    def _require_decode(forward_mode: ForwardMode) -> None:
        if forward_mode is not ForwardMode.DECODE:
            raise NotImplementedError(
                f"TorchSDPABackend captures DECODE only, got {forward_mode.name}"
            )

    def init_forward_metadata_capture(
        self,
        *,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
    ) -> None:
        self._require_decode(forward_mode)
        meta = self._decode_meta(bs, req_pool_indices, seq_lens, self._graph_slot(bs))
        self._graph_meta[bs] = meta
        self.metadata = meta

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
        self._require_decode(forward_mode)
        meta = self._graph_meta.get(bs)
        if meta is None:
            raise KeyError(
                f"TorchSDPABackend: no captured metadata for bucket {bs}; "
                f"captured {sorted(self._graph_meta)}"
            )
        # Rows [raw_bs:bs) are padding (row 0, length 1): valid targets, so all bs rows are written.
        self.metadata = self._decode_meta(bs, req_pool_indices, seq_lens, meta)

    # -- attention -----------------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t = q.shape[0]
        if t == 0:
            return q.new_empty((0, self.num_q_heads * self.head_dim)) if out is None else out
        meta = self.metadata
        if isinstance(meta, _DecodeMeta):
            o = self._decode(q, layer_id, meta)
        elif isinstance(meta, _ExtendMeta):
            o = self._extend(q, layer_id, meta)
        else:
            raise RuntimeError(f"TorchSDPABackend: no metadata for a forward of {t} tokens")
        return o if out is None else out.copy_(o)

    def _decode(self, q_TQD: torch.Tensor, layer: int, meta: _DecodeMeta) -> torch.Tensor:
        b, hkv, d = meta.kv_indices_BW.shape[0], self.num_kv_heads, self.head_dim
        if q_TQD.shape[0] != b:
            raise ValueError(
                f"TorchSDPABackend: decode of {q_TQD.shape[0]} tokens with metadata for {b} "
                "requests"
            )
        # An FP8 cache is upcast to the query's dtype (scale 1: kv_cache.py).
        # (B, Hkv, W, D)
        k = self.kv_cache.k[layer][meta.kv_indices_BW].permute(0, 2, 1, 3).to(q_TQD.dtype)
        v = self.kv_cache.v[layer][meta.kv_indices_BW].permute(0, 2, 1, 3).to(q_TQD.dtype)
        # The G query heads of one KV head act as G query rows: plain SDPA, no KV repeat.
        q = q_TQD.reshape(b, hkv, -1, d)
        mask = meta.valid_BW[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(b, -1).to(q_TQD.dtype)

    def _extend(self, q_TQD: torch.Tensor, layer: int, meta: _ExtendMeta) -> torch.Tensor:
        g = self.num_q_heads // self.num_kv_heads
        out = torch.empty_like(q_TQD)
        start = 0
        for i, (seq_len, ext) in enumerate(zip(meta.seq_lens, meta.extend_lens, strict=True)):
            idx = meta.rows_BW[i, :seq_len]
            k = (
                self.kv_cache.k[layer][idx].to(q_TQD.dtype).repeat_interleave(g, dim=1)
                .transpose(0, 1)
            )  # (Hq, L, D)
            v = (self.kv_cache.v[layer][idx].to(q_TQD.dtype).repeat_interleave(g, dim=1)
                 .transpose(0, 1))
            q = q_TQD[start : start + ext].transpose(0, 1)  # (Hq, E, D)
            prefix = seq_len - ext
            q_pos = torch.arange(prefix, seq_len, device=q.device)
            mask = self._window[:seq_len][None, :] <= q_pos[:, None]  # causal, after the prefix
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out[start : start + ext] = o.transpose(0, 1).to(out.dtype)
            start += ext
        return out.reshape(q_TQD.shape[0], -1)
