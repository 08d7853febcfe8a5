"""``min_p`` and the sampling defaults through `dp-runtime serve`, on test_serve_openai.py's
server, driven by the official `openai` client. That server runs ``--sampling-defaults none``
over a checkpoint whose generation_config.json says ``top_k: 1``: a seeded request at
temperature 1 that leaves top_k unset samples away from the greedy tokens (the file is ignored),
the same request with ``top_k: 1`` set gives them. ``min_p: 1`` keeps only the most likely token,
so a sampled request gives transformers' greedy tokens, on both routes; a ``min_p`` outside
[0, 1] is a 400 naming it, on both routes. The ``model`` default is in test_serve_gang.py.

``TestSamplingServed`` is imported by test_serve_openai.py and runs there, on its one server
(``ckpt``, ``client``, ``name``); this module is not collected on its own.
"""

from __future__ import annotations

import pytest

from tests.hf_reference import greedy_reference
from tests.served_bias import PROMPT, refused_400
from tests.support.serve_process import IDS

__all__ = ["TestSamplingServed"]

CHAT = [{"role": "user", "content": "hi there"}]


def _ids(r) -> list[int]:
    return r.choices[0].model_extra["token_ids"]


class TestSamplingServed:
    def test_none_ignores_the_checkpoint_s_top_k_and_a_set_top_k_or_min_p_1_is_greedy(self, ckpt, client, name):
        greedy = greedy_reference(ckpt[1], PROMPT, 10)[0]
        kw = dict(model=name, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1)
        ask = dict(kw, extra_body=IDS)
        assert _ids(client.completions.create(**ask)) != greedy  # top_k unset: off, not the file's 1
        assert _ids(client.completions.create(**kw, extra_body={"top_k": 1, **IDS})) == greedy
        assert _ids(client.completions.create(**kw, extra_body={"min_p": 1.0, **IDS})) == greedy
        assert _ids(client.completions.create(**kw, extra_body={"min_p": 0.0, **IDS})) == \
            _ids(client.completions.create(**ask))  # 0: off

    def test_chat_takes_min_p(self, client, name):
        kw = dict(model=name, messages=CHAT, max_tokens=8, extra_body={"ignore_eos": True, **IDS})
        greedy = _ids(client.chat.completions.create(temperature=0, **kw))
        sampled = client.chat.completions.create(temperature=1.0, seed=2, **kw)
        assert _ids(sampled) != greedy
        kw["extra_body"] = {"ignore_eos": True, "min_p": 1.0, **IDS}
        assert _ids(client.chat.completions.create(temperature=1.0, seed=2, **kw)) == greedy

    @pytest.mark.parametrize("value", [1.5, -0.1])
    @pytest.mark.parametrize("route", ["completions", "chat"])
    def test_min_p_outside_0_1_is_400_naming_it(self, client, name, value, route):
        err = refused_400(client, route, model=name, max_tokens=2, extra_body={"min_p": value})
        assert err["param"] == "min_p", err
        assert f"min_p must be a finite number in [0, 1] (0: off), got {value}" in err["message"], err
