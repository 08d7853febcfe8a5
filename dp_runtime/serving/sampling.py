"""Choosing each request's next token from its logits row: greedy, or temperature + top-p.

Greedy rows take the argmax on the device and cross to the host once per step, together. A
sampled row is drawn on the host with the request's own generator (seeded by
``SamplingParams.seed``), so the same request draws the same tokens on whichever rank runs it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dp_runtime.serving.request import SamplingParams

__all__ = ["sample_tokens", "top_p_probs"]


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


def sample_tokens(
    logits_BV: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits_BV`` (float32, B rows), by each row's ``params``;
    ``generators[i]`` (a CPU generator) is used only where row ``i`` samples."""
    if logits_BV.shape[0] != len(params):
        raise ValueError(f"sample_tokens: {logits_BV.shape[0]} logits rows for {len(params)} requests")
    tokens = logits_BV.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(logits_BV[i].float().cpu() / p.temperature, dim=-1)
        probs = top_p_probs(probs, p.top_p)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens
