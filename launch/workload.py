"""Workloads for a run: synthetic requests or a JSONL file, and their split over DP ranks.

A synthetic workload is a pure function of its frozen ``SyntheticWorkload`` (same seed, same
requests), so every torchrun rank can build it alone and take its own share.

JSONL: one object per line, blank lines and ``#`` lines skipped::

    {"rid": "a", "prompt_ids": [1, 2, 3], "max_new_tokens": 8, "temperature": 0.0,
     "top_p": 1.0, "seed": 0, "stop_token_ids": [2]}

Only ``prompt_ids`` is required; ``rid`` defaults to ``line<N>``; sampling fields default to the
``defaults`` given to ``load_jsonl``. Errors name the file and line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from dp_runtime.serving.admission import check_request
from dp_runtime.serving.request import Request, SamplingParams

__all__ = ["SyntheticWorkload", "WorkloadError", "load_jsonl", "split_round_robin"]

_SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))
_KEYS = {"rid", "prompt_ids", *_SAMPLING_KEYS}


class WorkloadError(ValueError):
    """A workload that cannot be read: a missing file or a bad line (named in the message)."""


@dataclass(frozen=True)
class SyntheticWorkload:
    """``num_requests`` prompts of random token ids in ``[0, vocab_size)``.

    Prompt lengths are drawn uniformly from ``[prompt_len_min, prompt_len]`` (min defaults to
    ``prompt_len``: all equal). Every request generates ``max_new_tokens`` greedy tokens unless
    ``temperature > 0``. rids are ``r0000``, ``r0001``, ... (sortable in submission order).
    """

    num_requests: int = 16
    prompt_len: int = 32
    max_new_tokens: int = 16
    vocab_size: int = 1000
    prompt_len_min: int | None = None
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "prompt_len", "max_new_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SyntheticWorkload.{name} must be >= 1, "
                                 f"got {getattr(self, name)}")
        lo = self.prompt_len_min
        if lo is not None and not 1 <= lo <= self.prompt_len:
            raise ValueError(f"SyntheticWorkload.prompt_len_min must be in "
                             f"[1, prompt_len={self.prompt_len}], got {lo}")

    def requests(self) -> list[Request]:
        """The requests, in rid order."""
        rng = random.Random(self.seed)
        lo = self.prompt_len if self.prompt_len_min is None else self.prompt_len_min
        width = len(str(max(self.num_requests - 1, 9999)))
        out = []
        for i in range(self.num_requests):
            n = rng.randint(lo, self.prompt_len)
            prompt = tuple(rng.randrange(self.vocab_size) for _ in range(n))
            sampling = SamplingParams(max_new_tokens=self.max_new_tokens,
                                      temperature=self.temperature, seed=i)
            out.append(Request(f"r{i:0{width}d}", prompt, sampling))
        return out


def load_jsonl(path: str | Path, defaults: SamplingParams | None = None,
               vocab_size: int | None = None) -> list[Request]:
    """The requests of a JSONL file, in file order (format: see the module docstring).

    ``vocab_size``, when given, bounds every token id. Raises WorkloadError naming the file and the
    line for a missing file, a line that is not UTF-8, invalid JSON, an unknown key, a bad value, a
    duplicate rid, or an empty file.
    """
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"workload file {str(p)!r} does not exist")
    defaults = defaults or SamplingParams()
    out: list[Request] = []
    seen: dict[str, int] = {}
    with p.open("rb") as f:  # bytes: a line that is not UTF-8 is named like any other bad line
        for lineno, raw in enumerate(f, start=1):
            where = f"{p}:{lineno}"
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise WorkloadError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                    f"{e.start + 1})") from None
            if not text or text.startswith("#"):
                continue
            try:
                req = _parse_line(text, lineno, defaults, vocab_size)
            except (ValueError, TypeError) as e:
                raise WorkloadError(f"{where}: {e}") from None
            if req.rid in seen:
                raise WorkloadError(f"{where}: rid {req.rid!r} already used on line "
                                    f"{seen[req.rid]}")
            seen[req.rid] = lineno
            out.append(req)
    if not out:
        raise WorkloadError(f"workload file {str(p)!r} holds no requests")
    return out


def _parse_line(text: str, lineno: int, defaults: SamplingParams,
                vocab_size: int | None) -> Request:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise ValueError(f"unknown keys {unknown} (allowed: {sorted(_KEYS)})")
    prompt = obj.get("prompt_ids")
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("'prompt_ids' must be a non-empty list of token ids")
    sampling = {k: obj[k] for k in _SAMPLING_KEYS if k in obj}
    if isinstance(sampling.get("stop_token_ids"), list):
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
    rid = obj.get("rid", f"line{lineno}")
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"'rid' must be a non-empty string, got {rid!r}")
    # The rules of the door (dp_runtime.serving.admission), the same on every path; json.loads
    # reads NaN and Infinity, which SamplingParams refuses here.
    req = Request(rid, tuple(prompt), replace(defaults, **sampling))
    problem = check_request(req, vocab_size)
    if problem is not None:
        raise ValueError(problem)
    return req


def split_round_robin(requests: Sequence[Request], world_size: int) -> list[list[Request]]:
    """Request ``i`` goes to rank ``i % world_size``; returns one list per rank (some may be
    empty)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shares: list[list[Request]] = [[] for _ in range(world_size)]
    for i, req in enumerate(requests):
        shares[i % world_size].append(req)
    return shares
