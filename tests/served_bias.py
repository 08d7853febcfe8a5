"""``logit_bias`` through `dp-runtime serve` (launch/server/logit_bias.py), on
test_serve_openai.py's server (its tiny checkpoint and trained tokenizer), driven by the
official `openai` client: +100 forces a token, greedy or sampled, on both routes; -100 on the
greedy token gives transformers' next most likely one; logprobs stay the raw ones; a request
without a bias running beside a biased one produces what it produces alone; bad values 400.

``TestLogitBiasServed`` is imported by test_serve_openai.py, so pytest runs it there with that
module's fixtures (``ckpt``, ``client``, ``name``): one server process for all. This module's
name does not start with ``test_``: it is not collected on its own.
"""

from __future__ import annotations

import openai
import pytest
import torch

from tests.hf_reference import greedy_reference
from tests.support.serve_process import IDS

__all__ = ["TestLogitBiasServed"]

PROMPT = [5, 77, 300, 12, 190, 45]  # token ids: no tokenizer between the test and the ids
VOCAB = 384  # the checkpoint's (tests/support/serve_model.py)


def _forced(ckpt) -> int:
    """A plain token (not special, not an EOS) to force."""
    tok = ckpt[2]
    return next(t for t in range(100, VOCAB) if t not in tok.all_special_ids and t != ckpt[3])


def _ids(r) -> list[int]:
    return r.choices[0].model_extra["token_ids"]



def refused_400(client, route, **kw) -> dict:
    """The error body of a request to ``route`` ("completions" on PROMPT, or "chat") that the
    server must refuse with a 400."""
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
        else:
            client.completions.create(prompt=PROMPT, **kw)
    assert info.value.status_code == 400, info.value
    return info.value.body

class TestLogitBiasServed:
    @pytest.mark.parametrize("sampled", [dict(temperature=0), dict(temperature=1.0, seed=3)],
                             ids=["greedy", "seeded"])
    def test_plus_100_forces_the_token_and_the_logprobs_stay_raw(self, ckpt, client, name, sampled):
        t = _forced(ckpt)
        kw = dict(model=name, max_tokens=4, logit_bias={str(t): 100}, **sampled)
        r = client.completions.create(prompt=PROMPT, logprobs=1,
                                      extra_body={"ignore_eos": True, **IDS}, **kw)
        assert _ids(r) == [t] * 4
        _, logits = greedy_reference(ckpt[1], PROMPT, 1)
        raw = torch.log_softmax(logits[0], dim=-1)  # the first token's distribution, unbiased
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] == pytest.approx(raw[t].item(), abs=1e-4) and raw[t] < -1
        assert max(lp.top_logprobs[0].values()) == pytest.approx(raw.max().item(), abs=1e-4)
        chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"ignore_eos": True, **IDS}, **kw)
        assert _ids(chat) == [t] * 4

    def test_minus_100_on_the_greedy_token_gives_the_next_most_likely(self, ckpt, client, name):
        first, logits = greedy_reference(ckpt[1], PROMPT, 1)
        top2 = logits[0].topk(2)
        assert top2.values[0] - top2.values[1] > 1e-3  # the order is not a rounding's
        kw = dict(model=name, prompt=PROMPT, max_tokens=1, temperature=0, extra_body=IDS)
        assert _ids(client.completions.create(**kw)) == first
        banned = client.completions.create(**kw, logit_bias={str(first[0]): -100})
        assert _ids(banned) == [top2.indices[1].item()]

    def test_a_request_without_bias_beside_a_biased_one_is_unchanged(self, ckpt, client, name):
        kw = dict(model=name, prompt=[9, 8, 7, 6], max_tokens=24, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True, **IDS})
        alone = _ids(client.completions.create(**kw))
        other = client.completions.create(**kw, stream=True)  # in the same steps as the next one
        t = _forced(ckpt)
        biased = client.completions.create(model=name, prompt=PROMPT, max_tokens=12,
                                           temperature=0.7, top_p=0.9, logit_bias={str(t): 100},
                                           extra_body={"ignore_eos": True, **IDS})
        assert _ids(biased) == [t] * 12
        assert [i for ch in other for c in ch.choices for i in c.model_extra["token_ids"]] == alone

    @pytest.mark.parametrize("bias,text", [
        ({"abc": 1}, "logit_bias keys must be token ids (integers, as strings), got 'abc'"),
        ({"1.5": 1}, "got '1.5'"),
        ({"384": 1}, "logit_bias['384']: token id 384 is not in [0, 384)"),
        ({"-1": 1}, "logit_bias['-1']: token id -1 is not in [0, 384)"),
        ({"5": 101}, "logit_bias['5'] must be a number in [-100, 100], got 101"),
        ({"5": -100.5}, "got -100.5"),
        ({"5": "x"}, "got 'x'"),
        ({"5": 1, "05": 2}, "logit_bias names token 5 twice: '5' and '05'"),
        ({str(i): 1 for i in range(301)}, "logit_bias must hold at most 300 entries, got 301"),
    ])
    @pytest.mark.parametrize("route", ["completions", "chat"])
    def test_bad_values_are_400_naming_logit_bias(self, client, name, bias, text, route):
        err = refused_400(client, route, model=name, max_tokens=2, logit_bias=bias)
        assert err["param"] == "logit_bias" and text in err["message"], err
