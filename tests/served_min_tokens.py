"""``min_tokens`` (vLLM's extra) through `dp-runtime serve`, on test_serve_openai.py's server (its
tiny checkpoint and trained tokenizer), driven by the official `openai` client: a stop token the
greedy output reaches early is held off for the first min_tokens tokens, as transformers'
``min_new_tokens`` holds off its EOS ids (the same tokens); stop strings are not looked for in
those tokens' text; out-of-range values are 400 naming the field.

``TestMinTokensServed`` is imported by test_serve_openai.py, so pytest runs it there with that
module's fixtures (``ckpt``, ``client``, ``name``): one server process for all. This module's
name does not start with ``test_``: it is not collected on its own.
"""

from __future__ import annotations

import openai
import pytest

from tests.hf_reference import greedy_reference
from tests.support.serve_process import IDS

__all__ = ["TestMinTokensServed"]

PROMPT = [9, 8, 7, 6, 5]  # token ids: no tokenizer between the test and the ids


def _ids(r) -> list[int]:
    return r.choices[0].model_extra["token_ids"]


class TestMinTokensServed:
    def test_a_stop_token_waits_for_min_tokens_as_transformers_eos_does(self, ckpt, client, name):
        model, eos = ckpt[1], list(model_eos(ckpt))
        plain, _ = greedy_reference(model, PROMPT, 12)
        # the earliest new token the greedy output reaches: without min_tokens it ends the request
        i, stop = next(
            (i, t) for i, t in enumerate(plain) if i >= 1 and t not in plain[:i] and t not in eos
        )
        kw = dict(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
        early = client.completions.create(**kw, extra_body={"stop_token_ids": [stop], **IDS})
        assert _ids(early) == plain[: i + 1] and early.choices[0].finish_reason == "stop"
        k = i + 3
        r = client.completions.create(
            **kw, extra_body={"stop_token_ids": [stop], "min_tokens": k, **IDS}
        )
        got = _ids(r)
        ends = {stop, *eos}
        want, _ = greedy_reference(model, PROMPT, 12, min_new_tokens=k, eos_token_id=sorted(ends))
        end = next(
            (j for j, t in enumerate(want) if t in ends), len(want) - 1
        )  # generate pads after it
        assert got == want[: end + 1]
        assert len(got) >= k and not ends & set(got[:k])
        assert r.choices[0].finish_reason == ("stop" if got[-1] in ends else "length")

    def test_stop_strings_wait_for_min_tokens(self, client, name):
        kw = dict(
            model=name,
            prompt="The quick brown fox",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        full = client.completions.create(**kw)
        text = full.choices[0].text
        stop = next(text[j] for j in range(1, len(text)) if text[j] not in "\ufffd ")
        cut = client.completions.create(**kw, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and len(cut.choices[0].text) < len(text)
        held = client.completions.create(
            **{**kw, "extra_body": {"ignore_eos": True, "min_tokens": 16}}, stop=[stop]
        )
        assert held.choices[0].text == text and held.choices[0].finish_reason == "length"

    @pytest.mark.parametrize(
        "value,text", [(5, "min_tokens must be in [0, max_tokens=4], got 5"), (-1, "got -1")]
    )
    def test_out_of_range_is_400_naming_the_field(self, client, name, value, text):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model=name, prompt=PROMPT, max_tokens=4, extra_body={"min_tokens": value}
            )
        err = info.value.body
        assert (
            info.value.status_code == 400
            and err["param"] == "min_tokens"
            and text in err["message"]
        ), err


def model_eos(ckpt) -> tuple[int, ...]:
    """The served checkpoint's EOS ids (its tokenizer's and the extra one)."""
    return (ckpt[2].eos_token_id, ckpt[3])
