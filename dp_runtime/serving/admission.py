"""The door: the rules a request must pass before any rank queues it, in one place.

Every path that takes requests applies these same pure functions: ``SamplingParams`` and
``Request`` at construction (what they can know alone), the scheduler at ``submit`` (the
Python API: ValueError, all or none), the JSONL loader (WorkloadError naming file and line),
and the launchers (Ray, torchrun, local), which turn a refused request into its own
``RequestResult`` with ``error`` set and finish_reason "error" so that it costs no other
request. A refused request never enters a step.

Why re-check on the rank what the constructors already checked: a frozen dataclass that
crossed a pickle (a Ray call, a torchrun object gather) was rebuilt without ``__post_init__``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from dp_runtime.checks import is_int
from dp_runtime.serving.request import check_sampling

if TYPE_CHECKING:
    from dp_runtime.serving.request import Request, RequestResult

__all__ = [
    "admit",
    "check_request",
    "duplicate_rids",
    "refused_result",
]


def check_request(req: Request, vocab_size: int | None = None, context_len: int | None = None) -> str | None:
    """The first rule ``req`` breaks, as one message that starts with the request's rid and
    names the field, the limit and the value; None when it may be queued.

    Rules: a non-empty rid string; a non-empty prompt of ints in ``[0, vocab_size)`` (the
    vocabulary is not checked when None); valid sampling (``check_sampling``); prompt +
    max_new_tokens - 1 KV tokens within ``context_len`` (not checked when None).
    """
    rid = req.rid
    if not isinstance(rid, str) or not rid:
        return f"request rid must be a non-empty string, got {rid!r}"
    where = f"request {rid!r}"
    ids = req.prompt_ids
    if not isinstance(ids, tuple) or not ids:
        return f"{where}: prompt_ids must be a non-empty tuple of token ids, got {ids!r:.80}"
    for pos, t in enumerate(ids):
        if not is_int(t):
            return f"{where}: prompt_ids[{pos}] must be an int, got {t!r}"
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            limit = f"[0, vocab_size={vocab_size})" if vocab_size is not None else ">= 0"
            return f"{where}: prompt_ids[{pos}]={t} is not a token id in {limit}"
    problem = check_sampling(req.sampling)
    if problem is not None:
        return f"{where}: {problem}"
    if context_len is not None:
        need = len(ids) + req.sampling.max_new_tokens - 1
        if need > context_len:
            return (f"{where} needs {need} KV tokens (prompt {len(ids)} + max_new_tokens "
                    f"{req.sampling.max_new_tokens} - 1); max_context_len is {context_len}")
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


def refused_result(req: Request, error: str) -> RequestResult:
    """The result of a request refused at the door: no tokens, finish_reason "error", rank -1
    (no rank ran it), zero times."""
    from dp_runtime.serving.request import RequestResult

    n = len(req.prompt_ids) if hasattr(req.prompt_ids, "__len__") else 0
    return RequestResult(rid=str(req.rid), prompt_len=n, output_ids=(), finish_reason="error", rank=-1,
                         queued_s=0.0, ttft_s=0.0, latency_s=0.0, decode_steps=0, error=error)


def admit(requests: Sequence[Request], vocab_size: int | None,
          context_len: int | None) -> tuple[list[Request], list[RequestResult]]:
    """Split a job's requests at the door: ``(accepted, refused results)``, each in submission
    order. Raises ValueError naming the rids when two requests share one (a job-level error:
    the results could not be told apart)."""
    dups = duplicate_rids(requests)
    if dups:
        raise ValueError(f"duplicate request ids (each rid must be unique within a job): {dups[:5]}")
    accepted: list[Request] = []
    refused: list[RequestResult] = []
    for r in requests:
        problem = check_request(r, vocab_size, context_len)
        if problem is None:
            accepted.append(r)
        else:
            refused.append(refused_result(r, problem))
    return accepted, refused
