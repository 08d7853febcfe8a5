"""Logprobs of sampled tokens (``SamplingParams.logprobs``): the log-softmax of a step's logits
rows in float32, before ``logit_bias``, temperature, top-k and top-p (vLLM's default "raw"
logprobs), so they describe the model, not the draw (the bias is added to a copy of a row:
``sampling.draw_tokens``; these rows are never written).

Only rows that asked are computed, on the logits' device, ``ROW_CHUNK`` rows at a time (one
log-softmax, a gather and a top-k each), and their few floats per row cross to the host with the
step's tokens, asynchronously (``step_tokens``): never the vocabulary, and never a wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dp_runtime.serving.host_copy import device_to_host, host_to_device
from dp_runtime.serving.request import TokenLogprob
from dp_runtime.serving.sampling import ROW_CHUNK

__all__ = ["LogprobRows", "logprob_rows"]


@dataclass(frozen=True)
class LogprobRows:
    """The logprobs of the step's rows ``rows`` (ascending), ``tops[a]`` top alternatives each:
    ``chosen_A`` the logprob of each row's token, ``top_vals_AK`` / ``top_ids_AK`` the K = max
    ``tops`` most likely (ties in torch.topk's order), on whichever device they were made."""

    rows: tuple[int, ...]
    tops: tuple[int, ...]
    chosen_A: torch.Tensor
    top_vals_AK: torch.Tensor
    top_ids_AK: torch.Tensor

    def to_host(self) -> LogprobRows:
        """The same rows with the (CUDA) tensors in pinned host memory, copied without waiting:
        read them after the copy's event."""
        return LogprobRows(self.rows, self.tops, device_to_host(self.chosen_A),
                           device_to_host(self.top_vals_AK), device_to_host(self.top_ids_AK))

    def per_row(self) -> dict[int, TokenLogprob]:
        """Row -> ``(logprob, ((id, logprob), ...))`` (host tensors)."""
        chosen, vals, ids = (self.chosen_A.tolist(), self.top_vals_AK.tolist(),
                             self.top_ids_AK.tolist())
        return {row: (chosen[a], tuple(zip(ids[a][:n], vals[a][:n], strict=True)))
                for a, (row, n) in enumerate(zip(self.rows, self.tops, strict=True))}


def logprob_rows(logits_BV: torch.Tensor, ids_B: torch.Tensor, rows: Sequence[int],
                 tops: Sequence[int]) -> LogprobRows:
    """Logprobs of rows ``rows`` of ``logits_BV`` for their tokens ``ids_B[rows]`` (both on the
    device), with ``tops[a]`` alternatives for row ``rows[a]``."""
    k = min(max(tops, default=0), logits_BV.shape[-1])
    dev = logits_BV.device
    chosen_A = torch.empty(len(rows), dtype=torch.float32, device=dev)
    vals_AK = torch.empty((len(rows), k), dtype=torch.float32, device=dev)
    top_ids_AK = torch.empty((len(rows), k), dtype=torch.int64, device=dev)
    at_A = host_to_device(rows, torch.int64, dev)
    for lo in range(0, len(rows), ROW_CHUNK):
        c = slice(lo, lo + ROW_CHUNK)
        lp = torch.log_softmax(logits_BV.index_select(0, at_A[c]).float(), dim=-1)
        chosen_A[c] = lp.gather(1, ids_B.index_select(0, at_A[c])[:, None])[:, 0]
        if k:
            vals_AK[c], top_ids_AK[c] = lp.topk(k, dim=-1)
    return LogprobRows(tuple(rows), tuple(tops), chosen_A, vals_AK, top_ids_AK)
