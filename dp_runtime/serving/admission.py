"""The door: the rules a request must pass before any rank queues it, in one place.

Every path that takes requests applies these same pure functions: ``SamplingParams`` and
``Request`` at construction (what they can know alone), the scheduler at ``submit`` (the
Python API: ValueError, all or none, for bad input; a request that only its rank's KV cache
cannot hold fails alone, with its own error result), the JSONL loader (WorkloadError naming file and
line), and the launchers (Ray, torchrun, local), which turn a refused request into its own
``RequestResult`` with ``error`` set and finish_reason "error" so that it costs no other
request. A refused request never enters a step.

Why re-check on the rank what the constructors already checked: a frozen dataclass that
crossed a pickle (a Ray call, a torchrun object gather) was rebuilt without ``__post_init__``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from dp_runtime.serving.request import RequestResult, check_request_fields

if TYPE_CHECKING:
    from dp_runtime.rank_spec import RankSpec
    from dp_runtime.serving.request import Request

__all__ = [
    "admit",
    "check_request",
    "duplicate_rids",
    "known_kv_slots",
    "kv_refusal",
    "refused_result",
]


def check_request(req: Request, vocab_size: int | None = None, context_len: int | None = None,
                  kv_slots: int | None = None) -> str | None:
    """The first rule ``req`` breaks, as one message that starts with the request's rid and
    names the field, the limit and the value; None when it may be queued.

    Rules: its own fields (``request.check_request_fields``: rid, prompt_ids, sampling,
    arrival_s); token ids, the prompt's, ``logit_bias``'s and ``stop_token_ids``, in ``[0,
    vocab_size)`` (not checked when None); prompt + max_new_tokens - 1 KV tokens within
    ``context_len`` and within a rank's whole KV cache of ``kv_slots`` token slots (each not checked
    when None).
    """
    problem = check_request_fields(req)
    if problem is not None:
        return problem
    where, ids = f"request {req.rid!r}", req.prompt_ids
    if vocab_size is not None:
        for pos, t in enumerate(ids):
            if t >= vocab_size:
                return (f"{where}: prompt_ids[{pos}]={t} is not a token id in "
                        f"[0, vocab_size={vocab_size})")
        for pos, (t, _) in enumerate(req.sampling.logit_bias):
            if t >= vocab_size:
                return (f"{where}: SamplingParams.logit_bias[{pos}]: token id {t} is not in "
                        f"[0, vocab_size={vocab_size})")
        for pos, t in enumerate(req.sampling.stop_token_ids):
            if t >= vocab_size:  # it could never stop the request: a mistake, not a no-op
                return (f"{where}: SamplingParams.stop_token_ids[{pos}]={t} is not a token id in "
                        f"[0, vocab_size={vocab_size})")
    need = len(ids) + req.sampling.max_new_tokens - 1
    if context_len is not None and need > context_len:
        return (f"{where} needs {need} KV tokens (prompt {len(ids)} + max_new_tokens "
                f"{req.sampling.max_new_tokens} - 1); max_context_len is {context_len}")
    if kv_slots is not None and need > kv_slots:
        return kv_refusal(req, kv_slots)
    return None


def kv_refusal(req: Request, kv_slots: int) -> str:
    """Why ``req`` can never run on a rank whose whole KV cache holds ``kv_slots`` tokens."""
    n, new = len(req.prompt_ids), req.sampling.max_new_tokens
    return (f"request {req.rid!r} needs {n + new - 1} KV tokens (prompt {n} + max_new_tokens {new} "
            f"- 1); a rank's whole KV cache holds {kv_slots} (kv_cache_tokens)")


def known_kv_slots(spec: RankSpec) -> int | None:
    """The KV slots each rank of ``spec`` will allocate, where the door can know them before a
    rank starts: ``spec.kv_cache_tokens`` when given, else a CPU rank's fixed size; None on
    CUDA, where they follow the free memory after the weights (the rank then answers a request
    that cannot fit with its own error result, ``Scheduler.submit``)."""
    from dp_runtime.memory_sizing import kv_slots_for_rank

    if spec.kv_cache_tokens is not None or spec.runtime.device.type != "cuda":
        return kv_slots_for_rank(spec, spec.runtime.device)
    return None


def duplicate_rids(requests: Iterable[Request]) -> list[str]:
    """The rids that occur more than once, in order of their second occurrence."""
    seen: set[str] = set()
    dups: list[str] = []
    for r in requests:
        if r.rid in seen and r.rid not in dups:
            dups.append(r.rid)
        seen.add(r.rid)
    return dups


def refused_result(req: Request, error: str, rank: int = -1) -> RequestResult:
    """The result of a request refused before it ran: no tokens, finish_reason "error", zero
    times; ``rank`` -1 when refused at the door (no rank saw it), else the rank that refused it."""
    n = len(req.prompt_ids) if hasattr(req.prompt_ids, "__len__") else 0
    return RequestResult(rid=str(req.rid), prompt_len=n, output_ids=(), finish_reason="error",
                         rank=rank, queued_s=0.0, ttft_s=0.0, latency_s=0.0, decode_steps=0,
                         error=error)


def admit(requests: Sequence[Request], vocab_size: int | None, context_len: int | None,
          kv_slots: int | None = None) -> tuple[list[Request], list[RequestResult]]:
    """Split a job's requests at the door: ``(accepted, refused results)``, each in submission
    order (``check_request``; pass ``kv_slots=known_kv_slots(spec)`` to refuse here a request
    that no rank's KV cache can hold). Raises ValueError naming the rids when two requests
    share one (a job-level error: the results could not be told apart)."""
    dups = duplicate_rids(requests)
    if dups:
        raise ValueError(
            f"duplicate request ids (each rid must be unique within a job): {dups[:5]}")
    accepted: list[Request] = []
    refused: list[RequestResult] = []
    for r in requests:
        problem = check_request(r, vocab_size, context_len, kv_slots)
        if problem is None:
            accepted.append(r)
        else:
            refused.append(refused_result(r, problem))
    return accepted, refused
