"""A compact Qwen3-MoE-shaped decoder stack with random weights, for tests and benchmarks.

Per layer: RMSNorm, fused QKV projection, per-head q/k RMSNorm (qk-norm), rotary embedding,
paged attention through the attention backend (which also writes this step's K/V), output
projection, RMSNorm, router softmax top-k (renormalized), routed experts (``experts.py``).
Then a final RMSNorm and the LM head; ``forward(batch)`` returns float32 logits (T, vocab).

All experts are local (one rank, no dispatcher): the multi-rank MoE path and the reference
model that loads checkpoints come with later issues. The forward never syncs with the host,
so it can be captured.

Shapes: T tokens, H hidden, Hq/Hkv heads, D head dim, E experts, K top-k, I expert size, V vocab.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dp_runtime.model.elementwise_ops import TorchOps
from dp_runtime.model.experts import grouped_mm_supported, routed_experts
from dp_runtime.model.layers import RotaryEmbedding, qk_norm_attention, rms_norm

__all__ = ["MoEStack", "MoEStackConfig"]

# The benchmark stack keeps torch's norm and rotary (what its recorded numbers ran).
_TORCH_OPS = TorchOps()


@dataclass(frozen=True)
class MoEStackConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    rms_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position: int = 4096
    norm_topk_prob: bool = True

    @classmethod
    def qwen3_30b_a3b(cls, num_layers: int = 8, vocab_size: int = 151_936, max_position: int = 4096) -> MoEStackConfig:
        """Qwen3-30B-A3B's layer shape (48 layers in the real model; ``num_layers`` here)."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=2048,
            num_layers=num_layers,
            num_q_heads=32,
            num_kv_heads=4,
            head_dim=128,
            num_experts=128,
            top_k=8,
            expert_intermediate_size=768,
            max_position=max_position,
        )


def _randn(
    shape: tuple[int, ...], std: float, gen: torch.Generator, dtype: torch.dtype, device: torch.device
) -> nn.Parameter:
    w = torch.randn(shape, generator=gen, dtype=torch.float32, device=device).mul_(std).to(dtype)
    return nn.Parameter(w, requires_grad=False)


class _Layer(nn.Module):
    def __init__(self, c: MoEStackConfig, gen: torch.Generator, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        std = h**-0.5
        qkv = (c.num_q_heads + 2 * c.num_kv_heads) * d
        self.attn_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.q_norm = nn.Parameter(torch.ones(d, dtype=dtype, device=device), requires_grad=False)
        self.k_norm = nn.Parameter(torch.ones(d, dtype=dtype, device=device), requires_grad=False)
        self.w_qkv = _randn((qkv, h), std, gen, dtype, device)
        self.w_o = _randn((h, c.num_q_heads * d), (c.num_q_heads * d) ** -0.5, gen, dtype, device)
        self.moe_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.w_router = _randn((c.num_experts, h), std, gen, dtype, device)
        i = c.expert_intermediate_size
        self.w13 = _randn((c.num_experts, 2 * i, h), std, gen, dtype, device)
        self.w2 = _randn((c.num_experts, h, i), i**-0.5, gen, dtype, device)


class MoEStack(nn.Module):
    """The decoder stack (module docstring). ``attention`` is the backend the layers call.

    Args:
        config: the shapes.
        attention: an attention backend (``dp_runtime.attention``).
        dtype, device: of the weights (bf16 on GPU, float32 for CPU tests).
        seed: weights are ``randn(seed)``: two stacks with one seed are the same model.
        use_grouped_mm: None for "when supported" (CUDA sm90+, bf16), else forced.
    """

    def __init__(
        self,
        config: MoEStackConfig,
        attention: Any,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        seed: int = 0,
        use_grouped_mm: bool | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        c = config
        self.config = c
        self.attention = attention
        self.use_grouped_mm = grouped_mm_supported(device, dtype) if use_grouped_mm is None else use_grouped_mm
        self.embed = _randn((c.vocab_size, c.hidden_size), 1.0, gen, dtype, device)
        self.layers = nn.ModuleList([_Layer(c, gen, dtype, device) for _ in range(c.num_layers)])
        self.final_norm = nn.Parameter(torch.ones(c.hidden_size, dtype=dtype, device=device), requires_grad=False)
        # A large LM-head scale spreads the logits, so greedy ties (which no tolerance can
        # settle) are rare in tests that compare tokens.
        self.lm_head = _randn((c.vocab_size, c.hidden_size), 4.0 * c.hidden_size**-0.5, gen, dtype, device)
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, device)

    def with_attention(self, attention: Any) -> MoEStack:
        """The same weights (shared, not copied) calling another attention object."""
        other = copy.copy(self)
        other.attention = attention
        return other

    def _moe(self, layer: _Layer, x_TH: torch.Tensor) -> torch.Tensor:
        c = self.config
        probs_TE = torch.softmax((x_TH @ layer.w_router.T).float(), dim=-1)
        weights_TK, ids_TK = torch.topk(probs_TE, c.top_k, dim=-1)
        if c.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        return routed_experts(x_TH, ids_TK, weights_TK, layer.w13, layer.w2, use_grouped_mm=self.use_grouped_mm)

    def forward(self, batch: Any) -> torch.Tensor:
        c = self.config
        h_TH = self.embed[batch.input_ids]
        for i, layer in enumerate(self.layers):
            h_TH = h_TH + qk_norm_attention(
                rms_norm(h_TH, layer.attn_norm, c.rms_eps), layer.w_qkv, layer.q_norm, layer.k_norm, layer.w_o,
                num_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_eps,
                rotary=self.rotary, attention=self.attention, layer_id=i, batch=batch, ops=_TORCH_OPS,
            )
            h_TH = h_TH + self._moe(layer, rms_norm(h_TH, layer.moe_norm, c.rms_eps))
        return (rms_norm(h_TH, self.final_norm, c.rms_eps) @ self.lm_head.T).float()
