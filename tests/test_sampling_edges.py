"""Every value ``check_sampling`` takes draws (dp_runtime/serving/sampling.py, adjusted_rows.py),
on CPU tensors with both races (torch's, and the Triton kernels in Triton's interpreter): at the
ends of each range no row is flagged, and the token is the rule's limit there.

Before, a ``repetition_penalty`` below ~1e-38 was 0 in float32 (``x / r`` inf: the draw failed,
a 500 at the door), one above ~3.4e38 inf (``0 * r`` NaN: the greedy argmax took the NaN token),
and a temperature above 3.4e38 inf (min-p 1's threshold NaN; the Triton race flagged the row).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dp_runtime.serving.penalty_counts import PenaltyCounts
from dp_runtime.serving.request import SamplingParams, check_sampling
from dp_runtime.serving.sampling import draw_tokens

RACES = {"torch": False, "triton": True}
SEEDS = 8
V = 32
# Marked (in the prompt): two positive logits, an exact zero and two negative ones; every
# unmarked logit is negative, so the argmax of the rule's limit is a marked positive one.
LOGITS = -1.0 - torch.arange(V, dtype=torch.float32) / V
LOGITS[[3, 7, 11, 12, 20]] = torch.tensor([0.5, 0.75, 0.0, -0.25, -3.0])
MARKED = (3, 7, 11, 12, 20)
TOP = 7  # the largest marked positive logit


def _draw(p: SamplingParams, race: str, repeats: int = 0) -> tuple[list[int], list[bool]]:
    """Tokens and failure flags of ``SEEDS`` rows of LOGITS drawn with ``p`` (seeds 0..), their
    requests' prompts MARKED, their outputs TOP ``repeats`` times."""
    assert check_sampling(p) is None
    rows = torch.arange(SEEDS)
    pc = PenaltyCounts(SEEDS, V, "cpu")
    pc.mark_prompts((r, MARKED) for r in range(SEEDS))
    pc.table_RV[:, TOP] = repeats
    counts = pc.step(rows, counts=p.penalized, seen=p.repeats_penalized)
    params = [dataclasses.replace(p, seed=s) for s in range(SEEDS)]
    drawn = draw_tokens(LOGITS.expand(SEEDS, -1).contiguous(), params, [0] * SEEDS, counts=counts,
                        use_triton=RACES[race])
    failed = drawn.failed_R.tolist() if drawn.failed_R is not None else [False] * SEEDS
    return drawn.ids_B.tolist(), failed


@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("r", [1e-300, 1e-45, 1e-38, 1e39, 1e300])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_repetition_penalty_of_any_size_draws_its_limit(race, r, temperature):
    tokens, failed = _draw(SamplingParams(temperature=temperature, repetition_penalty=r), race)
    assert not any(failed)
    if r < 1 or temperature == 0:
        # r -> 0: greedy among the marked positive logits. r -> inf: they all tend to 0+ in
        # their order, the marked zero stays 0 (not NaN), the rest are negative.
        assert tokens == [TOP] * SEEDS
    else:  # the marked negative logits are never drawn
        assert not {12, 20} & set(tokens)


@pytest.mark.parametrize("race", RACES)
def test_a_temperature_past_float32_draws_every_token_alike_and_min_p_1_keeps_the_top(race):
    for extra in ({}, {"top_p": 0.5}):
        tokens, failed = _draw(SamplingParams(temperature=1e300, **extra), race)
        assert not any(failed) and len(set(tokens)) > 1
    tokens, failed = _draw(SamplingParams(temperature=1e300, min_p=1.0), race)
    assert not any(failed) and tokens == [TOP] * SEEDS


@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("top_p", [1e-300, 1e-45])
def test_a_tiny_top_p_keeps_the_most_likely_token_alone(race, top_p):
    tokens, failed = _draw(SamplingParams(temperature=1.0, top_p=top_p), race)
    assert not any(failed) and tokens == [TOP] * SEEDS


@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("params,expected", [
    (dict(min_p=1.0), TOP),
    (dict(temperature=1e-5), TOP),  # the door's smallest sampled temperature
    (dict(temperature=1e-5, repetition_penalty=1e-300, logit_bias=((0, 100.0),)), TOP),
    (dict(logit_bias=((0, 100.0), (TOP, -100.0))), 0),
    # TOP generated 1,000 times: ~2,000 below the next one (3), or ~2,000 above it
    (dict(temperature=1e-5, presence_penalty=2.0, frequency_penalty=2.0), 3),
    (dict(temperature=1e-5, presence_penalty=-2.0, frequency_penalty=-2.0), TOP),
], ids=["min_p-1", "t-1e-5", "t-1e-5-r-1e-300-bias-100", "bias-100", "penalties-2", "penalties--2"])
def test_the_ends_of_the_other_ranges_draw(race, params, expected):
    for temperature in (0.0, 1.0):
        p = SamplingParams(**{"temperature": temperature, **params})
        tokens, failed = _draw(p, race, repeats=1000)
        assert not any(failed) and tokens == [expected] * SEEDS, (temperature, tokens)
