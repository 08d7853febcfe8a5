"""Layers of a Qwen3-style decoder: RMSNorm, rotary embedding (neox halves, plain or YaRN), and
the attention block with per-head q/k norm that the reference model and the benchmark stack share.

Shapes: T tokens, H heads, D head dim, P positions. Both compute in float32 and return the input
dtype.
"""

from __future__ import annotations

import math

import torch

from dp_runtime.model.model_config import YarnScaling

__all__ = ["RotaryEmbedding", "qk_norm_attention", "rms_norm", "yarn_inv_freq"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim (float32 inside), in ``x``'s dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def yarn_inv_freq(head_dim: int, theta: float, yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies (float64, ``head_dim // 2``) and the factor that scales cos and
    sin, by the formulas transformers' ``_compute_yarn_parameters`` uses: each frequency blends
    the original one (fast dimensions, more than ``beta_fast`` rotations over the original
    context) and the one interpolated by ``factor`` (slow dimensions, under ``beta_slow``),
    along a linear ramp between them."""
    d = head_dim

    def correction_dim(rotations: float) -> float:
        return (d * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    base = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    inv_freq = base / yarn.factor * ramp + base * (1 - ramp)
    return inv_freq, yarn.attention_factor


class RotaryEmbedding:
    """A cos/sin table for positions ``[0, max_position)``; ``apply`` rotates q and k. With
    ``yarn`` the frequencies are YaRN's and cos/sin carry its attention factor, so every
    consumer of ``cos_sin_PD`` (FlashInfer's ``apply_rope_with_cos_sin_cache_inplace``
    included) applies YaRN without knowing of it."""

    def __init__(self, head_dim: int, max_position: int, theta: float, device: torch.device | str,
                 *, yarn: YarnScaling | None = None) -> None:
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be even, got {head_dim}")
        if yarn is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64)
                                        / head_dim))
            scale = 1.0
        else:
            inv_freq, scale = yarn_inv_freq(head_dim, theta, yarn)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq).to(device)
        self.cos_sin_PD = (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale).float()
        self.max_position = max_position

    @staticmethod
    def _rotate(x_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x_THD.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_THD.dtype)

    def apply(
        self, q_THD: torch.Tensor, k_THD: torch.Tensor, positions_T: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_PD[positions_T].unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q_THD, cos, sin), self._rotate(k_THD, cos, sin)


def qk_norm_attention(
    x_TH: torch.Tensor,
    w_qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    w_o: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    rotary: RotaryEmbedding,
    attention,
    kv_cache,
    layer_id: int,
    batch,
    ops,
    b_qkv: torch.Tensor | None = None,
    b_o: torch.Tensor | None = None,
) -> torch.Tensor:
    """Qwen3's attention block on normed hidden states ``x_TH``: fused QKV projection (plus
    ``b_qkv`` when the model has attention biases), RMSNorm per head of q and k, RoPE at
    ``batch.positions``, this step's K/V stored at ``batch.out_cache_loc`` of ``kv_cache`` (the
    cache ``attention`` reads: the block is its one writer, the backend only reads), the
    backend's attention, output projection (plus ``b_o``). ``ops`` supplies ``linear`` (both
    projections), ``rms_norm`` and ``rope`` (``dp_runtime.model.elementwise_ops``: torch's, or
    FlashInfer's and Triton's), or ``qk_norm_rope_store``, which norms, rotates and stores in
    one launch. Returns (T, H) in ``x_TH``'s dtype."""
    t = x_TH.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = ops.linear(x_TH, w_qkv, b_qkv)
    v = qkv[:, q_size + kv_size:].reshape(t, num_kv_heads, head_dim)
    if ops.fused_qk_prologue:
        # one kernel: per-head norm, rotary, and this step's K/V into the cache
        q, k = ops.qk_norm_rope_store(
            qkv, q_norm, k_norm, rotary.cos_sin_PD, batch.positions, batch.out_cache_loc,
            kv_cache.k[layer_id], kv_cache.v[layer_id], num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps)
        o = attention.forward(q, k, v, layer_id, batch)
        return ops.linear(o.to(x_TH.dtype), w_o, b_o)
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
    q, k = q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim)
    if q_norm is not None:  # Qwen3's per-head norm; Mixtral has none
        q, k = ops.rms_norm(q, q_norm, eps), ops.rms_norm(k, k_norm, eps)
    q, k = ops.rope(rotary, q, k, batch.positions)
    kv_cache.set_kv(layer_id, batch.out_cache_loc, k, v)
    o = attention.forward(q, k, v, layer_id, batch)
    return ops.linear(o.to(x_TH.dtype), w_o, b_o)
