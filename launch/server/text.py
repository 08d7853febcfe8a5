"""Text at the server's door: a checkpoint's tokenizer, its chat template, and the text of a
request's output as it grows.

``load_tokenizer(model_dir)`` is transformers' AutoTokenizer of the checkpoint directory (None
for a preset, or a checkpoint without tokenizer files: token-id prompts still work there).

``TextStream`` turns a request's output token ids, step by step, into text deltas:

- incremental detokenization never splits a UTF-8 sequence: byte-level BPE tokens can hold part
  of a character, so text is released only once the decoded tail is no longer a replacement
  character (the last flush releases whatever is left, as vLLM does);
- special tokens are skipped; a final EOS or stop token id (the engine puts it last in the
  output) is not text;
- stop strings are found in the text; the text ends before the first one, and the caller aborts
  the request on its rank. Streaming holds back the last ``len(longest stop) - 1`` characters so
  that a stop string split over steps is never half sent.

Streamed and non-streamed responses both read ``TextStream``: the concatenated deltas are the
final text by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TextStream", "TokenizerMissing", "encode_chat", "encode_text", "load_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_REPLACEMENT = "\ufffd"


class TokenizerMissing(ValueError):
    """A text prompt for a model without a tokenizer (a preset, or a checkpoint without one)."""


def load_tokenizer(model_dir: Path | None) -> Any | None:
    """The checkpoint's tokenizer (transformers AutoTokenizer), or None when ``model_dir`` is
    None (a preset) or holds no tokenizer file. Raises OSError/ValueError for a broken one."""
    if model_dir is None or not any((Path(model_dir) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _need(tokenizer: Any | None, model_name: str, what: str) -> Any:
    if tokenizer is None:
        raise TokenizerMissing(
            f"model {model_name!r} has no tokenizer (a preset, or a checkpoint "
            f"directory without tokenizer files): {what} needs one; send "
            f"token ids as the prompt instead"
        )
    return tokenizer


def encode_text(tokenizer: Any | None, model_name: str, text: str) -> list[int]:
    """``text`` as token ids (the tokenizer's own special tokens added, as transformers does)."""
    return list(_need(tokenizer, model_name, "a text prompt")(text).input_ids)


def encode_chat(
    tokenizer: Any | None,
    model_name: str,
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
) -> list[int]:
    """``messages`` rendered by the checkpoint's chat template, with the assistant's generation
    prompt and ``tools`` (function specs; None: the template is given none), as token ids.
    Raises TokenizerMissing without a tokenizer, ValueError without a chat template."""
    tok = _need(tokenizer, model_name, "a chat request")
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"model {model_name!r} has no chat template (tokenizer_config.json "
            f"'chat_template'); use /v1/completions"
        )
    # Rendered to text, then encoded without extra specials: the template already writes them.
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return list(tok(text, add_special_tokens=False).input_ids)


@dataclass
class Delta:
    """What one step adds to a request's text; ``stopped``: a stop string was found (the
    request must be aborted on its rank and reported with finish_reason "stop")."""

    text: str
    stopped: bool = False


class TextStream:
    """The text of one request's output, fed token ids as its rank samples them.

    ``hidden_ids``: ids that end a request without being text when they come last (the EOS ids
    unless ignore_eos, plus the request's stop token ids). ``stop``: stop strings, looked for
    only in the text decoded once ``min_tokens`` ids have come (vLLM's rule: the first
    min_tokens tokens end at no stop string, so their text is never cut). Without a tokenizer
    the text is always empty (token-id clients read the ids).
    """

    def __init__(
        self, tokenizer: Any | None, stop: Sequence[str] = (), hidden_ids: Sequence[int] = (),
        *, min_tokens: int = 0,
    ):
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._hidden = frozenset(hidden_ids)
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the last text released from the ids
        self._read = 0
        self.text = ""  # every character decoded so far (before any stop string)
        self._sent = 0  # characters of ``text`` handed out
        self._min_tokens = min_tokens
        self._stop_from = 0 if min_tokens == 0 else None  # where stop strings may start
        self.stopped = False

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(
        self, new_ids: Sequence[int], *, finished: bool = False, stop_by_token: bool = False
    ) -> Delta:
        """Feed the ids one step sampled; returns the text that may be sent now.

        ``finished``: the last ids of the request (flush every held character);
        ``stop_by_token``: it finished with reason "stop" on an id; that id, if it is one of
        ``hidden_ids`` and comes last, is not text."""
        if self.stopped:
            return Delta("", True)
        ids = list(new_ids)
        if finished and stop_by_token and ids and ids[-1] in self._hidden:
            ids = ids[:-1]
        self._ids.extend(ids)
        if self._tok is not None:
            self.text += self._decode_new(finished)
        if self._stop_from is None and len(self._ids) >= self._min_tokens:
            self._stop_from = len(self.text)
        if self._stop and self._stop_from is not None:
            cut = self._find_stop()
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                return Delta(self._release(len(self.text)), True)
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._hold)
        return Delta(self._release(end))

    def _release(self, end: int) -> str:
        out = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return out

    def _decode_new(self, finished: bool) -> str:
        # Decode a window from the last clean boundary, not the whole output: each step costs the
        # window, and a byte-level BPE boundary where text was whole decodes the same either way.
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and (finished or not full_text.endswith(_REPLACEMENT)):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _find_stop(self) -> int | None:
        # Only text not yet cleared can hold a new match: start where a stop string could begin.
        start = max(self._stop_from, self._sent - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None
