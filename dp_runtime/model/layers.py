"""Layers of a Qwen3-style decoder: RMSNorm, rotary embedding (neox halves), and the attention
block with per-head q/k norm that the reference model and the benchmark stack share.

Shapes: T tokens, H heads, D head dim. Both compute in float32 and return the input dtype.
"""

from __future__ import annotations

import torch

__all__ = ["RotaryEmbedding", "qk_norm_attention", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim (float32 inside), in ``x``'s dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


class RotaryEmbedding:
    """A cos/sin table for positions ``[0, max_position)``; ``apply`` rotates q and k."""

    def __init__(self, head_dim: int, max_position: int, theta: float, device: torch.device | str) -> None:
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be even, got {head_dim}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64, device=device), inv_freq)
        self.cos_sin_PD = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
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
    layer_id: int,
    batch,
    ops,
) -> torch.Tensor:
    """Qwen3's attention block on normed hidden states ``x_TH``: fused QKV projection, RMSNorm
    per head of q and k, RoPE at ``batch.positions``, the backend's attention (which writes this
    step's K/V), output projection. ``ops`` supplies ``rms_norm`` and ``rope``
    (``dp_runtime.model.elementwise_ops``: torch's or FlashInfer's). Returns (T, H) in ``x_TH``'s
    dtype."""
    t = x_TH.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = (x_TH @ w_qkv.T).split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim)
    if q_norm is not None:  # Qwen3's per-head norm; Mixtral has none
        q, k = ops.rms_norm(q, q_norm, eps), ops.rms_norm(k, k_norm, eps)
    q, k = ops.rope(rotary, q, k, batch.positions)
    o = attention.forward(q, k, v.reshape(t, num_kv_heads, head_dim), layer_id, batch)
    return o.to(x_TH.dtype) @ w_o.T
