"""The device-side draw (dp_runtime/serving/sampling.py) on CPU tensors, with both races (torch's,
and the Triton kernel in Triton's interpreter, which tests/conftest.py sets): the distribution it
draws from (against a float64 reference of temperature, top-k, top-p and min-p), tokens never
outside the kept set, a seeded row's tokens independent of its batch (positions, neighbours,
chunks), rows flagged where the draw is undefined, and the logprobs that ride along."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dp_runtime.serving.logprobs import logprob_rows
from dp_runtime.serving.request import SamplingParams
from dp_runtime.serving.sampling import ROW_CHUNK, _top_p_threshold, draw_tokens
from dp_runtime.serving.step_tokens import worst_case_draw
from dp_runtime.serving.top_p_search import top_p_thresholds

LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -2.0])


def _reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row draws from, in float64: softmax at the temperature, renormalised
    over the top-k, then over the smallest most-likely set whose mass reaches top_p, then over
    the tokens at least min_p times as likely as the most likely (a ratio renormalising keeps)."""
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
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


RACES = {"torch": False, "triton": True}


def _draw_many(logits: torch.Tensor, p: SamplingParams, n: int, triton: bool = False, *,
               by_index: bool = False) -> torch.Tensor:
    """n draws from ``logits`` as n rows of one batch: n requests seeded 0..n-1 drawing their
    first token, or (``by_index``) one request's tokens 0..n-1."""
    params = [p if by_index else dataclasses.replace(p, seed=i) for i in range(n)]
    indices = list(range(n)) if by_index else [0] * n
    return draw_tokens(logits.expand(n, -1).contiguous(), params, indices, use_triton=triton).ids_B


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.7),  # the full-vocabulary sort
    SamplingParams(temperature=1.5, top_k=5, top_p=0.6),  # top-p among the k values
    SamplingParams(temperature=0.8, top_k=100),  # k past the vocabulary: no restriction
    # min-p keeps x >= 2 + T log(min_p) of LOGITS: here 4 tokens (6 without the T)
    SamplingParams(temperature=0.5, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=3, min_p=0.2),  # min-p keeps 4, top-k 3: top-k binds
    SamplingParams(temperature=1.5, top_k=6, min_p=0.4),  # min-p keeps 4 (3 without the T)
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.3),  # min-p keeps 4, top-p 5
    SamplingParams(temperature=1.0, top_p=0.6, min_p=0.1),  # top-p keeps 3, min-p 6
], ids=["t1", "t0.5-k3", "t1-p0.7", "t1.5-k5-p0.6", "k-past-vocab", "t0.5-m0.1", "k3-m0.2",
        "t1.5-k6-m0.4", "p0.9-m0.3", "p0.6-m0.1"])
def test_draws_follow_the_reference_distribution(params):
    # torch's race; the kernel's is checked the same way on a GPU (test_sampling_gpu.py: the
    # interpreter takes seconds per thousand rows)
    n = 6000
    want = _reference(LOGITS, params)
    got = torch.bincount(_draw_many(LOGITS, params, n, by_index=params.top_k == 3),
                         minlength=LOGITS.numel()).double() / n
    assert torch.all(got[want == 0] == 0), f"drew a dropped token: {got} against {want}"
    # Each frequency within 4.5 standard deviations of its probability (seeded: a fixed outcome).
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((got - want).abs() <= 4.5 * sigma + 1e-12), f"{got} against {want}"


@pytest.mark.parametrize("race", RACES)
def test_top_p_keeps_the_most_likely_token_even_below_its_mass(race):
    logits = torch.tensor([5.0, 0.0, 0.0, 0.0])
    n = 50 if race == "torch" else 12  # the interpreter runs the search's launches a row at a time
    ids = _draw_many(logits, SamplingParams(temperature=1.0, top_p=1e-6), n, RACES[race])
    assert ids.tolist() == [0] * n


@pytest.mark.parametrize("race", RACES)
def test_top_k_keeps_exactly_the_k_tokens_at_the_limits_of_float32(race):
    # Logits an ulp apart: the k-th token must stay whatever rounding a recomputed z takes.
    base = torch.tensor(1.0)
    logits = torch.stack([base, base.nextafter(torch.tensor(2.0)), base.nextafter(torch.tensor(0.0)),
                          torch.tensor(-3.0)])
    ids = _draw_many(logits, SamplingParams(temperature=0.3, top_k=3), 100, RACES[race])
    assert set(ids.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("race", RACES)
def test_each_token_of_a_request_and_each_seed_draw_their_own_noise(race):
    flat = torch.zeros(1, 64)
    by_index = [draw_tokens(flat, [SamplingParams(temperature=1.0, seed=5)], [i], use_triton=RACES[race]).ids_B.item()
                for i in range(12)]
    by_seed = [draw_tokens(flat, [SamplingParams(temperature=1.0, seed=s)], [3], use_triton=RACES[race]).ids_B.item()
               for s in range(12)]
    assert len(set(by_index)) >= 6 and len(set(by_seed)) >= 6, (by_index, by_seed)


@pytest.mark.parametrize("race", RACES)
def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch(race):
    vocab = 50
    torch.manual_seed(0)
    steps = [torch.randn(vocab) * 2 for _ in range(4)]
    mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=2**64 - 7)  # the seed's top bit set

    def alone():
        return [draw_tokens(s[None], [mine], [i], use_triton=RACES[race]).ids_B.item() for i, s in enumerate(steps)]

    def in_batch(position: int, size: int):
        others = [SamplingParams(), SamplingParams(temperature=1.3, seed=3), None,
                  SamplingParams(temperature=0.7, top_p=0.5, seed=2**63)]
        out = []
        for i, s in enumerate(steps):
            params = [others[j % len(others)] for j in range(size)]
            params[position] = mine
            indices = [(j * 7 + i) % 11 for j in range(size)]
            indices[position] = i
            rows = torch.randn(size, vocab)
            rows[position] = s
            out.append(draw_tokens(rows, params, indices, use_triton=RACES[race]).ids_B[position].item())
        return out

    want = alone()
    assert len(set(want)) > 1  # each token index draws its own noise
    assert in_batch(0, 3) == want
    assert in_batch(2, 5) == want
    if race == "torch":  # thresholds of a later chunk (the interpreter: slow at this size)
        assert in_batch(ROW_CHUNK + 5, ROW_CHUNK + 9) == want


def _search_against_the_sort(rows: torch.Tensor, temp: torch.Tensor, top_p: torch.Tensor) -> None:
    got = top_p_thresholds(rows, torch.arange(rows.shape[0]), temp, top_p)
    assert torch.equal(got, _top_p_threshold(rows.sort(dim=-1, descending=True).values, temp, top_p))
    for r in range(rows.shape[0]):  # and the rule, in float64: less than top_p above, at least with it
        probs = torch.softmax(rows[r].double() / temp[r].double(), dim=-1)
        above, at = probs[rows[r] > got[r]].sum(), probs[rows[r] >= got[r]].sum()
        assert above < top_p[r] <= at + 1e-6, (r, above, at)


def test_the_top_p_search_finds_the_sorts_threshold():
    # The kernels (Triton's interpreter here) against the sort they replace on CUDA, on rows with
    # ties, -inf logits, a tiny or a near-one top_p, temperatures from cold to hot; a vocabulary
    # of one program a row, and one of several (sums of slices).
    torch.manual_seed(3)
    rows = torch.randn(10, 200) * torch.tensor([0.5, 1, 3, 8, 3, 3, 3, 1, 20, 3])[:, None]
    rows[1, :40] = rows[1, 40:80]  # every value twice
    rows[2, 10:90] = -math.inf
    rows[7] = rows[7].round()  # a few values, each many times
    _search_against_the_sort(rows, torch.tensor([1.0, 0.7, 1.3, 0.2, 1.0, 2.0, 0.05, 1.0, 1.0, 0.9]),
                             torch.tensor([0.9, 0.5, 0.8, 0.95, 1e-6, 0.999, 0.9, 0.6, 0.3, 0.75]))
    wide = torch.randn(1, 8 * 512 + 7) * 3
    wide[0, ::3] = wide[0, 1::3]  # ties across the slices
    _search_against_the_sort(wide, torch.tensor([0.7]), torch.tensor([0.9]))


def test_greedy_and_non_sampling_rows_take_the_argmax():
    logits = torch.randn(6, 30)
    params = [SamplingParams(), None, SamplingParams(temperature=1.0), None, SamplingParams(), SamplingParams()]
    drawn = draw_tokens(logits, params, [0] * 6)
    argmax = logits.argmax(dim=-1)
    assert [drawn.ids_B[i].item() for i in (0, 1, 3, 4, 5)] == [argmax[i].item() for i in (0, 1, 3, 4, 5)]
    assert drawn.drawn == (2,) and drawn.failed_R.tolist() == [False]


@pytest.mark.parametrize("race", RACES)
def test_rows_whose_draw_is_undefined_are_flagged_alone(race):
    logits = torch.randn(4, 16)
    logits[1, 3] = math.nan
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1e-45), SamplingParams(temperature=0.5, top_p=0.8, seed=4)]
    drawn = draw_tokens(logits, params, [0, 1, 2, 3], use_triton=RACES[race])
    assert drawn.failed_R.tolist() == [False, True, True, False]
    alone = draw_tokens(logits[3:], params[3:], [3], use_triton=RACES[race])
    assert drawn.ids_B[3].item() == alone.ids_B.item()


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 logits rows, 1 params"):
        draw_tokens(torch.zeros(2, 4), [None], [0])


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


def _with_bias_added(logits: torch.Tensor, params) -> tuple[torch.Tensor, list]:
    """The same draw by hand: each row's bias added to a copy of the logits, params without it."""
    out = logits.clone()
    for row, p in enumerate(params):
        for tid, b in p.logit_bias if p is not None else ():
            out[row, tid] += b
    return out, [p if p is None else dataclasses.replace(p, logit_bias=()) for p in params]


@pytest.mark.parametrize("race", RACES)
def test_a_logit_bias_forces_bans_and_leaves_the_logits_and_the_other_rows_alone(race):
    torch.manual_seed(1)
    logits = torch.randn(7, 24) * 2
    raw = logits.clone()
    first, second = logits.topk(2).indices.T.tolist()
    forced = 5
    params = [
        SamplingParams(logit_bias=((forced, 100.0),)),  # greedy: OpenAI biases greedy decoding too
        SamplingParams(temperature=1.0, seed=1),
        # forced even where top-k alone would drop it: the bias comes before the filters
        SamplingParams(temperature=1.3, top_k=2, top_p=0.5, seed=2, logit_bias=((forced, 100.0), (0, -3.5))),
        None,
        SamplingParams(logit_bias=((first[4], -100.0),)),  # banned: the next most likely
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, logit_bias=((first[6], -100.0), (second[6], 2.0))),
    ]
    indices = [0, 4, 1, 0, 0, 0, 9]
    drawn = draw_tokens(logits, params, indices, use_triton=RACES[race])
    ids = drawn.ids_B.tolist()
    assert torch.equal(logits, raw)  # the logprobs read these: they stay raw
    assert forced not in (first[0], first[2], second[2])
    assert ids[0] == ids[2] == forced and ids[4] == second[4] and ids[6] != first[6]
    assert ids[3] == first[3] and ids[5] == first[5]
    # The unbiased rows draw what they draw alone; the biased ones what their biased logits give.
    alone = draw_tokens(logits[1:2], params[1:2], indices[1:2], use_triton=RACES[race])
    assert ids[1] == alone.ids_B.item()
    by_hand, unbiased = _with_bias_added(logits, params)
    assert ids == draw_tokens(by_hand, unbiased, indices, use_triton=RACES[race]).ids_B.tolist()
    assert drawn.drawn == (1, 2, 6) and drawn.failed_R.tolist() == [False] * 3  # biased rows last


def test_biased_rows_past_a_chunk_match_the_bias_added_by_hand():
    rows, vocab = ROW_CHUNK + 6, 40
    torch.manual_seed(2)
    logits = torch.randn(rows, vocab)
    params = [None if r % 7 == 3 else SamplingParams(
        temperature=0.0 if r % 2 else 0.9, top_k=r % 5, seed=r,
        logit_bias=tuple((t, float(t % 9) - 4.0) for t in range(r % 4, vocab, 5)) if r % 3 else ())
        for r in range(rows)]
    drawn = draw_tokens(logits, params, list(range(rows)))
    by_hand, unbiased = _with_bias_added(logits, params)
    assert drawn.ids_B.tolist() == draw_tokens(by_hand, unbiased, list(range(rows))).ids_B.tolist()
    assert sorted(drawn.drawn) == [r for r, p in enumerate(params) if p is not None and not p.greedy]


def test_a_biased_draw_follows_the_reference_of_the_biased_logits():
    # +1.5 takes token 5 (logit 0.0) into the top 3 at temperature 0.7: bias, then the filters.
    params = SamplingParams(temperature=0.7, top_k=3, logit_bias=((5, 1.5), (0, -0.5)))
    biased = LOGITS.clone()
    biased[5] += 1.5
    biased[0] -= 0.5
    n = 4000
    want = _reference(biased, params)
    got = torch.bincount(_draw_many(LOGITS, params, n), minlength=LOGITS.numel()).double() / n
    assert want[5] > 0 and torch.all(got[want == 0] == 0), f"{got} against {want}"
    assert torch.all((got - want).abs() <= 4.5 * (want * (1 - want) / n).sqrt() + 1e-12), f"{got} against {want}"


def test_a_bias_outside_the_vocabulary_is_refused_before_any_launch():
    with pytest.raises(ValueError, match="row 1's logit_bias names token 8, outside the vocabulary of 8"):
        draw_tokens(torch.zeros(2, 8), [None, SamplingParams(logit_bias=((8, 1.0),))], [0, 0])


@pytest.mark.parametrize("race", RACES)
def test_min_p_1_keeps_only_the_most_likely_tokens_and_0_changes_nothing(race):
    tied = torch.tensor([3.0, -1.0, 3.0, 2.9, 0.0])
    ids = _draw_many(tied, SamplingParams(temperature=2.0, min_p=1.0), 16, RACES[race])
    assert set(ids.tolist()) == {0, 2}  # the tie at the max: both stay, 2.9 does not
    off = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)
    assert torch.equal(_draw_many(LOGITS, dataclasses.replace(off, min_p=0.0), 16, RACES[race]),
                       _draw_many(LOGITS, off, 16, RACES[race]))


@pytest.mark.parametrize("race", RACES)
def test_min_p_never_touches_greedy_rows_and_a_row_alone_draws_what_it_draws_in_a_batch(race):
    torch.manual_seed(3)
    logits = torch.randn(5, 40) * 2
    params = [SamplingParams(min_p=0.9), SamplingParams(temperature=0.9, min_p=0.2, seed=1), None,
              SamplingParams(temperature=1.2, seed=2), SamplingParams(temperature=0.7, top_k=9, min_p=0.5, seed=3)]
    drawn = draw_tokens(logits, params, [0, 1, 0, 2, 3], use_triton=RACES[race])
    argmax = logits.argmax(dim=-1)
    assert drawn.ids_B[0] == argmax[0] and drawn.ids_B[2] == argmax[2] and drawn.drawn == (1, 3, 4)
    for row, index in ((1, 1), (3, 2), (4, 3)):
        alone = draw_tokens(logits[row : row + 1], [params[row]], [index], use_triton=RACES[race])
        assert drawn.ids_B[row] == alone.ids_B[0]
    for row in (1, 4):  # the token it drew is within min_p of its row's most likely
        p = torch.softmax(logits[row] / params[row].temperature, dim=-1)
        assert p[drawn.ids_B[row]] >= params[row].min_p * p.max()


def test_min_p_is_relative_to_the_biased_logits():
    # +5 lifts token 7 (-2.0) to 3.0, above token 0 (2.0): min_p 0.5 at temperature 1 keeps
    # x >= 3 - log 2 = 2.31 of the biased row, so token 7 alone (the raw row would keep 0 and 1).
    params = SamplingParams(temperature=1.0, min_p=0.5, logit_bias=((7, 5.0),))
    assert set(_draw_many(LOGITS, params, 40).tolist()) == {7}
    rows, vocab = ROW_CHUNK + 6, 40
    torch.manual_seed(4)
    logits = torch.randn(rows, vocab) * 2
    mixed = [SamplingParams(temperature=0.9, min_p=0.1 * (r % 5), top_k=r % 4, seed=r,
                            logit_bias=((r % vocab, 3.0),) if r % 2 else ()) for r in range(rows)]
    by_hand, unbiased = _with_bias_added(logits, mixed)
    assert draw_tokens(logits, mixed, list(range(rows))).ids_B.tolist() == \
        draw_tokens(by_hand, unbiased, list(range(rows))).ids_B.tolist()
