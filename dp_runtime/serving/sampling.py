"""Choosing each request's next token from its logits row, on the logits' device: greedy, or
temperature + top-k + top-p + min-p.

Every row gets the argmax. A row that samples (temperature > 0) is then drawn from
``softmax(z)``, ``z = logits / temperature``, over the tokens its filters keep:

1. top-k keeps the k most likely tokens;
2. top-p, on what top-k kept: a token stays while the mass ranked above it is below ``top_p``
   (the most likely always stays);
3. min-p: a token stays if its probability is at least ``min_p`` times the row's largest, i.e.
   ``x >= max(x) + temperature * log(min_p)`` on the raw logits x. Relative to the most likely
   token, which every filter keeps, it is the same on the whole row or on what top-k and top-p
   kept: the kept set is the intersection (transformers' and SGLang's rule; vLLM applies min-p
   first and top-p's mass then counts only its survivors);
4. the exponential race: ``argmax(z - log(E))`` over the kept tokens, ``E ~ Exp(1)`` per
   token, is a draw from ``softmax(z)`` restricted to them (the Gumbel-max trick).

The filters come down to one threshold per row on the raw logits (the value of the last kept
token; z is monotonic in the logit), found on the rows that filter, and the row's threshold is
the largest:

- top-k and top-p (``_thresholds``): a row with top-k among its k values (torch's topk,
  ``ROW_CHUNK`` rows at a time); one with top-p alone, on CUDA, by a search over its values in
  one set of Triton launches for all such rows (``top_p_search``: no sort, no rows x vocabulary
  temporary), elsewhere by sorting its vocabulary (``SORT_CHUNK`` rows at a time);
- min-p (``_min_p_thresholds``): from the row's max alone.

The race then runs on CUDA as one Triton launch for every drawn row
(``sampling_triton.race_triton``), elsewhere with torch a row at a time.

The noise of a draw is keyed by the request's seed and the token's index in its output
(``draw_keys``): the same request draws the same tokens whatever else is in its batch, on
whichever rank runs it, with or without overlapped steps. CUDA (Philox in the kernel) and CPU
(a torch generator per draw) draw different streams from the same key. Nothing crosses to the
host here: the step's ids and a flag per drawn row go back with one asynchronous copy
(``step_tokens``), so a sampled batch keeps the overlap a greedy batch has. A row whose ``z``
is not finite (NaN logits, or a temperature so small that ``logits / temperature`` overflows
float32) is flagged: that request alone fails. A temperature above float32's largest value is
drawn at that value (in float32 it would be inf, and ``inf * log(1)``, min-p 1's threshold, NaN),
a top-p below its smallest normal one at that one (0 in float32, where the search's
``mass >= top_p * total`` would fail the top token too): both already draw as their limit (all
tokens alike; the most likely alone), so every value ``check_sampling`` takes draws.

A request's repetition, presence and frequency penalties and its ``logit_bias`` are applied,
before all of this, to a copy of its row (``adjusted_rows``: ``ROW_CHUNK`` rows at a time, the
counts and marks the penalties need read from tables on the device, ``penalty_counts``; no host
sync), so
greedy rows take the argmax of the adjusted logits and sampled rows draw from them, while the
logits the step's logprobs read stay raw. A step without a bias or a penalty takes none of that
path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dp_runtime.serving.adjusted_rows import adjusted_chunks
from dp_runtime.serving.host_copy import host_to_device
from dp_runtime.serving.penalty_counts import StepCounts
from dp_runtime.serving.request import SamplingParams
from dp_runtime.serving.sampling_triton import race_triton, triton
from dp_runtime.serving.top_p_search import top_p_thresholds

__all__ = ["ROW_CHUNK", "SORT_CHUNK", "DrawnTokens", "RowFailure", "StepCounts", "draw_failure",
           "draw_tokens", "host_to_device"]

# rows whose top-k thresholds are found together: bounds the rows x vocabulary temporaries
ROW_CHUNK = 64
# rows sorted together for a top-p without top-k (a sort's buffers: ~48 bytes an element)
SORT_CHUNK = 16
_MASK64 = 2**64 - 1
_F32 = torch.finfo(torch.float32)  # the device's temperatures and top-p values (module docstring)


@dataclass(frozen=True)
class RowFailure:
    """Stands in the token list for a row whose token could not be drawn; ``error`` says why.
    The scheduler fails that request alone (finish_reason "error")."""

    error: str


@dataclass(frozen=True)
class DrawnTokens:
    """A step's tokens on the device: ``ids_B`` (int64, one per logits row: the argmax, or the
    draw where the row sampled); ``drawn`` the rows that sampled (host tuple) and ``failed_R``
    (bool on the device, one per drawn row, in ``drawn``'s order) where that draw was not
    defined. ``drawn`` is ascending, except that rows with a ``logit_bias``, a penalty or a ban
    come after the others (each group ascending)."""

    ids_B: torch.Tensor
    drawn: tuple[int, ...] = ()
    failed_R: torch.Tensor | None = None


def draw_failure(p: SamplingParams) -> RowFailure:
    """What a flagged row (``DrawnTokens.failed_R``) reports."""
    return RowFailure(f"sampling failed (temperature={p.temperature!r}, top_k={p.top_k!r}, "
                      f"top_p={p.top_p!r}, min_p={p.min_p!r}): logits / temperature is not finite "
                      "(NaN logits, or overflow past float32)")


def draw_tokens(logits_BV: torch.Tensor, params: Sequence[SamplingParams | None],
                indices: Sequence[int], *, counts: StepCounts | None = None,
                use_triton: bool | None = None, bans: Sequence[Sequence[int]] = ()) -> DrawnTokens:
    """One token per row of ``logits_BV`` (float32, B rows) by ``params[i]`` (None: the argmax,
    e.g. a prompt chunk that does not sample); row i chooses the token at output index
    ``indices[i]`` of its request (a sampled row's noise is keyed by it: module docstring). A row
    with a ``logit_bias`` or a penalty is chosen from an adjusted copy of its logits
    (``adjusted_rows``; ``counts``: how often each row's request generated each token before
    and which tokens its prompt and output hold, on the device, needed where a row has a
    penalty): ``logits_BV`` itself is never written, so the logprobs read from it after the draw
    stay raw. ``bans[i]`` (empty, or one entry per row): ids row i may not take (-inf in its
    copy; ``SamplingParams.min_tokens``). ``use_triton``: the Triton kernels, the top-p search
    and the race (default: on CUDA tensors)."""
    if logits_BV.shape[0] != len(params) or len(params) != len(indices):
        raise ValueError(f"draw_tokens: {logits_BV.shape[0]} logits rows, {len(params)} params, "
                         f"{len(indices)} indices")
    ids_B = logits_BV.argmax(dim=-1)
    drawn = tuple(i for i, p in enumerate(params) if p is not None and not p.greedy)
    adjusted = [i for i, p in enumerate(params)
                if p is not None and (p.adjusted or (bans and bans[i]))]
    if not drawn and not adjusted:
        return DrawnTokens(ids_B)
    if use_triton is None:
        use_triton = logits_BV.is_cuda and triton is not None
    chosen = set(adjusted)
    plain = tuple(i for i in drawn if i not in chosen)
    fails = []
    if plain:  # the common step: every drawn row raced on the logits as they are
        rows_R, tokens_R, failed_R = _race_rows(logits_BV, plain, [params[i] for i in plain],
                                                [indices[i] for i in plain], use_triton)
        ids_B.index_copy_(0, rows_R, tokens_R)
        fails.append(failed_R)
    chunks = adjusted_chunks(logits_BV, adjusted, params, counts, ROW_CHUNK, use_triton, bans)
    for chunk, rows_C, x_CV in chunks:
        ids_C = x_CV.argmax(dim=-1)
        sampled = [j for j, row in enumerate(chunk) if not params[row].greedy]
        # raced on the copy as they would be on logits_BV (the race: rows of one tensor)
        if sampled:
            at_R, tokens_R, failed_R = _race_rows(x_CV, sampled,
                                                  [params[chunk[j]] for j in sampled],
                                                  [indices[chunk[j]] for j in sampled], use_triton)
            ids_C.index_copy_(0, at_R, tokens_R)
            fails.append(failed_R)
        ids_B.index_copy_(0, rows_C, ids_C)
    order = plain + tuple(i for i in adjusted if not params[i].greedy)
    return DrawnTokens(ids_B, order, torch.cat(fails) if fails else None)


def _race_rows(x_XV: torch.Tensor, at: Sequence[int], params: Sequence[SamplingParams],
               indices: Sequence[int],
               use_triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw rows ``at`` of ``x_XV`` (``params[r]`` and output index ``indices[r]`` for row
    ``at[r]``), with the Triton kernels or torch: ``(at_R on the device, tokens_R, failed_R)``."""
    dev = x_XV.device
    seeds = [_signed64(p.seed) for p in params]
    at_R, seed_R, index_R = host_to_device([list(at), seeds, list(indices)], torch.int64,
                                           dev).unbind(0)
    temp_R = host_to_device([min(p.temperature, _F32.max) for p in params], torch.float32, dev)
    thr_R = _thresholds(x_XV, params, at_R, temp_R, use_triton)
    if any(p.min_p > 0 for p in params):
        thr_R = torch.maximum(thr_R, _min_p_thresholds(x_XV, params, at_R, temp_R))
    race = race_triton if use_triton else _race_torch
    tokens_R, failed_R = race(x_XV, at_R, temp_R, thr_R, seed_R, index_R)
    return at_R, tokens_R, failed_R


def _top_p(p: SamplingParams) -> float:
    """``p.top_p`` as the device takes it: at least float32's smallest normal (module docstring)."""
    return max(p.top_p, _F32.tiny)


def _signed64(seed: int) -> int:
    """The seed's 64 bits as an int64 (seeds are in [0, 2**64))."""
    return seed - 2**64 if seed >= 2**63 else seed


def _thresholds(logits_BV: torch.Tensor, params: Sequence[SamplingParams], rows_R: torch.Tensor,
                temp_R: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """Each drawn row's threshold on its raw logits: the smallest value its top-k and top-p keep
    (-inf where it filters nothing). Rows with top-k rank their k values, ``ROW_CHUNK`` rows at
    a time; rows with top-p alone are searched in one launch (``use_triton``) or sort their
    vocabulary, ``SORT_CHUNK`` rows at a time (a sort's buffers take ~48 bytes per element:
    memory_estimates.draw_phase_bytes)."""
    vocab, dev = logits_BV.shape[1], logits_BV.device
    thr_R = torch.full((len(params),), -torch.inf, device=dev)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    ranked_k = [r for r, k in enumerate(ks) if k]
    sorted_p = [r for r, (p, k) in enumerate(zip(params, ks, strict=True)) if not k and p.top_p < 1]
    groups = [(ranked_k, ROW_CHUNK)]
    if not use_triton:
        groups.append((sorted_p, SORT_CHUNK))
    elif sorted_p:
        at = host_to_device(sorted_p, torch.int64, dev)
        top_p = host_to_device([_top_p(params[r]) for r in sorted_p], torch.float32, dev)
        found = top_p_thresholds(logits_BV, rows_R.index_select(0, at), temp_R.index_select(0, at),
                                 top_p)
        thr_R.index_copy_(0, at, found)
    for group, size in groups:
        for lo in range(0, len(group), size):
            chunk = group[lo : lo + size]
            at = host_to_device(chunk, torch.int64, dev)
            x = logits_BV.index_select(0, rows_R.index_select(0, at)).float()
            k_c = [ks[r] for r in chunk]
            k_C, top_p_C = host_to_device([k_c, [_top_p(params[r]) for r in chunk]], torch.float32,
                                          dev).unbind(0)
            if group is ranked_k:
                ranked = x.topk(max(k_c), dim=-1).values  # descending
                k_C = k_C.long()
                thr = ranked.gather(1, (k_C - 1)[:, None])[:, 0]
                ranked.masked_fill_(
                    torch.arange(ranked.shape[1], device=dev)[None, :] >= k_C[:, None], -torch.inf)
            else:
                ranked = x.sort(dim=-1, descending=True).values
                thr = torch.full((len(chunk),), -torch.inf, device=dev)
            del x
            if any(params[r].top_p < 1 for r in chunk):
                thr = torch.maximum(thr, _top_p_threshold(ranked, temp_R.index_select(0, at),
                                                          top_p_C))
            thr_R.index_copy_(0, at, thr)
    return thr_R


def _min_p_thresholds(logits_XV: torch.Tensor, params: Sequence[SamplingParams],
                      rows_R: torch.Tensor, temp_R: torch.Tensor) -> torch.Tensor:
    """Each drawn row's min-p threshold on its raw logits, ``max(x) + temperature * log(min_p)``
    (-inf where min_p is 0). The max is taken over every row of ``logits_XV`` in one reduction,
    then the drawn rows' are picked: one read of the rows, where gathering the drawn rows first
    would read them twice and write a rows x vocabulary copy (so memory_estimates.
    draw_phase_bytes needs no term for it). With min_p 1 the threshold is the max itself (0
    added): the top token always stays."""
    min_p_R = host_to_device([p.min_p for p in params], torch.float32, logits_XV.device)
    top_R = logits_XV.amax(dim=-1).float().index_select(0, rows_R)
    thr_R = top_R.add_(temp_R * min_p_R.log())
    return thr_R.masked_fill_(min_p_R == 0, -torch.inf)


def _top_p_threshold(ranked_CW: torch.Tensor, temp_C: torch.Tensor,
                     top_p_C: torch.Tensor) -> torch.Tensor:
    """The raw value of each row's last nucleus token: ``ranked_CW`` holds the row's kept raw
    logits, descending (-inf past them); token i stays while the mass ranked above it (at the
    row's temperature) is below ``top_p``, i.e. for i <= the count of inclusive sums below it
    (rows with top_p 1 keep all: -inf). One C x W float32 buffer, worked in place."""
    probs = ranked_CW.div(temp_C[:, None])
    # the first column is the row's largest (a copy: no aliasing)
    probs.sub_(probs[:, :1].clone()).exp_()
    probs.div_(probs.sum(dim=-1, keepdim=True)).cumsum_(dim=-1)
    n_keep = (probs < top_p_C[:, None]).sum(dim=-1).add_(1).clamp_(max=ranked_CW.shape[1])
    thr = ranked_CW.gather(1, (n_keep - 1)[:, None])[:, 0]
    return thr.masked_fill_(top_p_C >= 1, -torch.inf)


def _race_torch(logits_BV: torch.Tensor, rows_R: torch.Tensor, temp_R: torch.Tensor,
                thr_R: torch.Tensor, seed_R: torch.Tensor,
                index_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling_triton.race_triton``'s contract with torch, a row at a time: the noise of a
    draw from a generator seeded by its (seed, index) key (a host loop: CPU ranks)."""
    tokens, failed = [], []
    for row, t, thr, seed, index in zip(rows_R.tolist(), temp_R.tolist(), thr_R.tolist(),
                                        seed_R.tolist(), index_R.tolist(), strict=True):
        x = logits_BV[row].float()
        z = x / t
        gen = torch.Generator(logits_BV.device).manual_seed(_mix(seed & _MASK64, index))
        e = torch.empty_like(z).exponential_(generator=gen).clamp_min_(
            torch.finfo(torch.float32).tiny)
        score = (z - e.log()).masked_fill_(x < thr, -torch.inf)
        tokens.append(int(score.argmax()))
        failed.append(bool(torch.isnan(z).any() or z.max() == torch.inf))
    dev = logits_BV.device
    return (torch.tensor(tokens, dtype=torch.int64, device=dev),
            torch.tensor(failed, dtype=torch.bool, device=dev))


def _mix(seed: int, index: int) -> int:
    """A generator seed for a (seed, index) key: SplitMix64's finaliser of the two words."""
    x = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
