"""What a serving run allocates on the GPU beyond what the rank profiled, and where: the tiny
preset's rank of ``tests/test_rank_memory_gpu.py`` serves that test's workload (with
``--prefix-caching``, in two waves that share a 100-token prefix) under torch's allocator
history; the allocations live at the run's peak are grouped by the runtime's line that made
them, beside the profile's ``activation_peak``.

    python bench/memory_growth.py                    # without and with prefix caching
    python bench/memory_growth.py --caching on --top 20

Needs a CUDA GPU. Prints one table per variant: bytes live at the peak (allocated during the
run, freed or not), by call site (the innermost frame under dp_runtime/, graph/, buffers/,
dispatcher/ or launch/; else the innermost frame).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
from collections import Counter

import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams

_OURS = ("dp_runtime/", "graph/", "buffers/", "dispatcher/", "launch/")


def _requests(caching: bool) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    costly = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, logprobs=20, ignore_eos=True,
                            logit_bias=tuple((t, 1.0) for t in range(0, 200, 2)))
    shared = torch.randint(1, 200, (100,), generator=g).tolist() if caching else []
    return [Request(f"r{i}", (shared + torch.randint(1, 200, (n,), generator=g).tolist())[:230],
                    costly if i % 2 else SamplingParams(max_new_tokens=24))
            for i, n in enumerate((200, 180, 120, 12, 230, 64, 90, 17))]


def _site(frames: list[dict]) -> str:
    for f in frames:
        if any(part in f["filename"] for part in _OURS):
            return f"{f['filename'].split('/')[-2]}/{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def _live_at_peak(trace: list[dict]) -> tuple[int, Counter]:
    """Replay the allocator's events: the most bytes live at once and, at that moment, the live
    blocks' bytes by call site."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] in ("free_completed",) and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    sites = Counter()
    for size, site in at_peak.values():
        sites[site] += size
    return peak, sites


def run(caching: bool, top: int) -> None:
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # cuBLAS's workspace, as the test
    spec = RankSpec.create("tiny", device="cuda", dtype="bfloat16", max_running_requests=16, chunked_prefill_size=512,
                           max_context_len=256, prefix_caching=caching)
    with RankWorker(spec, show_progress=False) as w:
        mem = w.memory_report()
        reqs = _requests(caching)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        results = w.generate(reqs[:2]) + w.generate(reqs[2:]) if caching else w.generate(reqs)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        grew = torch.cuda.max_memory_allocated() - base
    trace = [e for t in snap["device_traces"] for e in t]
    peak, sites = _live_at_peak(trace)
    print(f"prefix caching {'on' if caching else 'off'}: grew {grew} bytes over the run (profiled activation_peak "
          f"{mem['activation_peak']}); served {sum(r.ok for r in results)}/{len(results)}, cached "
          f"{sum(r.cached_tokens for r in results)} prompt tokens; the run's own allocations peak at {peak} bytes:")
    for site, size in sites.most_common(top):
        print(f"  {size:>10}  {site}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caching", default="both", choices=("off", "on", "both"))
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_growth.py: needs a CUDA GPU")
    for caching in {"off": (False,), "on": (True,), "both": (False, True)}[a.caching]:
        run(caching, a.top)


if __name__ == "__main__":
    main()
