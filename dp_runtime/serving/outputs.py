"""StepOutputs: what one rank's steps produced since its launcher last looked.

The step thread adds to it once per step (``RankWorker.wait_tokens``: the step's new tokens and
the requests that finished); the launcher's thread pops it between steps. With
``stream_tokens`` off (batch runs: only results are wanted) new tokens are not kept, so a long
run does not hold every token twice. A token's logprobs (where its request asked) travel
beside it, in a second table keyed the same way. ``wait`` lets a poller sleep until something
arrives instead of spinning.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from dp_runtime.serving.request import RequestResult, TokenLogprob

__all__ = ["StepOutputs"]


class StepOutputs:
    def __init__(self, stream_tokens: bool = False) -> None:
        self.stream_tokens = stream_tokens
        self._lock = threading.Lock()
        self._arrived = threading.Event()
        self._tokens: dict[str, list[int]] = {}
        self._logprobs: dict[str, list[TokenLogprob]] = {}
        self._finished: list[RequestResult] = []

    def add(self, tokens: Iterable[tuple[str, int, TokenLogprob | None]],
            finished: Iterable[RequestResult]) -> None:
        """One step's ``(rid, token, logprobs or None)`` triples, in step order, and its
        finished results."""
        finished = list(finished)
        with self._lock:
            if self.stream_tokens:
                for rid, tok, lp in tokens:
                    self._tokens.setdefault(rid, []).append(tok)
                    if lp is not None:
                        self._logprobs.setdefault(rid, []).append(lp)
            self._finished.extend(finished)
            if self._tokens or self._finished:
                self._arrived.set()

    def pop_finished(self) -> list[RequestResult]:
        """Results finished since the last pop (the tokens stay)."""
        with self._lock:
            out, self._finished = self._finished, []
            return out

    def pop(self) -> tuple[dict[str, tuple[int, ...]], list[RequestResult],
                           dict[str, tuple[TokenLogprob, ...]]]:
        """``(new tokens by rid, finished results, their logprobs by rid)`` since the last pop
        (the third holds only requests that asked, one entry per new token). A finished
        request's result holds all its tokens; its entry in the first may hold only the last
        few."""
        with self._lock:
            tokens = {rid: tuple(t) for rid, t in self._tokens.items()}
            logprobs = {rid: tuple(lp) for rid, lp in self._logprobs.items()}
            finished, self._tokens, self._finished = self._finished, {}, []
            self._logprobs = {}
            self._arrived.clear()
        return tokens, finished, logprobs

    def wait(self, timeout_s: float) -> bool:
        """Sleep until something was added since the last ``pop`` (True) or ``timeout_s``."""
        return self._arrived.wait(timeout_s)
