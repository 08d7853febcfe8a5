"""``SamplingParams.min_tokens`` in the engine (the server's route: tests/served_min_tokens.py):
the scheduler bans a request's stop ids and EOS ids (not with ``ignore_eos``) for the draws of its
first min_tokens tokens, overlapped steps included; the draw never takes a banned id, greedy or
sampled, and leaves the logits (the logprobs' source) raw; a stop id drawn anyway (the host's
check) ends nothing before min_tokens; out-of-range values are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.serving.sampling import draw_tokens
from tests.support.small_scheduler import small_scheduler


def test_the_first_min_tokens_draws_ban_the_stop_and_eos_ids():
    s = small_scheduler(eos_token_ids=(2, 1))
    s.submit(
        [
            Request(
                "a", [3, 4, 5], SamplingParams(max_new_tokens=6, min_tokens=2, stop_token_ids=(9,))
            ),
            Request(
                "b",
                [6, 7],
                SamplingParams(
                    max_new_tokens=6, min_tokens=3, stop_token_ids=(9,), ignore_eos=True
                ),
            ),
            Request("c", [8], SamplingParams(max_new_tokens=6, stop_token_ids=(9,))),
        ]
    )
    steps = [s.next_step() for _ in range(4)]  # overlapped: scheduled before any token is recorded
    assert [st.draws for st in steps] == [(0, 0, 0), (1, 1, 1), (2, 2, 2), (3, 3, 3)]
    assert [st.bans for st in steps] == [
        ((9, 1, 2), (9,), ()),
        ((9, 1, 2), (9,), ()),
        ((), (9,), ()),
        (),
    ]


def test_a_stop_id_ends_a_request_only_after_min_tokens():
    s = small_scheduler(eos_token_ids=(2, 1))
    s.submit(
        [Request("a", [3, 4], SamplingParams(max_new_tokens=8, min_tokens=2, stop_token_ids=(9,)))]
    )
    first, second, third = s.next_step(), s.next_step(), s.next_step()
    assert s.advance(first, [9]) == [] and s.advance(second, [2]) == []  # tokens 0 and 1: no stop
    (done,) = s.advance(third, [9])
    assert done.output_ids == (9, 2, 9) and done.finish_reason == "stop"


def test_a_banned_id_is_never_drawn_and_the_logits_stay_raw():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    logits[:, 7] = 30.0  # every row's argmax, and all but certain when sampled
    raw = logits.clone()
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0, seed=4)
    for p in (greedy, sampled):
        drawn = draw_tokens(logits, [p, p, p], [0, 0, 0], bans=[(7, 3), (), (7,)], use_triton=False)
        ids = drawn.ids_B.tolist()
        assert ids[0] not in (7, 3) and ids[1] == 7 and ids[2] != 7
    assert torch.equal(logits, raw)
    best = raw[0].clone()
    best[[7, 3]] = -torch.inf
    greedy_ids = draw_tokens(
        logits, [greedy] * 3, [0, 0, 0], bans=[(7, 3), (), (7,)], use_triton=False
    ).ids_B
    assert greedy_ids[0].item() == best.argmax().item()


@pytest.mark.parametrize(
    "value,text",
    [
        (9, "SamplingParams.min_tokens must be an int in [0, max_new_tokens=8], got 9"),
        (-1, "got -1"),
        (1.5, "got 1.5"),
    ],
)
def test_min_tokens_out_of_range_is_refused_naming_it(value, text):
    with pytest.raises(ValueError, match=r"min_tokens") as info:
        SamplingParams(max_new_tokens=8, min_tokens=value)
    assert text in str(info.value)


@pytest.mark.gpu
def test_the_triton_draws_never_take_a_banned_id():
    # the race, the top-p search (a row holding -inf) and top-k on the device
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(6, 4096, generator=g, device="cuda")
    logits[:, 11] = 40.0
    rows = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2),
        SamplingParams(temperature=1.0, top_k=5, seed=3),
        SamplingParams(temperature=1.0, min_p=0.1, seed=4),
        SamplingParams(temperature=1.0, top_p=0.5, seed=5),
    ]
    raw = logits.clone()
    for step in range(20):
        drawn = draw_tokens(logits, rows, [step] * 6, bans=[(11,)] * 5 + [()], use_triton=True)
        ids = drawn.ids_B.tolist()
        assert 11 not in ids[:5] and ids[5] == 11
        assert drawn.failed_R is None or not drawn.failed_R.any()
    assert torch.equal(logits, raw)
