"""Choosing each request's next token from its logits row, on the logits' device: greedy, or
temperature + top-k + top-p.

Every row gets the argmax. A row that samples (temperature > 0) is then drawn from
``softmax(z)``, ``z = logits / temperature``, over the tokens its filters keep:

1. top-k keeps the k most likely tokens;
2. top-p, on what top-k kept: a token stays while the mass ranked above it is below ``top_p``
   (the most likely always stays);
3. the exponential race: ``argmax(z - log(E))`` over the kept tokens, ``E ~ Exp(1)`` per
   token, is a draw from ``softmax(z)`` restricted to them (the Gumbel-max trick).

Both filters come down to one threshold per row on the raw logits (``_thresholds``: the value
of the last kept token; z is monotonic in the logit), found with torch on the rows that filter,
``ROW_CHUNK`` rows at a time: a row with top-k among its k values, one with top-p alone by
sorting its vocabulary. The race then runs on CUDA as one Triton launch for every drawn row
(``sampling_triton``), elsewhere with torch a row at a time.

The noise of a draw is keyed by the request's seed and the token's index in its output
(``draw_keys``): the same request draws the same tokens whatever else is in its batch, on
whichever rank runs it, with or without overlapped steps. CUDA (Philox in the kernel) and CPU
(a torch generator per draw) draw different streams from the same key. Nothing crosses to the
host here: the step's ids and a flag per drawn row go back with one asynchronous copy
(``step_tokens``), so a sampled batch keeps the overlap a greedy batch has. A row whose ``z``
is not finite (NaN logits, or a temperature so small that ``logits / temperature`` overflows
float32) is flagged: that request alone fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dp_runtime.serving.request import SamplingParams
from dp_runtime.serving.sampling_triton import race_triton, triton

__all__ = ["ROW_CHUNK", "DrawnTokens", "RowFailure", "draw_failure", "draw_tokens", "host_to_device"]

ROW_CHUNK = 64  # rows whose thresholds are found together: bounds the rows x vocabulary temporaries
_MASK64 = 2**64 - 1


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


def draw_tokens(logits_BV: torch.Tensor, params: Sequence[SamplingParams | None], indices: Sequence[int],
                *, use_triton: bool | None = None) -> DrawnTokens:
    """One token per row of ``logits_BV`` (float32, B rows) by ``params[i]`` (None: the argmax,
    e.g. a prompt chunk that does not sample); a sampled row draws the token at output index
    ``indices[i]`` of its request (module docstring). ``use_triton``: the race's kernel (default:
    on CUDA tensors)."""
    if logits_BV.shape[0] != len(params) or len(params) != len(indices):
        raise ValueError(f"draw_tokens: {logits_BV.shape[0]} logits rows, {len(params)} params, "
                         f"{len(indices)} indices")
    ids_B = logits_BV.argmax(dim=-1)
    drawn = tuple(i for i, p in enumerate(params) if p is not None and not p.greedy)
    if not drawn:
        return DrawnTokens(ids_B)
    dev = logits_BV.device
    seeds = [_signed64(params[i].seed) for i in drawn]
    rows_R, seed_R, index_R = host_to_device([drawn, seeds, [indices[i] for i in drawn]], torch.int64, dev).unbind(0)
    temp_R = host_to_device([params[i].temperature for i in drawn], torch.float32, dev)
    thr_R = _thresholds(logits_BV, [params[i] for i in drawn], rows_R, temp_R)
    if use_triton is None:
        use_triton = logits_BV.is_cuda and triton is not None
    race = race_triton if use_triton else _race_torch
    tokens_R, failed_R = race(logits_BV, rows_R, temp_R, thr_R, seed_R, index_R)
    ids_B.index_copy_(0, rows_R, tokens_R)
    return DrawnTokens(ids_B, drawn, failed_R)


def host_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, through pinned memory on CUDA: the copy is queued
    on the stream without waiting for it (a step's host work overlaps the step before)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _signed64(seed: int) -> int:
    """The seed's 64 bits as an int64 (seeds are in [0, 2**64))."""
    return seed - 2**64 if seed >= 2**63 else seed


def _thresholds(logits_BV: torch.Tensor, params: Sequence[SamplingParams], rows_R: torch.Tensor,
                temp_R: torch.Tensor) -> torch.Tensor:
    """Each drawn row's threshold on its raw logits: the smallest value its top-k and top-p keep
    (-inf where it filters nothing)."""
    vocab = logits_BV.shape[1]
    thr_R = torch.full((len(params),), -torch.inf, device=logits_BV.device)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    filtering = [r for r, (p, k) in enumerate(zip(params, ks, strict=True)) if k or p.top_p < 1]
    for lo in range(0, len(filtering), ROW_CHUNK):
        chunk = filtering[lo : lo + ROW_CHUNK]
        at = host_to_device(chunk, torch.int64, logits_BV.device)
        x = logits_BV.index_select(0, rows_R.index_select(0, at)).float()
        k_c = [ks[r] for r in chunk]
        p_c = [params[r].top_p for r in chunk]
        k_C, top_p_C = host_to_device([k_c, p_c], torch.float32, logits_BV.device).unbind(0)
        k_C = k_C.long()
        thr = torch.full((len(chunk),), -torch.inf, device=logits_BV.device)
        ranked = None
        if max(k_c):
            ranked = x.topk(max(k_c), dim=-1).values  # descending
            thr = ranked.gather(1, (k_C - 1).clamp(min=0)[:, None])[:, 0].masked_fill_(k_C == 0, -torch.inf)
            past_k = torch.arange(ranked.shape[1], device=x.device)[None, :] >= k_C[:, None]
            ranked.masked_fill_(past_k & (k_C[:, None] > 0), -torch.inf)
        if min(p_c) < 1:
            if ranked is None or any(p < 1 and k == 0 for p, k in zip(p_c, k_c, strict=True)):
                # a row with top-p alone ranks its whole vocabulary (past its top-k: -inf)
                ranked = x.masked_fill_(x < thr[:, None], -torch.inf).sort(dim=-1, descending=True).values
            probs = (ranked / temp_R.index_select(0, at)[:, None]).softmax(dim=-1)
            above = probs.cumsum(dim=-1).sub_(probs)
            n_keep = (above < top_p_C[:, None]).sum(dim=-1).clamp_(min=1)
            thr_p = ranked.gather(1, (n_keep - 1)[:, None])[:, 0].masked_fill_(top_p_C >= 1, -torch.inf)
            thr = torch.maximum(thr, thr_p)
        thr_R.index_copy_(0, at, thr)
    return thr_R


def _race_torch(logits_BV: torch.Tensor, rows_R: torch.Tensor, temp_R: torch.Tensor, thr_R: torch.Tensor,
                seed_R: torch.Tensor, index_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling_triton.race_triton``'s contract with torch, a row at a time: the noise of a
    draw from a generator seeded by its (seed, index) key (a host loop: CPU ranks)."""
    tokens, failed = [], []
    for row, t, thr, seed, index in zip(rows_R.tolist(), temp_R.tolist(), thr_R.tolist(), seed_R.tolist(),
                                        index_R.tolist(), strict=True):
        x = logits_BV[row].float()
        z = x / t
        gen = torch.Generator(logits_BV.device).manual_seed(_mix(seed & _MASK64, index))
        e = torch.empty_like(z).exponential_(generator=gen).clamp_min_(torch.finfo(torch.float32).tiny)
        score = (z - e.log()).masked_fill_(x < thr, -torch.inf)
        tokens.append(int(score.argmax()))
        failed.append(bool(torch.isnan(z).any() or z.max() == torch.inf))
    dev = logits_BV.device
    return torch.tensor(tokens, dtype=torch.int64, device=dev), torch.tensor(failed, dtype=torch.bool, device=dev)


def _mix(seed: int, index: int) -> int:
    """A generator seed for a (seed, index) key: SplitMix64's finaliser of the two words."""
    x = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
