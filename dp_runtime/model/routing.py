"""MoE routing on torch ops: router logits -> softmax -> top-k (-> renormalised). The CPU and
fallback path, and the reference for ``routing_triton.softmax_topk_triton``.

Shapes: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch

__all__ = ["check_top_k", "softmax_topk"]


def check_top_k(logits_TE: torch.Tensor, top_k: int) -> None:
    """Raise ValueError unless ``logits_TE`` is (T, E) and 1 <= ``top_k`` <= E."""
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE: expected (T, E), got shape {tuple(logits_TE.shape)}")
    if not 1 <= top_k <= logits_TE.shape[1]:
        raise ValueError(f"top_k={top_k}: must be in [1, E={logits_TE.shape[1]}]")


def softmax_topk(logits_TE: torch.Tensor, top_k: int, *, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over E in fp32, the ``top_k`` largest probabilities, divided by their sum when
    ``renormalize``. Returns ``(weights_TK fp32, ids_TK int32)``, largest weight first."""
    check_top_k(logits_TE, top_k)
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return weights_TK, ids_TK.to(torch.int32)
