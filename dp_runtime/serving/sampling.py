"""Choosing each request's next token from its logits row: greedy, or temperature + top-k +
top-p.

Greedy rows take the argmax on the device and cross to the host once per step, together. A
sampled row is drawn on the host with the request's own generator (seeded by
``SamplingParams.seed``), so the same request draws the same tokens on whichever rank runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dp_runtime.serving.request import SamplingParams

__all__ = ["RowFailure", "sample_tokens", "top_k_probs", "top_p_probs"]


def top_k_probs(probs_V: torch.Tensor, top_k: int) -> torch.Tensor:
    """``probs_V`` restricted to its ``top_k`` most likely tokens, renormalised (0: unchanged)."""
    if top_k <= 0 or top_k >= probs_V.shape[-1]:
        return probs_V
    values, order = torch.topk(probs_V, top_k)
    kept = torch.zeros_like(probs_V).scatter_(0, order, values)
    return kept / kept.sum()


def top_p_probs(probs_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs_V`` restricted to the smallest set of most likely tokens whose mass reaches
    ``top_p``, renormalised (the most likely token always stays)."""
    if top_p >= 1.0:
        return probs_V
    sorted_p, order = torch.sort(probs_V, descending=True)
    before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the tokens ranked above each one
    sorted_p = torch.where(before < top_p, sorted_p, 0.0)
    kept = torch.zeros_like(probs_V).scatter_(0, order, sorted_p)
    return kept / kept.sum()


@dataclass(frozen=True)
class RowFailure:
    """Stands in the token list for a row whose token could not be drawn; ``error`` says why.
    The scheduler fails that request alone (finish_reason "error")."""

    error: str


def sample_tokens(
    logits_BV: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | RowFailure]:
    """One token per row of ``logits_BV`` (float32, B rows), by each row's ``params``;
    ``generators[i]`` (a CPU generator) is used only where row ``i`` samples. A row whose draw
    raises gets a RowFailure instead of a token; the other rows are unaffected."""
    if logits_BV.shape[0] != len(params):
        raise ValueError(f"sample_tokens: {logits_BV.shape[0]} logits rows for {len(params)} requests")
    tokens: list[int | RowFailure] = logits_BV.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        try:
            probs = torch.softmax(logits_BV[i].float().cpu() / p.temperature, dim=-1)
            probs = top_p_probs(top_k_probs(probs, p.top_k), p.top_p)
            tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
        except (RuntimeError, ValueError) as e:
            # One request's draw failing (e.g. a temperature so small that logits / T overflow
            # to inf and the probabilities become NaN) must not cost the others their tokens.
            tokens[i] = RowFailure(f"sampling failed (temperature={p.temperature!r}, top_k={p.top_k!r}, "
                                   f"top_p={p.top_p!r}): "
                                   f"{type(e).__name__}: {e}")
    return tokens
