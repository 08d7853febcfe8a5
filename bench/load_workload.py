"""The requests of bench/serve_load.py (its docstring says what they are): prompt and output
lengths, arrival times, each rate's requests, the warm-up's and the decode probe's. Pure
functions of the seed."""

from __future__ import annotations

import dataclasses
import math
import random

from dp_runtime.serving.request import Request, SamplingParams
from launch.cli_errors import UsageError

__all__ = ["SHAREGPT_LIKE", "WARM_PAST_CHUNK", "Lengths", "arrival_times", "decode_probe_requests",
           "make_batches", "make_requests", "parse_concurrency", "warmup_requests"]

# (lo, hi, weight): lengths uniform in [lo, hi) within a bin. Totals stay under 2048 tokens, the
# tiny preset's context, so the default runs on every preset.
SHAREGPT_LIKE = {
    "input": ((4, 32, 0.20), (32, 128, 0.30), (128, 512, 0.30), (512, 1024, 0.15), (1024, 1536, 0.05)),
    "output": ((1, 32, 0.25), (32, 128, 0.25), (128, 256, 0.25), (256, 512, 0.25)),
}

# Tokens past a whole prefill chunk in each rank's warm-up prompt (``warmup_requests``).
WARM_PAST_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Where prompt and output lengths come from (bench/serve_load.py's docstring)."""

    kind: str  # "sharegpt" | "random"
    input_len: int = 0
    output_len: int = 0
    ratio: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        if text == "sharegpt":
            return cls("sharegpt")
        parts = text.split(":")
        try:
            if parts[0] != "random" or len(parts) not in (3, 4):
                raise ValueError
            out = cls("random", int(parts[1]), int(parts[2]), float(parts[3]) if len(parts) == 4 else 0.0)
        except ValueError:
            raise UsageError(f"--lengths must be 'sharegpt' or 'random:IN:OUT[:RATIO]', got {text!r}") from None
        if out.input_len < 1 or out.output_len < 1 or not 0 <= out.ratio < 1:
            raise UsageError(f"--lengths {text!r}: IN and OUT must be >= 1 and RATIO in [0, 1)")
        return out

    def draw(self, rng: random.Random) -> tuple[int, int]:
        """One (prompt length, output length)."""
        if self.kind == "sharegpt":
            return _from_bins(rng, SHAREGPT_LIKE["input"]), _from_bins(rng, SHAREGPT_LIKE["output"])
        r = self.ratio

        def one(x: int) -> int:
            return max(1, rng.randint(round(x * (1 - r)), round(x * (1 + r))))

        return one(self.input_len), one(self.output_len)


def _from_bins(rng: random.Random, bins: tuple[tuple[int, int, float], ...]) -> int:
    lo, hi, _ = rng.choices(bins, weights=[w for *_, w in bins])[0]
    return rng.randrange(lo, hi)


def arrival_times(n: int, rate: float, process: str, rng: random.Random) -> list[float]:
    """``n`` arrival offsets in seconds, the first at 0: Poisson (exponential gaps) or fixed
    (gaps of 1/rate) at ``rate`` requests/s; every one at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if process == "poisson" else 1.0 / rate
    return out


def make_requests(n: int, rate: float, lengths: Lengths, process: str, vocab: int, seed: int,
                  tag: str, sampling: SamplingParams | None = None, shared_prefix_len: int = 0,
                  prefix_groups: int = 1) -> list[Request]:
    """The requests of one rate, in arrival order (rids ``{tag}-00000``, ...). ``sampling``:
    every request's fields but its output length and seed (request i draws with seed i);
    default greedy. ``shared_prefix_len``: every prompt starts with that many tokens of one of
    ``prefix_groups`` prefixes (``shared_prefix``; one group: a system prompt; several: many
    system prompts or conversations), drawn uniformly per request, followed by its drawn length
    of its own."""
    if prefix_groups < 1:
        raise ValueError(f"prefix_groups must be >= 1, got {prefix_groups}")
    rng = random.Random(f"{seed}-{tag}")
    base = sampling or SamplingParams()
    heads = [shared_prefix(shared_prefix_len, vocab, seed, g) for g in range(prefix_groups)]
    out = []
    for i, t in enumerate(arrival_times(n, rate, process, rng)):
        n_in, n_out = lengths.draw(rng)
        # one group draws nothing: its requests stay those of a seed before --prefix-groups
        head = heads[rng.randrange(prefix_groups)] if prefix_groups > 1 else heads[0]
        prompt = head + [rng.randrange(vocab) for _ in range(n_in)]
        out.append(Request(f"{tag}-{i:05d}", prompt, dataclasses.replace(base, max_new_tokens=n_out, seed=i),
                           arrival_s=t))
    return out


def shared_prefix(n: int, vocab: int, seed: int, group: int = 0) -> list[int]:
    """The ``n`` token ids the prompts of prefix group ``group`` start with under
    ``--shared-prefix-len n`` (the same for every rate of a seed)."""
    rng = random.Random(f"{seed}-shared-prefix" + (f"-{group}" if group else ""))
    return [rng.randrange(vocab) for _ in range(n)]


def parse_concurrency(text: str | None, rates: str | None, max_running: int) -> list[int]:
    """``--concurrency`` (running requests a rank, comma-separated) as ints; [] without it.
    UsageError naming the option for a value that is not an int >= 1, one above
    ``max_running`` (``--max-running-requests``: a rank runs no more at once), or beside
    ``--rates`` (each concurrency is its own batch at rate inf)."""
    if text is None:
        return []
    if rates is not None:
        raise UsageError("--concurrency and --rates are exclusive: each concurrency runs all its requests "
                         "at once")
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--concurrency must be ints, comma-separated; got {text!r}") from None
    if min(values) < 1:
        raise UsageError(f"--concurrency must be >= 1, got {text!r}")
    if max(values) > max_running:
        raise UsageError(f"--concurrency {max(values)} exceeds --max-running-requests "
                         f"{max_running} (a rank runs at most that many at once)")
    return values


def make_batches(args, vocab: int, world: int) -> list[tuple[float, list[Request], int | None]]:
    """``(rate, requests, concurrency)`` of each batch serve_load runs (its ``args``): one per
    ``--rates`` entry (``--num-requests`` each, concurrency None), or with ``--concurrency`` one
    per value C: C x ``world`` requests at rate inf (rids ``c{C}-...``), C a rank."""
    def batch(n: int, rate: float, tag: str) -> list[Request]:
        return make_requests(n, rate, args.lengths, args.arrival, vocab, args.seed, tag, args.sampling,
                             args.shared_prefix_len, args.prefix_groups)

    if args.concurrency:
        return [(math.inf, batch(c * world, math.inf, f"c{c}"), c) for c in args.concurrency]
    return [(rate, batch(args.num_requests, rate, f"q{i}"), None) for i, rate in enumerate(args.rates)]


def warmup_requests(n: int, lengths: Lengths, process: str, vocab: int, seed: int, *, chunk: int,
                    max_prompt: int, world: int, sampling: SamplingParams | None = None,
                    max_new: int | None = None) -> list[Request]:
    """What runs, unreported, before the first rate, all at once: (if ``n``) one prompt per rank
    of a whole prefill chunk plus WARM_PAST_CHUNK tokens, ``max_prompt`` at most, generating one
    token, then ``n`` requests (their output lengths capped at ``max_new`` when given). The long
    prompts come first, so both ways of spreading requests give each rank one: round-robin
    (torchrun) and the engine's least outstanding tokens (the first to rank 0, the next to a rank
    without one, ...).

    Why: a kernel's first step compiles or JIT-builds it, seconds that would otherwise land in
    the TTFT of the first timed rate. Such a prompt is prefilled in two extend steps on its
    rank: a step of a whole chunk (Triton's expert GEMM tiles), then its rest, whose request
    has a cached prefix (FlashInfer's ``cascade`` module: the merge of the prefix and ragged
    passes). A model whose context is not longer than the chunk never splits a lone prompt."""
    warm = make_requests(n, math.inf, lengths, process, vocab, seed, "warm", sampling)
    if max_new is not None:
        warm = [dataclasses.replace(r, sampling=dataclasses.replace(
            r.sampling, max_new_tokens=min(r.sampling.max_new_tokens, max_new))) for r in warm]
    if not warm:
        return warm
    size = min(chunk + WARM_PAST_CHUNK, max_prompt)
    long = []
    for k in range(world):
        rng = random.Random(f"{seed}-warm-chunk-{k}")
        long.append(Request(f"warm-chunk-{k}", [rng.randrange(vocab) for _ in range(size)],
                            SamplingParams(max_new_tokens=1), arrival_s=0.0))
    return long + warm


def decode_probe_requests(running: int, world: int, vocab: int, seed: int, *, prompt_len: int,
                          new_tokens: int, tag: str, sampling: SamplingParams | None = None) -> list[Request]:
    """``running`` requests per rank (round-robin, or the engine's routing of equal requests, gives
    each rank as many), all at once, of ``prompt_len`` random tokens generating ``new_tokens``:
    once their prompts are in, every step decodes ``running`` rows on every rank, so their token
    gaps time the decode step at that batch (serve_load's decode-only bound). ``sampling`` as for
    ``make_requests``."""
    rng = random.Random(f"{seed}-{tag}")
    base = sampling or SamplingParams()
    return [Request(f"{tag}-{i:05d}", [rng.randrange(vocab) for _ in range(prompt_len)],
                    dataclasses.replace(base, max_new_tokens=new_tokens, seed=i), arrival_s=0.0)
            for i in range(running * world)]
