"""The ends of the sampling fields' documented ranges through `dp-runtime serve`, on
test_serve_openai.py's server, driven by the official `openai` client: every one is served (no
5xx), as the rule's limit.

A ``repetition_penalty`` (vLLM's extra: any number > 0) of 1e-300 or 1e-45, which float32 rounds
to 0, gives what 1e-30 gives (exact arithmetic there on this model's logits: the limit is
reached), and 1e300, past float32, what 1e30 gives; before, 1e-300 made the draw's logits inf
and the request a 500. A temperature past float32 with ``min_p`` 1, or a ``top_p`` that rounds
to 0, keeps the most likely token alone: the greedy tokens. The penalties at +-2 and
``logit_bias`` at +-100 are served beside them (tests/test_sampling_edges.py checks each limit
on the draw itself).

``TestRangeEndsServed`` is imported by test_serve_openai.py and runs there, on its one server
(``client``, ``name``); this module is not collected on its own.
"""

from __future__ import annotations

from tests.support.serve_process import IDS

__all__ = ["TestRangeEndsServed"]

PROMPT = [7, 31, 2, 99, 14]
TOKENS = 6


def _served(client, name, **kw) -> list[int]:
    """A completion of PROMPT (TOKENS tokens, no EOS stop) with ``kw``; its token ids, after
    checking that it was served to its length."""
    extra = {"ignore_eos": True, **IDS, **kw.pop("extra_body", {})}
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, extra_body=extra, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length", (kw, extra, choice)
    return choice.model_extra["token_ids"]


class TestRangeEndsServed:
    def test_a_repetition_penalty_of_any_size_is_served_as_its_limit(self, client, name):
        for far, near in ((1e-300, 1e-30), (1e-45, 1e-30), (1e300, 1e30)):
            for kw in ({"temperature": 0}, {"temperature": 1, "seed": 11}):
                got = _served(client, name, extra_body={"repetition_penalty": far}, **kw)
                assert got == _served(client, name, extra_body={"repetition_penalty": near}, **kw), (far, kw)
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=1, seed=5,
                                              extra_body={"repetition_penalty": 1e-300, "ignore_eos": True})
        assert chat.choices[0].finish_reason == "length"

    def test_the_ends_of_the_other_ranges_are_served(self, client, name):
        greedy = _served(client, name, temperature=0)
        assert _served(client, name, temperature=1e300, seed=3, extra_body={"min_p": 1}) == greedy
        assert _served(client, name, temperature=1, top_p=1e-300, seed=3) == greedy
        assert _served(client, name, temperature=1, seed=3, extra_body={"min_p": 1}) == greedy
        _served(client, name, temperature=1e300, seed=3)
        for t in (0, 1):
            _served(client, name, temperature=t, seed=3, presence_penalty=2, frequency_penalty=2)
            _served(client, name, temperature=t, seed=3, presence_penalty=-2, frequency_penalty=-2)
            _served(client, name, temperature=t, seed=3, logit_bias={"5": 100, "9": -100})
        assert _served(client, name, temperature=1e-5, seed=3) == greedy  # the door's greedy rule
