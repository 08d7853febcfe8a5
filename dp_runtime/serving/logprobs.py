"""Logprobs of sampled tokens (``SamplingParams.logprobs``): the log-softmax of a step's logits
rows in float32, before temperature, top-k and top-p (vLLM's default "raw" logprobs), so they
describe the model, not the draw.

Only rows that asked are computed, on the logits' device (one log-softmax and one top-k over
those rows), and cross to the host together: a few floats per row, never the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dp_runtime.serving.request import TokenLogprob

__all__ = ["token_logprobs"]


def token_logprobs(logits_RV: torch.Tensor, tokens: Sequence[object], tops: Sequence[int]
                   ) -> list[TokenLogprob | None]:
    """For row ``r`` of ``logits_RV``: ``(logprob of tokens[r], ((id, logprob), ...))`` with the
    ``tops[r]`` most likely ids, most likely first (ties in torch.topk's order); None where
    ``tokens[r]`` is not an int (its draw failed)."""
    lp_RV = torch.log_softmax(logits_RV.float(), dim=-1)
    ok = [isinstance(t, int) for t in tokens]
    picked_R = torch.tensor([t if o else 0 for t, o in zip(tokens, ok, strict=True)],
                            device=lp_RV.device)
    chosen = lp_RV.gather(1, picked_R[:, None])[:, 0].tolist()
    k = min(max(tops, default=0), lp_RV.shape[-1])
    if k:
        top_vals, top_ids = lp_RV.topk(k, dim=-1)
        vals, ids = top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = []
    for r, (o, n) in enumerate(zip(ok, tops, strict=True)):
        top = tuple(zip(ids[r][:n], vals[r][:n], strict=True)) if k and n else ()
        out.append((chosen[r], top) if o else None)
    return out
