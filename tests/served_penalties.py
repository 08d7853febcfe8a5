"""``presence_penalty`` and ``frequency_penalty`` through `dp-runtime serve`, on
test_serve_openai.py's server (its tiny checkpoint), driven by the official `openai` client: a
penalized greedy completion equals the rule applied to transformers' logits step by step, with
the raw logprobs; chat takes them too; a request without penalties beside a penalized one
produces what it produces alone; values outside [-2, 2] are 400 naming the field. And vLLM's
extra ``repetition_penalty``: a greedy completion equals transformers' processor (prompt and
output tokens) on its logits step by step; chat takes it; 0 is a 400 naming it.

``TestPenaltiesServed`` is imported by test_serve_openai.py and runs there, on its one server
(``ckpt``, ``client``, ``name``); this module is not collected on its own.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.served_bias import PROMPT, refused_400
from tests.support.serve_process import IDS

__all__ = ["TestPenaltiesServed"]


def _ids(r) -> list[int]:
    return r.choices[0].model_extra["token_ids"]


def _penalized_greedy(model, prompt: list[int], n: int, freq: float = 0.0, pres: float = 0.0, rep: float = 1.0):
    """Transformers' logits one step at a time, the penalties applied to each (transformers'
    repetition processor over the prompt and the output, then OpenAI's rule: minus freq * c +
    pres for each generated token seen c times): the tokens and raw rows."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids, rows = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            row = model(torch.tensor([ids])).logits[0, -1].float()
            x = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([ids]), row[None].clone())[0]
            for tid, c in Counter(ids[len(prompt) :]).items():
                x[tid] -= freq * c + pres
            rows.append(row)
            ids.append(int(x.argmax()))
    return ids[len(prompt) :], rows


class TestPenaltiesServed:
    def test_a_penalized_greedy_completion_follows_the_rule_with_raw_logprobs(self, ckpt, client, name):
        want, rows = _penalized_greedy(ckpt[1], PROMPT, 10, freq=1.5, pres=1.0)
        plain = _ids(client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0,
                                               extra_body={**IDS, "ignore_eos": True}))
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1,
                                      frequency_penalty=1.5, presence_penalty=1.0, extra_body={**IDS, "ignore_eos": True})
        assert _ids(r) == want and want != plain
        lp = r.choices[0].logprobs
        for tok, got, row in zip(want, lp.token_logprobs, rows, strict=True):
            assert got == pytest.approx(torch.log_softmax(row, dim=-1)[tok].item(), abs=1e-4)
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, frequency_penalty=2,
                                              presence_penalty=-2, extra_body={**IDS, "ignore_eos": True})
        assert len(_ids(chat)) == 6

    def test_a_request_without_penalties_beside_a_penalized_one_is_unchanged(self, client, name):
        kw = dict(model=name, prompt=[9, 8, 7, 6], max_tokens=20, temperature=1.0, seed=5,
                  extra_body={**IDS, "ignore_eos": True})
        alone = _ids(client.completions.create(**kw))
        other = client.completions.create(**kw, stream=True)  # in the same steps as the next one
        client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0.7,
                                  frequency_penalty=2, presence_penalty=2, extra_body={**IDS, "ignore_eos": True})
        assert [i for ch in other for c in ch.choices for i in c.model_extra["token_ids"]] == alone

    def test_a_repetition_penalized_greedy_completion_is_transformers_processor(self, ckpt, client, name):
        want, _ = _penalized_greedy(ckpt[1], PROMPT, 10, rep=1.8)
        plain, _ = _penalized_greedy(ckpt[1], PROMPT, 10)
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={**IDS, "ignore_eos": True, "repetition_penalty": 1.8})
        assert _ids(r) == want and want != plain
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0,
                                              extra_body={**IDS, "ignore_eos": True, "repetition_penalty": 0.9})
        assert len(_ids(chat)) == 4
        err = refused_400(client, "completions", model=name, max_tokens=2, extra_body={"repetition_penalty": 0})
        assert err["param"] == "repetition_penalty", err
        assert "repetition_penalty must be a finite number > 0 (1: off), got 0" in err["message"], err

    @pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.01)])
    @pytest.mark.parametrize("route", ["completions", "chat"])
    def test_values_outside_the_range_are_400_naming_the_field(self, client, name, field, value, route):
        err = refused_400(client, route, model=name, max_tokens=2, **{field: value})
        assert err["param"] == field, err
        assert f"{field} must be a finite number in [-2, 2], got {value}" in err["message"], err
