"""MoE routing on torch ops: router logits -> softmax -> top-k (-> renormalised). The CPU and
fallback path, and the reference for ``routing_triton.softmax_topk_triton``.

Shapes: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch

from dispatcher.partition import INVALID_EXPERT_ID

__all__ = ["PADDING_ID", "check_top_k", "softmax_topk"]

# The id a padding row's picks get when the caller says how many rows are live: the dispatchers'
# invalid id, outside every rank's [0, L), so the expert paths give the row no slot and no GEMM
# rows (a graph bucket's padding rows share one hidden state: they would all land on the same
# top-k experts and fill whole blocks of them).
PADDING_ID = INVALID_EXPERT_ID


def check_top_k(logits_TE: torch.Tensor, top_k: int) -> None:
    """Raise ValueError unless ``logits_TE`` is (T, E) and 1 <= ``top_k`` <= E."""
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE: expected (T, E), got shape {tuple(logits_TE.shape)}")
    if not 1 <= top_k <= logits_TE.shape[1]:
        raise ValueError(f"top_k={top_k}: must be in [1, E={logits_TE.shape[1]}]")


def softmax_topk(logits_TE: torch.Tensor, top_k: int, *, renormalize: bool,
                 live_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over E in fp32, the ``top_k`` largest probabilities, divided by their sum when
    ``renormalize``. Returns ``(weights_TK fp32, ids_TK int32)``, largest weight first.
    ``live_rows``: a one-element integer tensor on the logits' device; rows from it on are
    padding, their ids ``PADDING_ID`` and weights 0 (read on the device: capturable)."""
    check_top_k(logits_TE, top_k)
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    ids_TK = ids_TK.to(torch.int32)
    if live_rows is not None:
        live_T1 = (torch.arange(logits_TE.shape[0], device=logits_TE.device)
                   < live_rows.reshape(1))[:, None]
        ids_TK = torch.where(live_T1, ids_TK, PADDING_ID)
        weights_TK = torch.where(live_T1, weights_TK, 0.0)
    return weights_TK, ids_TK
