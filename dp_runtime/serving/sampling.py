"""Choosing each request's next token from its logits row, on the logits' device: greedy, or
temperature + top-k + top-p.

Every row gets the argmax. Rows that sample (temperature > 0) are then drawn, 64 rows at a
time (``ROW_CHUNK``: the temporaries are a few rows x vocabulary, whatever the batch):

1. ``z = logits / temperature`` in float32;
2. top-k: every ``z`` below the row's k-th largest is dropped (set to -inf);
3. top-p, on what top-k kept: the most likely tokens are kept while the mass ranked above a
   token is below ``top_p`` (the most likely always stays), the rest dropped; a row with top-k
   finds its threshold among its k values, a row without sorts its vocabulary;
4. the exponential race: ``argmax(z - log(q))``, ``q ~ Exp(1)`` drawn by the request's own
   generator, is a draw from ``softmax(z)`` over the kept tokens (the Gumbel-max trick).

Nothing crosses to the host here: the step's ids (and a flag per drawn row) go back with one
asynchronous copy (``step_tokens``), so a sampled batch keeps the overlap a greedy batch has.
The host loop is a launch per sampled row (its ``q``); the rest is a few launches per chunk.

Each request's generator lives on the logits' device, seeded by ``SamplingParams.seed``, and
draws one ``q`` row per token, so a seeded request draws the same tokens whatever else is in its
batch and whichever rank runs it (given the same logits); different GPU kinds may give a
generator different streams. A row whose ``z`` is not finite (NaN logits, or a temperature so
small that ``logits / temperature`` overflows float32) is flagged: that request alone fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dp_runtime.serving.request import SamplingParams

__all__ = ["ROW_CHUNK", "DrawnTokens", "RowFailure", "draw_failure", "draw_tokens", "host_to_device"]

ROW_CHUNK = 64  # sampled rows drawn together: bounds the float32 rows x vocabulary temporaries


@dataclass(frozen=True)
class RowFailure:
    """Stands in the token list for a row whose token could not be drawn; ``error`` says why.
    The scheduler fails that request alone (finish_reason "error")."""

    error: str


@dataclass(frozen=True)
class DrawnTokens:
    """A step's tokens on the device: ``ids_B`` (int64, one per logits row: the argmax, or the
    draw where the row sampled); ``drawn`` the rows that sampled (host list, ascending) and
    ``failed_R`` (bool on the device, one per drawn row) where that draw was not defined."""

    ids_B: torch.Tensor
    drawn: tuple[int, ...] = ()
    failed_R: torch.Tensor | None = None


def draw_failure(p: SamplingParams) -> RowFailure:
    """What a flagged row (``DrawnTokens.failed_R``) reports."""
    return RowFailure(f"sampling failed (temperature={p.temperature!r}, top_k={p.top_k!r}, top_p={p.top_p!r}): "
                      f"logits / temperature is not finite (NaN logits, or overflow past float32)")


def draw_tokens(logits_BV: torch.Tensor, params: Sequence[SamplingParams | None],
                generators: Sequence[torch.Generator | None]) -> DrawnTokens:
    """One token per row of ``logits_BV`` (B rows) by ``params[i]`` (None: the argmax, e.g. a
    prompt chunk that does not sample); ``generators[i]`` (on the logits' device) is used where
    row ``i`` samples (module docstring)."""
    if logits_BV.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"draw_tokens: {logits_BV.shape[0]} logits rows, {len(params)} params, "
                         f"{len(generators)} generators")
    ids_B = logits_BV.argmax(dim=-1)
    drawn = tuple(i for i, p in enumerate(params) if p is not None and not p.greedy)
    if not drawn:
        return DrawnTokens(ids_B)
    vocab, dev = logits_BV.shape[1], logits_BV.device
    rows_R, top_k_R = host_to_device([drawn, [_top_k(params[i].top_k, vocab) for i in drawn]], torch.int64,
                                     dev).unbind(0)
    temp_R, top_p_R = host_to_device([[params[i].temperature for i in drawn], [params[i].top_p for i in drawn]],
                                     torch.float32, dev).unbind(0)
    tokens_R = torch.empty(len(drawn), dtype=torch.int64, device=dev)
    failed_R = torch.empty(len(drawn), dtype=torch.bool, device=dev)
    for lo in range(0, len(drawn), ROW_CHUNK):
        c = slice(lo, lo + ROW_CHUNK)
        chunk = [params[i] for i in drawn[c]]
        z = logits_BV.index_select(0, rows_R[c]).float()  # a copy: logprobs read the raw rows
        z.div_(temp_R[c, None])
        bad = ~(z.amax(dim=-1) < torch.inf)  # NaN, or an overflow to +inf
        failed_R[c] = bad
        z.masked_fill_(bad[:, None], 0.0)  # a flagged row draws something harmless, then fails
        ks = [_top_k(p.top_k, vocab) for p in chunk]
        kept = _apply_top_k(z, top_k_R[c], max(ks)) if max(ks) else None
        if any(p.top_p < 1 for p in chunk):
            # Rows with top-k find the threshold among their k values; one without sorts them all.
            full = kept is None or any(p.top_p < 1 and k == 0 for p, k in zip(chunk, ks, strict=True))
            _apply_top_p(z, z.sort(dim=-1, descending=True).values if full else kept, top_p_R[c])
        q = torch.empty_like(z)
        for r, i in enumerate(drawn[c]):
            q[r].exponential_(generator=generators[i])
        # argmax(z - log q): clamp q away from 0 so that a dropped token (-inf) never meets +inf.
        tokens_R[c] = q.clamp_min_(torch.finfo(torch.float32).tiny).log_().neg_().add_(z).argmax(dim=-1)
    ids_B.index_copy_(0, rows_R, tokens_R)
    return DrawnTokens(ids_B, drawn, failed_R)


def host_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, through pinned memory on CUDA: the copy is queued
    on the stream without waiting for it (a step's host work overlaps the step before)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _top_k(k: int, vocab: int) -> int:
    """The row's k where it restricts anything, else 0."""
    return k if 0 < k < vocab else 0


def _apply_top_k(z_CV: torch.Tensor, k_C: torch.Tensor, k_max: int) -> torch.Tensor:
    """Drop every ``z`` below its row's k-th largest (rows with k 0 keep all); returns each
    row's ``k_max`` largest values, descending, with those past the row's k set to -inf (the
    ranked values top-p needs)."""
    vals = z_CV.topk(k_max, dim=-1).values
    thr = vals.gather(1, (k_C - 1).clamp(0, k_max - 1)[:, None])
    thr.masked_fill_(k_C[:, None] == 0, -torch.inf)
    z_CV.masked_fill_(z_CV < thr, -torch.inf)
    past_k = torch.arange(k_max, device=z_CV.device)[None, :] >= k_C[:, None]
    return vals.masked_fill_(past_k & (k_C[:, None] > 0), -torch.inf)


def _apply_top_p(z_CV: torch.Tensor, ranked_CW: torch.Tensor, top_p_C: torch.Tensor) -> None:
    """Drop the tokens of each row outside its nucleus: ``ranked_CW`` holds the row's kept
    values, descending (-inf past them); a token stays while the mass ranked above it is below
    ``top_p`` (rows with top_p 1 keep all)."""
    probs = ranked_CW.softmax(dim=-1)
    above = probs.cumsum(dim=-1).sub_(probs)
    n_keep = (above < top_p_C[:, None]).sum(dim=-1).clamp_(min=1)
    thr = ranked_CW.gather(1, (n_keep - 1)[:, None])
    thr.masked_fill_(top_p_C[:, None] >= 1, -torch.inf)
    z_CV.masked_fill_(z_CV < thr, -torch.inf)

