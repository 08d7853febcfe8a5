"""What the scheduler keeps per request (``RequestState``) and hands out per step
(``ScheduledStep``); the rules that move them are the scheduler's (scheduler.py)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.forward_batch import ForwardBatch
from dp_runtime.serving.prefix_cache import PrefixMatch
from dp_runtime.serving.request import Request, TokenLogprob

__all__ = ["RequestState", "ScheduledStep", "draw_bans"]


@dataclass(eq=False)
class RequestState:
    """A request on this rank, with the scheduler's bookkeeping."""

    request: Request
    t_arrival: float
    row: int = -1  # req_to_token row once admitted
    kv_len: int = 0  # tokens whose K/V are in the cache
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    t_first_forward: float | None = None
    t_first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # seconds after arrival
    decode_steps: int = 0
    inflight: int = 0  # sampling steps scheduled whose token advance has not recorded yet
    done: bool = False  # finished: later tokens of steps already in flight are dropped
    reserved: int = 0  # KV slots reserved at admission: max_total_tokens less the cached prefix
    cached: int = 0  # prompt tokens whose K/V came from the prefix cache
    match: PrefixMatch | None = None  # its locked prefix-cache match (prefix caching on)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def prefilled(self) -> bool:
        return self.kv_len >= self.prompt_len

    @property
    def decodable(self) -> bool:
        """Prefilled (maybe still in flight), and its next token is not known to be its last."""
        return (self.prefilled
                and len(self.output) + self.inflight < self.request.sampling.max_new_tokens)


@dataclass(frozen=True)
class ScheduledStep:
    """One step's batch and what the scheduler needs back: for each request of the batch (in
    batch order) the tokens it runs, and whether its logits row samples a token."""

    batch: ForwardBatch
    reqs: tuple[RequestState, ...]
    num_new: tuple[int, ...]
    samples: tuple[bool, ...]
    num_decode: int = 0  # an EXTEND batch's leading decode rows (a mixed step); 0 otherwise
    draws: tuple[int, ...] = ()  # where a row samples: the index in its output of the token drawn
    # Per request, the ids its draw may not take (``SamplingParams.min_tokens``: its stop ids and
    # EOS ids while the token drawn is one of its first min_tokens); () where no row bans any.
    bans: tuple[tuple[int, ...], ...] = ()

    @property
    def is_extend(self) -> bool:
        return self.batch.forward_mode is ForwardMode.EXTEND

    @property
    def kind(self) -> str:
        """"decode", "extend" (prefill chunks only) or "mixed" (decode rows and chunks)."""
        if not self.is_extend:
            return "decode"
        return "mixed" if self.num_decode else "extend"

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


def draw_bans(reqs: Sequence[RequestState], samples: Sequence[bool], draws: Sequence[int],
              eos_token_ids: Collection[int]) -> tuple[tuple[int, ...], ...]:
    """``ScheduledStep.bans`` of a step: a sampling row whose token is one of its request's first
    ``min_tokens`` may not draw one of its stop ids nor, unless ``ignore_eos``, an EOS id. Runs
    every step: one pass finds the held rows (usually none), and only those are built."""
    held = [i for i, (r, d) in enumerate(zip(reqs, draws, strict=True))
            if d < r.request.sampling.min_tokens and samples[i]]
    if not held:
        return ()
    eos = tuple(sorted(eos_token_ids))
    bans: list[tuple[int, ...]] = [()] * len(reqs)
    for i in held:
        sp = reqs[i].request.sampling
        bans[i] = sp.stop_token_ids + (() if sp.ignore_eos else eos)
    return tuple(bans) if any(bans) else ()
