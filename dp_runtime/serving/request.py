"""Requests in, results out: what a rank's queue takes and what it hands back.

``Request`` and ``RequestResult`` are frozen and picklable: they cross Ray calls and torchrun's
object gathers as they are. Times in a result are seconds on the rank's ``time.perf_counter``
clock, measured from the moment the request arrived on the rank (``submit``, plus the request's
``arrival_s``), so they compare across ranks without a shared clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dp_runtime.checks import is_int

__all__ = ["FINISH_REASONS", "LOGIT_BIAS_LIMIT", "LOGIT_BIAS_MAX", "LOGPROBS_LIMIT", "PENALTY_MAX",
           "Request", "RequestResult", "SamplingParams", "TokenLogprob", "check_request_fields",
           "check_sampling", "token_ids"]

FINISH_REASONS = ("length", "stop", "error", "abort")

LOGPROBS_LIMIT = 20  # most top alternatives a token may report (vLLM's default max_logprobs)
# One sampled token's logprobs (``SamplingParams.logprobs``): its own logprob, and the top N
# (token id, logprob) pairs of the same distribution, most likely first. Plain data: it crosses
# Ray calls and object gathers as it is.
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2**64)
LOGIT_BIAS_LIMIT = 300  # entries of a request's logit_bias (OpenAI's limit)
LOGIT_BIAS_MAX = 100.0  # a bias is in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI's range)
PENALTY_MAX = 2.0  # presence_penalty, frequency_penalty in [-PENALTY_MAX, PENALTY_MAX] (OpenAI's)


def check_sampling(sp: SamplingParams) -> str | None:
    """The first rule ``sp`` breaks, as a message naming the field, the rule and the value;
    None when it is valid."""
    if not isinstance(sp, SamplingParams):  # a field set past the Request constructor
        return f"Request.sampling must be a SamplingParams, got {type(sp).__name__} {sp!r:.80}"
    n = sp.max_new_tokens
    if not is_int(n) or n < 1:
        return f"SamplingParams.max_new_tokens must be an int >= 1, got {n!r}"
    t = sp.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        return f"SamplingParams.temperature must be a finite number >= 0, got {t!r}"
    p = sp.top_p
    if (isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p)
            or not 0 < p <= 1):
        return f"SamplingParams.top_p must be a finite number in (0, 1], got {p!r}"
    k = sp.top_k
    if not is_int(k) or k < 0:
        return f"SamplingParams.top_k must be an int >= 0 (0: off), got {k!r}"
    m = sp.min_p
    if (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m)
            or not 0 <= m <= 1):
        return f"SamplingParams.min_p must be a finite number in [0, 1] (0: off), got {m!r}"
    if not isinstance(sp.ignore_eos, bool):
        return f"SamplingParams.ignore_eos must be a bool, got {sp.ignore_eos!r}"
    s = sp.seed
    if not is_int(s) or not 0 <= s < SEED_LIMIT:
        return f"SamplingParams.seed must be an int in [0, 2**64), got {s!r}"
    stops = sp.stop_token_ids
    if not isinstance(stops, tuple) or not all(is_int(x) and x >= 0 for x in stops):
        return f"SamplingParams.stop_token_ids must be a tuple of ints >= 0, got {stops!r}"
    lp = sp.logprobs
    if lp is not None and (not is_int(lp) or not 0 <= lp <= LOGPROBS_LIMIT):
        return (f"SamplingParams.logprobs must be None or an int in [0, {LOGPROBS_LIMIT}], "
                f"got {lp!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or abs(v) > PENALTY_MAX):
            return (f"SamplingParams.{name} must be a finite number in "
                    f"[-{PENALTY_MAX:g}, {PENALTY_MAX:g}], got {v!r}")
    r = sp.repetition_penalty
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
        return f"SamplingParams.repetition_penalty must be a finite number > 0 (1: off), got {r!r}"
    m = sp.min_tokens
    if not is_int(m) or not 0 <= m <= n:
        return f"SamplingParams.min_tokens must be an int in [0, max_new_tokens={n}], got {m!r}"
    return _check_logit_bias(sp.logit_bias)


def _check_logit_bias(bias: object) -> str | None:
    """``check_sampling``'s rule for ``logit_bias`` (its ids' upper bound, the vocabulary, is
    the door's: ``admission.check_request``)."""
    where = "SamplingParams.logit_bias"
    if not isinstance(bias, tuple):
        return (f"{where} must be a tuple of (token_id, bias) pairs, "
                f"got {type(bias).__name__} {bias!r:.80}")
    if len(bias) > LOGIT_BIAS_LIMIT:
        return f"{where} must hold at most {LOGIT_BIAS_LIMIT} entries, got {len(bias)}"
    seen: set[int] = set()
    for i, pair in enumerate(bias):
        if not isinstance(pair, tuple) or len(pair) != 2:
            return f"{where}[{i}] must be a (token_id, bias) pair, got {pair!r:.80}"
        tid, b = pair
        if not is_int(tid) or tid < 0:
            return f"{where}[{i}]: the token id must be an int >= 0, got {tid!r}"
        if tid in seen:
            return f"{where}[{i}]: token id {tid} is given twice (each id at most once)"
        seen.add(tid)
        if (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                or abs(b) > LOGIT_BIAS_MAX):
            return (f"{where}[{i}]: the bias of token {tid} must be a finite number in "
                    f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {b!r}")
    return None


def token_ids(ids: Any, rid: Any = "?") -> tuple[int, ...]:
    """``ids`` (a sequence of ints, or a 1-D integer tensor or array) as a tuple of Python ints.
    Raises ValueError naming ``prompt_ids`` for a tensor that is not 1-D or holds no integers,
    a string, or something that is not a sequence; the elements themselves are checked by
    ``check_request_fields``."""
    where = f"request {rid!r}: prompt_ids"
    if hasattr(ids, "ndim") and hasattr(ids, "tolist"):  # torch.Tensor, numpy.ndarray
        kind = f"{type(ids).__name__} of dtype {ids.dtype} and shape {tuple(ids.shape)}"
        if ids.ndim != 1:
            raise ValueError(f"{where} must be a 1-D tensor of token ids, got a {kind}")
        if "int" not in str(ids.dtype):  # float, bool, complex: refused, never truncated
            raise ValueError(f"{where} must hold integer token ids, got a {kind}")
        return tuple(int(t) for t in ids.tolist())
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{where} must be a sequence of int token ids, "
                         f"got {type(ids).__name__} {ids!r:.80}")
    # ints as Python ints; others checked later
    return tuple(int(t) if is_int(t) else t for t in ids)


def check_request_fields(req: Request) -> str | None:
    """The first rule a request's own fields break (what it can know alone, without a model),
    as one message naming the field, the limit and the value; None when they are valid.

    Rules: ``rid`` a non-empty string; ``prompt_ids`` a non-empty tuple of ints >= 0;
    ``sampling`` a valid SamplingParams (``check_sampling``); ``arrival_s`` a finite number >= 0.
    """
    rid = req.rid
    if not isinstance(rid, str) or not rid:
        return f"request rid must be a non-empty string, got {rid!r}"
    where = f"request {rid!r}"
    ids = req.prompt_ids
    if not isinstance(ids, tuple) or not ids:
        return (f"{where}: prompt_ids must be a non-empty tuple of token ids, "
                f"got {type(ids).__name__} {ids!r:.80}")
    for pos, t in enumerate(ids):
        # int(2.7) would be 2 and int(True) 1: a token id must already be an integer.
        if not is_int(t) or t < 0:
            return f"{where}: prompt_ids[{pos}] must be an int >= 0, got {t!r}"
    problem = check_sampling(req.sampling)
    if problem is not None:
        return f"{where}: {problem}"
    a = req.arrival_s
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0:
        return f"{where}: arrival_s must be finite and >= 0 (seconds after submit), got {a!r}"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen and when it stops.

    ``temperature == 0`` is greedy (argmax); above it, tokens are drawn from the softmax at that
    temperature restricted to the ``top_k`` most likely tokens (0: all), to the smallest set
    whose mass reaches ``top_p``, and to the tokens at least ``min_p`` times as likely as the
    most likely one (0: off; the three sets intersect), with a generator seeded by ``seed`` (the
    same request draws the same tokens on any rank). A request stops after ``max_new_tokens``
    tokens (reason "length") or at one of ``stop_token_ids`` (reason "stop"; the stop token is
    part of the output). The checkpoint's EOS ids (``RankSpec.eos_token_ids``) stop a request
    the same way unless ``ignore_eos``.

    ``logprobs``: None, none reported; N (0..LOGPROBS_LIMIT): each sampled token comes with its
    logprob and the N most likely tokens' (``TokenLogprob``). They are the log-softmax, in
    float32, of the model's logits for that step before ``logit_bias``, temperature, top-k and
    top-p (vLLM's default "raw" logprobs), so they do not depend on how the token was drawn.

    ``logit_bias``: (token id, bias) pairs, each id at most once (at most ``LOGIT_BIAS_LIMIT``,
    biases in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX], OpenAI's limits), added to the token's logit
    before the argmax (greedy too) and before temperature, top-k and top-p; +100 all but forces
    a token, -100 all but bans it. The logprobs stay the raw ones: they do not see the bias. A
    dict or a list of pairs is taken as its pairs.

    ``presence_penalty`` and ``frequency_penalty`` (in [-PENALTY_MAX, PENALTY_MAX], OpenAI's
    range; 0: off): for each token id the request has generated so far (its output, not its
    prompt), c times, its logit is lowered by ``frequency_penalty * c + presence_penalty`` before
    ``logit_bias`` is added (vLLM's order), for greedy rows too (OpenAI's rule; negative values
    favour repeats). The logprobs stay the raw ones: they do not see the penalties either.

    ``repetition_penalty`` r (finite, > 0; 1: off): for each token id in the request's prompt or
    its output so far, a logit x becomes ``x / r`` where x > 0 and ``x * r`` elsewhere (HF's
    ``RepetitionPenaltyLogitsProcessor``, vLLM's rule), for greedy rows too; r > 1 discourages
    repeats, r < 1 favours them. No upper limit (vLLM has none, and a checkpoint's
    generation_config.json may recommend any r > 0: ``sampling_defaults``); the factor applied
    is r clamped to [2**-64, 2**64], where float32 would overflow past them and the rule has
    reached its limit (``adjusted_rows``), so every r > 0 draws. Order: repetition
    first, then presence and frequency, then ``logit_bias`` (vLLM's). The logprobs stay raw.

    ``min_tokens`` (0..``max_new_tokens``; vLLM's): the first ``min_tokens`` tokens are never a
    stop token nor, unless ``ignore_eos``, an EOS id: their logits are -inf in the draw (greedy
    too; the logprobs stay raw), and stop strings are looked for only after them.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        if isinstance(bias, (list, tuple)):  # a JSONL line's [[id, bias], ...]: frozen pairs
            bias = tuple(tuple(p) if isinstance(p, list) else p for p in bias)
        object.__setattr__(self, "logit_bias", bias)
        problem = check_sampling(self)  # the rules admission applies at every door too
        if problem is not None:
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """A presence or frequency penalty is on: its row reads its output's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def repeats_penalized(self) -> bool:
        """A repetition penalty is on: its row reads which tokens its prompt and output hold."""
        return self.repetition_penalty != 1

    @property
    def adjusted(self) -> bool:
        """A penalty or a ``logit_bias``: its row is chosen from an adjusted copy of its logits
        (``adjusted_rows``)."""
        return bool(self.logit_bias) or self.penalized or self.repeats_penalized


@dataclass(frozen=True)
class Request:
    """One generation request: an id unique within a run, the prompt's token ids, sampling.

    ``prompt_ids``: a sequence of ints, or a 1-D integer tensor or array; stored as a tuple of
    Python ints (``token_ids``), so a request pickles without torch. Every field is checked
    here and again at the door (``check_request_fields``), with its name, limit and value.

    ``arrival_s``: when the request arrives, in seconds after the ``submit`` that queued it (a
    load generator submits a whole arrival stream at once). The scheduler admits it no earlier,
    its times count from then, and ``RankWorker.run_until_idle`` waits for it.
    """

    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", token_ids(self.prompt_ids, self.rid))
        problem = check_request_fields(self)  # the rules admission applies at every door too
        if problem is not None:
            raise ValueError(problem)

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
    counts the decode forwards it took part in. ``logprobs``: one ``TokenLogprob`` per output
    token when the request asked (``SamplingParams.logprobs``), else None. ``cached_tokens``:
    its prompt tokens served from the rank's prefix cache (``RuntimeConfig.prefix_caching``).
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
    logprobs: tuple[TokenLogprob, ...] | None = None
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not prefilled)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a single token)."""
        n = len(self.output_ids)
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else 0.0
