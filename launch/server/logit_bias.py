"""``logit_bias`` at the server's door: OpenAI's JSON object of token ids (as strings) to
biases, checked and turned into the engine's ``SamplingParams.logit_bias`` pairs.

OpenAI's rules, checked before any rank sees the request, each refusal a 400 naming
``logit_bias`` with the value: a key is a token id written as a decimal integer (``"50256"``)
inside the model's vocabulary, each id once; a value is a finite number in [-100, 100]; at
most 300 entries. What the engine does with it (``SamplingParams.logit_bias``): the bias is
added to the token's logit before the argmax (greedy requests too) and before temperature,
top-k and top-p, so +100 all but forces a token and -100 all but bans it. Logprobs stay the
raw ones (launch/server/logprobs.py): they describe the model, not the bias.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dp_runtime.serving.request import LOGIT_BIAS_LIMIT, LOGIT_BIAS_MAX
from launch.server.protocol import bad

__all__ = ["logit_bias_of"]

_ID = re.compile(r"-?[0-9]+")


def logit_bias_of(req: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The engine's ``logit_bias`` pairs of a request (``()`` when it has none), in the
    object's order. Raises ApiError (400) naming ``logit_bias``, the rule and the value."""
    bias = req.logit_bias
    if not bias:
        return ()
    if len(bias) > LOGIT_BIAS_LIMIT:
        raise bad("logit_bias", f"logit_bias must hold at most {LOGIT_BIAS_LIMIT} entries, got "
                                f"{len(bias)}")
    seen: dict[int, str] = {}
    out = []
    for key, value in bias.items():
        if not _ID.fullmatch(key):
            raise bad("logit_bias", f"logit_bias keys must be token ids (integers, as strings), "
                                    f"got {key!r:.40}")
        tid = int(key)
        if not 0 <= tid < vocab_size:
            raise bad("logit_bias", f"logit_bias[{key!r}]: token id {tid} is not in "
                                    f"[0, {vocab_size}) (the model's vocab_size)")
        if tid in seen:
            raise bad("logit_bias", f"logit_bias names token {tid} twice: {seen[tid]!r} and "
                                    f"{key!r}")
        seen[tid] = key
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or abs(value) > LOGIT_BIAS_MAX):
            raise bad("logit_bias", f"logit_bias[{key!r}] must be a number in "
                                    f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {value!r:.40}")
        out.append((tid, float(value)))
    return tuple(out)
