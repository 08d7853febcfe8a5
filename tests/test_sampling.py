"""The device-side draw (dp_runtime/serving/sampling.py) on CPU tensors: the distribution it
draws from (against a float64 reference of temperature, top-k and top-p), tokens never outside
the kept set, a seeded row's tokens independent of its batch (positions, neighbours, chunks),
rows flagged where the draw is undefined, and the logprobs that ride along."""

from __future__ import annotations

import math

import pytest
import torch

from dp_runtime.serving.logprobs import logprob_rows
from dp_runtime.serving.request import SamplingParams
from dp_runtime.serving.sampling import ROW_CHUNK, draw_tokens
from dp_runtime.serving.step_tokens import worst_case_draw

LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -2.0])


def _reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row draws from, in float64: softmax at the temperature, renormalised
    over the top-k, then over the smallest most-likely set whose mass reaches top_p."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    if 0 < p.top_k < probs.numel():
        kept = torch.zeros_like(probs)
        idx = probs.topk(p.top_k).indices
        kept[idx] = probs[idx]
        probs = kept / kept.sum()
    if p.top_p < 1:
        sp, order = probs.sort(descending=True)
        sp = torch.where(sp.cumsum(0) - sp < p.top_p, sp, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sp)
        probs /= probs.sum()
    return probs


def _draw_many(logits: torch.Tensor, p: SamplingParams, n: int, first_seed: int = 0) -> torch.Tensor:
    """n draws from ``logits``, each by its own seeded generator (n rows of one batch)."""
    gens = [torch.Generator().manual_seed(first_seed + i) for i in range(n)]
    return draw_tokens(logits.expand(n, -1).contiguous(), [p] * n, gens).ids_B


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.7),  # the full-vocabulary sort
    SamplingParams(temperature=1.5, top_k=5, top_p=0.6),  # top-p among the k values
    SamplingParams(temperature=0.8, top_k=100),  # k past the vocabulary: no restriction
], ids=["t1", "t0.5-k3", "t1-p0.7", "t1.5-k5-p0.6", "k-past-vocab"])
def test_draws_follow_the_reference_distribution(params):
    n = 6000
    want = _reference(LOGITS, params)
    got = torch.bincount(_draw_many(LOGITS, params, n), minlength=LOGITS.numel()).double() / n
    assert torch.all(got[want == 0] == 0), f"drew a dropped token: {got} against {want}"
    # Each frequency within 4.5 standard deviations of its probability (seeded: a fixed outcome).
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((got - want).abs() <= 4.5 * sigma + 1e-12), f"{got} against {want}"


def test_top_p_keeps_the_most_likely_token_even_below_its_mass():
    logits = torch.tensor([5.0, 0.0, 0.0, 0.0])
    ids = _draw_many(logits, SamplingParams(temperature=1.0, top_p=1e-6), 50)
    assert ids.tolist() == [0] * 50


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch():
    gen_v = 50
    torch.manual_seed(0)
    steps = [torch.randn(gen_v) * 2 for _ in range(4)]
    mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7)

    def alone():
        g = torch.Generator().manual_seed(mine.seed)
        return [draw_tokens(s[None], [mine], [g]).ids_B.item() for s in steps]

    def in_batch(position: int, size: int):
        others = [SamplingParams(), SamplingParams(temperature=1.3), SamplingParams(temperature=0.7, top_p=0.5), None]
        g = torch.Generator().manual_seed(mine.seed)
        out = []
        for s in steps:
            params = [others[j % len(others)] for j in range(size)]
            params[position] = mine
            gens = [torch.Generator().manual_seed(100 + j) for j in range(size)]
            gens[position] = g
            rows = torch.randn(size, gen_v)
            rows[position] = s
            out.append(draw_tokens(rows, params, gens).ids_B[position].item())
        return out

    want = alone()
    assert in_batch(0, 3) == want
    assert in_batch(2, 5) == want
    assert in_batch(ROW_CHUNK + 5, ROW_CHUNK + 9) == want  # in the second chunk of draws


def test_greedy_and_non_sampling_rows_take_the_argmax():
    logits = torch.randn(6, 30)
    params = [SamplingParams(), None, SamplingParams(temperature=1.0), None, SamplingParams(), SamplingParams()]
    gens = [None, None, torch.Generator().manual_seed(1), None, None, None]
    drawn = draw_tokens(logits, params, gens)
    argmax = logits.argmax(dim=-1)
    assert [drawn.ids_B[i].item() for i in (0, 1, 3, 4, 5)] == [argmax[i].item() for i in (0, 1, 3, 4, 5)]
    assert drawn.drawn == (2,) and drawn.failed_R.tolist() == [False]


def test_rows_whose_draw_is_undefined_are_flagged_alone():
    logits = torch.randn(4, 16)
    logits[1, 3] = math.nan
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1e-45), SamplingParams(temperature=0.5, top_p=0.8)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    drawn = draw_tokens(logits, params, gens)
    assert drawn.failed_R.tolist() == [False, True, True, False]
    ok = torch.Generator().manual_seed(3)
    assert drawn.ids_B[3].item() == draw_tokens(logits[3:], params[3:], [ok]).ids_B.item()


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 logits rows, 1 params"):
        draw_tokens(torch.zeros(2, 4), [None], [None])


def test_logprob_rows_are_the_raw_log_softmax():
    logits = torch.randn(2 * ROW_CHUNK + 3, 40) * 3
    ids = torch.randint(0, 40, (logits.shape[0],))
    rows = [0, 5, ROW_CHUNK + 1, 2 * ROW_CHUNK + 2]
    tops = [0, 3, 20, 1]
    got = logprob_rows(logits, ids, rows, tops).per_row()
    lp = torch.log_softmax(logits, dim=-1)
    for row, n in zip(rows, tops, strict=True):
        chosen, top = got[row]
        assert chosen == pytest.approx(lp[row, ids[row]].item(), abs=1e-6)
        vals, idx = lp[row].topk(n) if n else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
        assert [t for t, _ in top] == idx.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-6)


def test_worst_case_draw_gives_a_token_per_row():
    logits = torch.randn(ROW_CHUNK + 2, 32)
    ids = worst_case_draw(logits)
    assert ids.shape == (ROW_CHUNK + 2,) and bool(((ids >= 0) & (ids < 32)).all())
