"""What vLLM's request extras (``vllm_extras.py``) do here: refused by name, the prompt cut, and
the response fields vLLM clients read.

- ``refuse_unimplemented(req)``: each field of ``REFUSED`` set to something other than its
  "not set" values is a 400 naming it (never ignored).
- ``truncate(ids, req, context_len)``: ``truncate_prompt_tokens`` k >= 1 keeps the prompt's last k
  tokens, -1 the last ``context_len - 1`` (the room for one new token); k must be below the
  context length (vLLM's rule), 0 or below -1 is a 400.
- ``ResponseExtras``: ``return_token_ids`` adds each choice's output ``token_ids`` (a stream: each
  chunk's step's ids) and ``prompt_token_ids`` (a completion: on each choice, its own prompt's; a
  chat: on the response, as vLLM's) to a whole response and to the first chunk of each choice of
  a stream. A server without a tokenizer (a preset) gives ``token_ids`` unasked: its outputs have
  no text, the ids are all they say; ``stream_options.continuous_usage_stats`` (with
  ``include_usage``, as vLLM's) puts the usage so far on every chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from launch.server.protocol import ChatRequest, bad

__all__ = ["REFUSED", "ResponseExtras", "refuse_unimplemented", "truncate"]

_UNSET = (None,)
_OFF = (None, False)
# field: (its "not set" values, what it would do)
REFUSED: dict[str, tuple[tuple, str]] = {
    "guided_json": (_UNSET, "guided decoding"),
    "guided_regex": (_UNSET, "guided decoding"),
    "guided_choice": (_UNSET, "guided decoding"),
    "guided_grammar": (_UNSET, "guided decoding"),
    "guided_decoding_backend": (_UNSET, "guided decoding"),
    "guided_whitespace_pattern": (_UNSET, "guided decoding"),
    "structural_tag": (_UNSET, "structured output"),
    "structured_outputs": (_UNSET, "structured output"),
    "include_stop_str_in_output": (_OFF, "keeping the stop string in the text"),
    "prompt_logprobs": (_UNSET, "prompt logprobs"),
    "use_beam_search": (_OFF, "beam search"),
    "length_penalty": ((None, 1.0), "beam search"),
    "early_stopping": (_OFF, "beam search"),
    "bad_words": ((None, []), "banned words"),
    "allowed_token_ids": (_UNSET, "a restricted vocabulary"),
    "skip_special_tokens": ((None, True), "special tokens in the text"),
    "spaces_between_special_tokens": ((None, True), "detokenizing without those spaces"),
    "add_generation_prompt": ((None, True), "a prompt without the assistant's turn"),
    "continue_final_message": (_OFF, "continuing the last message"),
    "chat_template": (_UNSET, "a chat template from the request"),
    "chat_template_kwargs": ((None, {}), "chat template arguments"),
    "documents": (_UNSET, "documents for the chat template"),
}
_CHAT_ONLY = {"echo": (_OFF, "echoing the last message")}


def _is_unset(value: Any, unset: tuple) -> bool:
    """``value`` is one of ``unset``; a bool only as itself (``0 == False`` is no "off")."""
    for u in unset:
        if value is u:
            return True
        if not isinstance(value, bool) and not isinstance(u, bool) and value == u:
            return True
    return False


def refuse_unimplemented(req: Any) -> None:
    """Raise ApiError (400) naming the first extra ``req`` sets that this server does not
    implement (``REFUSED``)."""
    table = {**REFUSED, **(_CHAT_ONLY if isinstance(req, ChatRequest) else {})}
    for name, (unset, what) in table.items():
        value = getattr(req, name, None)
        if not _is_unset(value, unset):
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise bad(name, f"{name} is not supported ({what} is not implemented here), got "
                            f"{shown}")


def truncate(ids: list[int], req: Any, context_len: int, param: str) -> list[int]:
    """``ids`` cut as ``truncate_prompt_tokens`` asks (module docstring). Raises ApiError."""
    k = getattr(req, "truncate_prompt_tokens", None)
    if k is None:
        return ids
    if k == -1:
        k = context_len - 1
    elif not 1 <= k < context_len:
        raise bad("truncate_prompt_tokens",
                  f"truncate_prompt_tokens must be -1 (as the context allows) or in [1, "
                  f"{context_len - 1}] (below the context length {context_len}), got {k}")
    return ids[-k:] if len(ids) > k else ids


@dataclass
class ResponseExtras:
    """The response fields a request's vLLM extras ask for (module docstring). ``prompts``:
    each choice's prompt ids (choice i of k prompts x n is prompt i // n's); ``output_ids``:
    choices (and chunks) carry their ``token_ids`` (the responder puts them)."""

    kind: str
    prompts: list[list[int]]
    return_token_ids: bool = False
    continuous_usage: bool = False
    output_ids: bool = False
    _started: set = field(default_factory=set)

    @classmethod
    def of(cls, req: Any, kind: str, prompts: list[list[int]], n: int,
           has_text: bool = True) -> ResponseExtras:
        """``has_text``: the server has a tokenizer (without one, ids are the only output)."""
        opts = getattr(req, "stream_options", None)
        continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        asked = bool(req.return_token_ids)
        return cls(kind, [p for p in prompts for _ in range(n)], asked, continuous,
                   output_ids=asked or not has_text)

    def whole(self, out: dict) -> None:
        """Add the fields to a whole response ``out``."""
        if not self.return_token_ids:
            return
        if self.kind == "chat":
            out["prompt_token_ids"] = list(self.prompts[0])
            return
        for i, choice in enumerate(out["choices"]):
            choice["prompt_token_ids"] = list(self.prompts[i])

    def chunk(self, body: dict, usage_now: Callable[[], dict]) -> None:
        """Add the fields to a streamed chunk ``body`` (one choice's, or the usage chunk)."""
        if "choices" not in body:  # an error event
            return
        if self.continuous_usage and "usage" not in body:
            body["usage"] = usage_now()
        if not self.return_token_ids or not body["choices"]:
            return
        i = body["choices"][0]["index"]
        if i in self._started:
            return
        self._started.add(i)
        if self.kind == "chat":
            body["prompt_token_ids"] = list(self.prompts[i])
        else:
            body["choices"][0]["prompt_token_ids"] = list(self.prompts[i])
