"""Logprobs at the server's door: the request fields, and the OpenAI shapes of a choice's logprobs.

What the numbers are: the engine's (``SamplingParams.logprobs``), the float32 log-softmax of the
model's logits for each step before ``logit_bias``, temperature, top-k and top-p (vLLM's
default "raw" logprobs): the sampled token's, plus the N most likely tokens' of the same
distribution.

Fields (checked before any rank sees the request; 400 naming the field):

- /v1/completions: ``logprobs`` an int in [0, LOGPROBS_LIMIT]; each choice gets OpenAI's legacy
  ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, whose ``top_logprobs`` dicts
  hold the N most likely tokens plus the sampled one (up to N + 1 entries, as OpenAI's);
- /v1/chat/completions: ``logprobs: true`` and ``top_logprobs`` in [0, LOGPROBS_LIMIT] (only
  with ``logprobs: true``); each choice gets ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``.

Entries follow the choice's ``token_ids`` one to one: a final EOS or stop token id that is not
text still has its entry, as in vLLM. A streamed chunk carries the entries of the tokens it
carries ids of (the step's tokens; its text may be held back a step by stop strings or a split
UTF-8 character, the ids and entries are not).

Token strings, as vLLM: ``tokenizer.decode([id])`` (special tokens as their text, no cleanup
of spaces), so a token holding part of a UTF-8 character reads as U+FFFD. ``bytes`` are the
token's own bytes where the tokenizer tells them: byte-level BPE (GPT-2's byte-to-unicode map
on ``convert_ids_to_tokens``) and byte-fallback tokens (``<0xE6>``), so joining a choice's
bytes gives its UTF-8 text even across split characters (OpenAI's purpose for the field);
otherwise, and for special tokens, the UTF-8 of the token string. Without a tokenizer (a
preset) a token reads ``token_id:<id>`` and ``bytes`` is null; vLLM's
``return_tokens_as_token_ids`` asks for ``token_id:<id>`` with any tokenizer (``bytes`` then the
UTF-8 of that string, as vLLM's; ``text_offset`` still runs over the text). A logprob of -inf is
sent as -9999.0 (JSON has no infinity; vLLM's choice too).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from dp_runtime.checks import is_int
from dp_runtime.serving.request import LOGPROBS_LIMIT, TokenLogprob
from launch.server.bodies import Kind
from launch.server.protocol import ApiError, ChatRequest, bad

__all__ = ["ChoiceLogprobs", "logprobs_of"]

_FLOOR = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def logprobs_of(req: Any) -> int | None:
    """The engine's ``SamplingParams.logprobs`` of a request: None (not asked) or the number
    of top alternatives per token. Raises ApiError (400) naming the bad field."""
    if isinstance(req, ChatRequest):
        asked, top = req.logprobs, req.top_logprobs
        if asked is not None and not isinstance(asked, bool):
            raise bad("logprobs", f"logprobs must be true or false, got {asked!r}")
        if top is not None:
            if not asked:
                raise bad("top_logprobs", f"top_logprobs needs logprobs: true, got top_logprobs "
                                          f"{top} with logprobs {asked}")
            if not 0 <= top <= LOGPROBS_LIMIT:
                raise bad("top_logprobs",
                          f"top_logprobs must be an int in [0, {LOGPROBS_LIMIT}], got {top}")
        return (top or 0) if asked else None
    n = req.logprobs
    if n is None or n is False:  # false: not asked (a client's way of leaving it out)
        return None
    if not is_int(n) or not 0 <= n <= LOGPROBS_LIMIT:
        raise bad("logprobs", f"logprobs must be an int in [0, {LOGPROBS_LIMIT}] (the number of "
                              f"most likely tokens per token), got {n!r}")
    return int(n)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (printable bytes map to themselves,
    the others to code points from 256 up)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_DECODER = _byte_decoder()


class _Tokens:
    """Token strings and bytes of one tokenizer (module docstring), cached per id."""

    def __init__(self, tokenizer: Any | None, as_ids: bool = False):
        self._tok = tokenizer
        self._as_ids = as_ids  # vLLM's return_tokens_as_token_ids: "token_id:N" strings
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._seen: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, tid: int) -> tuple[str, list[int] | None]:
        got = self._seen.get(tid)
        if got is None:
            got = self._seen[tid] = self._lookup(tid)
        return got

    def _lookup(self, tid: int) -> tuple[str, list[int] | None]:
        if self._tok is None:
            return f"token_id:{tid}", None
        if self._as_ids:
            name = f"token_id:{tid}"
            return name, list(name.encode())
        text = self._tok.decode([tid], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        raw = None if tid in self._special else self._tok.convert_ids_to_tokens(tid)
        if isinstance(raw, str) and (m := _BYTE_TOKEN.fullmatch(raw)):
            return text, [int(m.group(1), 16)]
        if self._byte_level and isinstance(raw, str) and all(c in _BYTE_DECODER for c in raw):
            return text, [_BYTE_DECODER[c] for c in raw]
        return text, list(text.encode("utf-8"))


class ChoiceLogprobs:
    """The ``logprobs`` object of one choice, built from its tokens as they come: ``next(ids,
    logprobs)`` is the object for those tokens (a stream's chunk, or a whole response); a
    completion's ``text_offset`` runs on across calls."""

    def __init__(self, kind: Kind, tokenizer: Any | None, as_token_ids: bool = False):
        self.kind = kind
        self._tokens = _Tokens(tokenizer, as_token_ids)
        self._text = _Tokens(tokenizer) if as_token_ids else self._tokens  # text_offset's
        self._has_text = tokenizer is not None
        self._offset = 0

    def next(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        if len(ids) != len(logprobs):
            raise ApiError(500, f"{len(ids)} tokens but {len(logprobs)} logprobs",
                           kind="server_error", code="logprobs_mismatch")
        if self.kind == "chat":
            return {"content": [self._chat_entry(t, lp)
                                for t, lp in zip(ids, logprobs, strict=True)]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for tid, (lp, top) in zip(ids, logprobs, strict=True):
            text, _ = self._tokens(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(max(lp, _FLOOR))
            alternatives = {self._tokens(i)[0]: max(v, _FLOOR) for i, v in reversed(top)}
            if all(i != tid for i, _ in top):
                alternatives.setdefault(text, max(lp, _FLOOR))
            # Most likely first; of two ids that read the same, the likelier one's entry stays.
            out["top_logprobs"].append(dict(sorted(alternatives.items(), key=lambda kv: -kv[1])))
            out["text_offset"].append(self._offset)
            self._offset += len(self._text(tid)[0]) if self._has_text else 0
        return out

    def _chat_entry(self, tid: int, logprob: TokenLogprob) -> dict:
        lp, top = logprob
        return {**self._token(tid, lp), "top_logprobs": [self._token(i, v) for i, v in top]}

    def _token(self, tid: int, lp: float) -> dict:
        text, raw = self._tokens(tid)
        return {"token": text, "logprob": max(lp, _FLOOR), "bytes": raw}
