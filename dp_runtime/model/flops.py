"""Forward FLOPs of the reference model: the matrix work that MFU counts (2 FLOPs per
multiply-add), pure and importable without a GPU.

Per token and layer (H hidden, Hq/Hkv heads of D, E experts, top-K, I expert size, V vocab)::

    projections   2 * H * (Hq + 2 * Hkv) * D        q, k, v (one fused GEMM)
                + 2 * Hq * D * H                     o
    attention     4 * Hq * D * keys                  q @ k^T and p @ v; causal, so a token at
                                                     position p (0-based) sees p + 1 keys
    router        2 * H * E                          sparse layers
    experts       K * 3 * 2 * H * I                  gate, up and down of each routed expert
    dense MLP     3 * 2 * H * I_dense                layers without experts (mlp_only_layers)

and the LM head, ``2 * H * V`` per row the forward returns logits for (one per request of an
extend batch: its last token). Left out: norms, RoPE, softmax, the SwiGLU product, top-k and the
embedding lookup (no matrix work), and any padding rows a graph replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from dp_runtime.model.model_config import ModelConfig

__all__ = ["ForwardFlops", "forward_flops"]


@dataclass(frozen=True)
class ForwardFlops:
    """FLOPs of one forward by component (module docstring); ``total`` sums them."""

    projections: int
    attention: int
    router: int
    experts: int
    dense_mlp: int
    lm_head: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def forward_flops(cfg: ModelConfig, chunks: Sequence[tuple[int, int]],
                  logit_rows: int | None = None) -> ForwardFlops:
    """FLOPs of one forward over ``chunks``: one ``(prefix_len, new_tokens)`` per request, where
    ``prefix_len`` tokens of it are already in the KV cache (0 for a fresh prompt; a decode
    step is ``(context_len, 1)``). ``logit_rows``: rows through the LM head (default: one per
    chunk). Raises ValueError for a negative prefix or a chunk of no tokens."""
    for prefix, new in chunks:
        if prefix < 0 or new < 1:
            raise ValueError(f"forward_flops: a chunk needs prefix_len >= 0 and new_tokens >= 1, "
                             f"got ({prefix}, {new})")
    h, d = cfg.hidden_size, cfg.head_dim
    tokens = sum(new for _, new in chunks)
    # Keys seen by the chunk's tokens at positions prefix .. prefix + new - 1: sum of (p + 1).
    keys = sum(new * prefix + new * (new + 1) // 2 for prefix, new in chunks)
    sparse = sum(cfg.is_sparse(i) for i in range(cfg.num_layers))
    dense = cfg.num_layers - sparse
    layers = cfg.num_layers
    return ForwardFlops(
        projections=layers * tokens * (2 * h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d
                                       + 2 * cfg.num_heads * d * h),
        attention=layers * 4 * cfg.num_heads * d * keys,
        router=sparse * tokens * 2 * h * cfg.num_experts,
        experts=sparse * tokens * cfg.top_k * 3 * 2 * h * cfg.moe_intermediate_size,
        dense_mlp=dense * tokens * 3 * 2 * h * cfg.intermediate_size,
        lm_head=(len(chunks) if logit_rows is None else logit_rows) * 2 * h * cfg.vocab_size,
    )
