"""Requests in, results out: what a rank's queue takes and what it hands back.

``Request`` and ``RequestResult`` are frozen and picklable: they cross Ray calls and torchrun's
object gathers as they are. Times in a result are seconds on the rank's ``time.perf_counter``
clock, measured from the moment the request arrived on the rank (``submit``, plus the request's
``arrival_s``), so they compare across ranks without a shared clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dp_runtime.checks import is_int

__all__ = ["FINISH_REASONS", "Request", "RequestResult", "SamplingParams", "check_sampling"]

FINISH_REASONS = ("length", "stop", "error", "abort")


SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2**64)


def check_sampling(sp: SamplingParams) -> str | None:
    """The first rule ``sp`` breaks, as a message naming the field, the rule and the value;
    None when it is valid."""
    n = sp.max_new_tokens
    if not is_int(n) or n < 1:
        return f"SamplingParams.max_new_tokens must be an int >= 1, got {n!r}"
    t = sp.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        return f"SamplingParams.temperature must be a finite number >= 0, got {t!r}"
    p = sp.top_p
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
        return f"SamplingParams.top_p must be a finite number in (0, 1], got {p!r}"
    k = sp.top_k
    if not is_int(k) or k < 0:
        return f"SamplingParams.top_k must be an int >= 0 (0: off), got {k!r}"
    if not isinstance(sp.ignore_eos, bool):
        return f"SamplingParams.ignore_eos must be a bool, got {sp.ignore_eos!r}"
    s = sp.seed
    if not is_int(s) or not 0 <= s < SEED_LIMIT:
        return f"SamplingParams.seed must be an int in [0, 2**64), got {s!r}"
    stops = sp.stop_token_ids
    if not isinstance(stops, tuple) or not all(is_int(x) and x >= 0 for x in stops):
        return f"SamplingParams.stop_token_ids must be a tuple of ints >= 0, got {stops!r}"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen and when it stops.

    ``temperature == 0`` is greedy (argmax); above it, tokens are drawn from the softmax at that
    temperature restricted to the ``top_k`` most likely tokens (0: all) and to the smallest set
    whose mass reaches ``top_p``, with a generator seeded by ``seed`` (the same request draws the same tokens on any rank). A request stops
    after ``max_new_tokens`` tokens (reason "length") or at one of ``stop_token_ids`` (reason
    "stop"; the stop token is part of the output). The checkpoint's EOS ids
    (``RankSpec.eos_token_ids``) stop a request the same way unless ``ignore_eos``.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problem = check_sampling(self)  # the rules admission applies at every door too
        if problem is not None:
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Request:
    """One generation request: an id unique within a run, the prompt's token ids, sampling.

    ``arrival_s``: when the request arrives, in seconds after the ``submit`` that queued it (a
    load generator submits a whole arrival stream at once). The scheduler admits it no earlier,
    its times count from then, and ``RankWorker.run_until_idle`` waits for it.
    """

    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"request rid must be a non-empty string, got {self.rid!r}")
        if not self.prompt_ids:
            raise ValueError(f"request {self.rid!r}: the prompt is empty")
        for pos, t in enumerate(self.prompt_ids):
            # int(2.7) would be 2 and int(True) 1: a token id must already be an integer.
            if not is_int(t) or t < 0:
                raise ValueError(f"request {self.rid!r}: prompt_ids[{pos}] must be an int >= 0, got {t!r}")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"request {self.rid!r}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))

    @property
    def max_total_tokens(self) -> int:
        """KV tokens the request may hold at its end (prompt + every new token but the last,
        whose K/V is never written)."""
        return len(self.prompt_ids) + self.sampling.max_new_tokens - 1


@dataclass(frozen=True)
class RequestResult:
    """A finished request: its tokens, why it stopped, which DP rank ran it, and timings.

    ``queued_s``: from arrival to the first forward that touched it (its admission); ``ttft_s``:
    from arrival to its first new token; ``latency_s``: from arrival to its last token;
    ``token_times_s``: from arrival to each output token (so ``ttft_s`` is the first and
    ``latency_s`` the last; empty for a request refused before running). ``decode_steps``
    counts the decode forwards it took part in.
    """

    rid: str
    prompt_len: int
    output_ids: tuple[int, ...]
    finish_reason: str
    rank: int
    queued_s: float
    ttft_s: float
    latency_s: float
    decode_steps: int
    # Set when the request was refused or failed on its own (bad input, or a bug that hit it
    # alone): its output is then what it had produced, finish_reason "error". Final: a launcher
    # never retries it.
    error: str | None = None
    token_times_s: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a single token)."""
        n = len(self.output_ids)
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else 0.0
