"""The prompts of a completion request: one, or a batch, each a text or a list of token ids.

``prompt`` takes OpenAI's four forms: a text, a list of token ids, a list of texts, a list of
token-id lists. A list of one text or one token-id list is that prompt alone. A batch of k
prompts with ``n`` choices each is k x n choices (launch/server/choices.py), at most
``MAX_CHOICES`` per request. Checked before any rank sees the request, each refusal a 400 naming
``prompt`` (or ``n``, when n > 1 takes the batch past the limit): an empty list, an empty prompt
in it, a list mixing texts, token ids and lists, a token id that is not an int. Each prompt is
then checked against the vocabulary and the context on its own (app.py), its errors naming it:
``prompt[2]`` in a batch, ``prompt`` alone.
"""

from __future__ import annotations

from typing import Any

from dp_runtime.checks import is_int
from launch.server.protocol import MAX_N, CompletionRequest, bad

__all__ = ["MAX_CHOICES", "prompt_params", "prompts_of"]

# Choices per request (prompts x n), each one engine request: n's 16 for 16 prompts, or 256
# single-choice prompts (a batching client's batch). One past the engine's capacity is a 400
# (choices.submit_choices); one past its free room now, a 429 whole.
MAX_CHOICES = 256

_FORMS = "a text, a list of token ids, a list of texts or a list of token-id lists"


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of ``req`` in order (one for a single prompt), each a non-empty text or
    non-empty list of int token ids. Raises ApiError (400) naming ``prompt`` or ``n``."""
    p = req.prompt
    if isinstance(p, str) or (p and is_int(p[0])):  # one prompt
        batch, prompts = False, [p]
    elif not p:
        raise bad("prompt", f"prompt must hold at least one prompt ({_FORMS}), got []")
    else:
        batch, prompts, first = True, list(p), _kind(p[0])
        for i, item in enumerate(p):
            kind = _kind(item)
            if kind not in ("a text", "a list"):
                raise bad("prompt", f"prompt must be {_FORMS}; prompt[{i}] is {kind} "
                                    f"({item!r:.40})")
            if kind != first:
                raise bad("prompt", f"prompt must be {_FORMS}, not a mix: prompt[0] is {first}, "
                                    f"prompt[{i}] is {kind}")
    for i, item in enumerate(prompts):
        where = f"prompt[{i}]" if batch else "prompt"
        if not item:
            raise bad("prompt", f"{where} must not be empty")
        if not isinstance(item, str):
            j = next((j for j, t in enumerate(item) if not is_int(t)), None)
            if j is not None:
                raise bad("prompt", f"{where}[{j}] must be a token id (an int), got "
                                    f"{item[j]!r:.40}")
    n = req.n
    if n is not None and 1 <= n <= MAX_N and len(prompts) * n > MAX_CHOICES:  # else sampling_of
        raise bad(
            "n" if n > 1 else "prompt",
            f"a request's choices (prompts x n) must be <= {MAX_CHOICES}, got {len(prompts)} "
            f"prompts x n {n} = {len(prompts) * n}",
        )
    return [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]


def prompt_params(count: int) -> list[str]:
    """How errors name each of ``count`` prompts: ``prompt`` alone, ``prompt[i]`` in a batch."""
    return ["prompt"] if count == 1 else [f"prompt[{i}]" for i in range(count)]


def _kind(item: Any) -> str:
    if isinstance(item, str):
        return "a text"
    if isinstance(item, list):
        return "a list"
    if item is None:
        return "null"
    return "a token id" if is_int(item) else f"a {type(item).__name__}"
