"""Dispatch + combine round latency of the MoE dispatchers, side by side in one run.

    torchrun --nproc-per-node 4 bench/dispatch.py                # GPU: 1..8192 tokens/rank, hidden 4096 + 7168
    torchrun --nproc-per-node 4 bench/dispatch.py --quick        # GPU: fewer token counts
    torchrun --nproc-per-node 2 bench/dispatch.py --device cpu --quick   # CPU/gloo smoke test (torch backends)

Methods (top-8 of 256 experts, bf16, random routing, every rank the same token count):
- ``all_gather``: AllGatherDispatcher (all-gather, reduce-scatter)
- ``all_to_all``: AllToAllDispatcher (counts exchange + variable-split all_to_all_single)
- ``flashinfer``: our FlashInferDispatcher (MoeAlltoAll underneath)
- ``raw``: flashinfer.comm.MoeAlltoAll called directly (dispatch, then combine of the received rows)

A round is dispatch, then the expert outputs (the received hidden rows copied into the backend's
expert-output buffer: experts are not timed), then combine. Our dispatchers run with
``check_expert_ids=False`` (that check is a host sync of the router's output, not dispatch work).
Per rank: median over ``--iters`` rounds after ``--warmup`` rounds, timed with CUDA events (GPU) or
``perf_counter`` (CPU), ranks aligned by a barrier before each round; a row reports the slowest
rank's median in microseconds. ``ws_B/rank`` is FlashInfer's per-rank workspace for a
``max_tokens_per_rank`` equal to the row's tokens (sizing.flashinfer_workspace_bytes_per_rank).
Rank 0 prints the table last, with ratios ``fi/raw`` (ours over raw MoeAlltoAll) and ``a2a/fi``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from dispatcher import (
    AllToAllDispatcher,
    DispatcherConfig,
    EPGroup,
    FixedPlan,
    make_dispatcher,
)
from dispatcher.sizing import flashinfer_workspace_bytes_per_rank
from tests.support.gather_buffers import gather_buffers

GPU_TOKENS = tuple(2**i for i in range(14))  # 1 .. 8192
GPU_QUICK = (1, 8, 64, 512, 4096)
CPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CPU_QUICK = (1, 4, 16, 64)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--quick", action="store_true", help="fewer token counts")
    p.add_argument("--tokens", type=int, nargs="+", help="tokens per rank (overrides the sweep)")
    p.add_argument("--hidden", type=int, nargs="+", help="hidden sizes (default 4096 7168; CPU: 128)")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=["all_gather", "all_to_all", "flashinfer", "raw"])
    p.add_argument("--no-graph", action="store_true", help="skip the graph-replayed flashinfer/raw rounds")
    p.add_argument("--json", type=Path, help="rank 0 also writes the rows here")
    return p.parse_args()


def _init(device_kind: str) -> tuple[EPGroup, torch.device]:
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:  # plain `python bench/dispatch.py`: a one-rank process group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = dict(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    else:
        init = {}
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", timeout=datetime.timedelta(seconds=600), **init)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=600), **init)
        device = torch.device("cpu")
    return EPGroup.from_torch(), device


def _inputs(tokens: int, hidden: int, experts: int, top_k: int, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=g, device=device)
    w, ids = scores.topk(top_k, dim=1)
    return x, ids.to(torch.int32), (w / w.sum(dim=1, keepdim=True)).float()


def _time_rounds(ep: EPGroup, device: torch.device, fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Slowest rank's median microseconds of ``fn``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=ep.cpu_group)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=ep.cpu_group)
    return float(med.item())


def _capture(fn: Callable[[], object], ep: EPGroup) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after warm-up runs on a side stream (all ranks together)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier(group=ep.cpu_group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=ep.cpu_group)
    return graph


def _ours_round(d, x, ids, w, plan):
    # all_gather lays its buffers out from the plan in dispatch: MAX_LEN slots, as a decode step's.
    def run():
        handle, inputs = d.dispatch(x, ids, w, plan)
        out = d.expert_output_buffer(handle)
        out.copy_(inputs.hidden_ND)  # stands in for the experts writing their outputs
        return d.combine(out, handle)

    return run


def _raw_round(a2a, x, ids, w, tokens):
    def run():
        recv = a2a.dispatch(ids, [x, ids, w], tokens, invalid_token_expert_id=-1, expert_id_payload_index=1)
        return a2a.combine(recv[0], tokens)  # received rows as the expert outputs (staged by combine)

    return run


def _make_raw(ep: EPGroup, max_tokens: int, top_k: int, experts: int, hidden: int):
    from flashinfer.comm.comm_backend import TorchDistBackend
    from flashinfer.comm.mapping import Mapping
    from flashinfer.comm.mnnvl import MnnvlConfig
    from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll

    mapping = Mapping(world_size=ep.size, rank=ep.rank, gpus_per_node=ep.size, tp_size=ep.size,
                      moe_ep_size=ep.size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return MoeAlltoAll(mapping, max_num_tokens=max_tokens, top_k=top_k, num_experts=experts,
                           hidden_size=hidden, mnnvl_config=MnnvlConfig(comm_backend=TorchDistBackend(group=ep.cpu_group)))


def _commit() -> str:
    if os.environ.get("BENCH_COMMIT"):  # a lent machine gets the tree without .git (bench/run_gpu.sh)
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], timeout=5).stdout.strip() or "?"
    except Exception:
        return "?"


def main() -> None:
    args = _parse()
    ep, device = _init(args.device)
    on_gpu = device.type == "cuda"
    tokens_list = list(args.tokens or ((GPU_QUICK if args.quick else GPU_TOKENS) if on_gpu
                                       else (CPU_QUICK if args.quick else CPU_TOKENS)))
    hiddens = args.hidden or ([4096, 7168] if on_gpu else [128])
    methods = list(args.methods)
    notes = []
    if not on_gpu:
        dropped = [m for m in methods if m in ("flashinfer", "raw")]
        methods = [m for m in methods if m not in ("flashinfer", "raw")]
        if dropped:
            notes.append(f"CPU run: {', '.join(dropped)} skipped (FlashInfer needs CUDA)")
    elif any(m in ("flashinfer", "raw") for m in methods):
        try:
            import flashinfer

            notes.append(f"flashinfer {getattr(flashinfer, '__version__', '?')}")
        except ImportError as exc:
            methods = [m for m in methods if m not in ("flashinfer", "raw")]
            notes.append(f"flashinfer missing ({exc}): flashinfer and raw skipped")
    max_tokens = max(tokens_list)
    rows = []
    started = time.monotonic()
    for hidden in hiddens:
        cfg = DispatcherConfig(num_experts=args.experts, top_k=args.top_k, hidden_size=hidden, dtype=torch.bfloat16,
                               max_tokens_per_rank=max_tokens, check_expert_ids=False)
        ours = {}
        t0 = time.monotonic()
        if "all_gather" in methods:
            ours["all_gather"] = make_dispatcher("all_gather", cfg, ep=ep, device=device,
                                                 buffers=gather_buffers(cfg, ep, device))
        if "all_to_all" in methods:
            ours["all_to_all"] = AllToAllDispatcher(cfg, ep, device=device)
        if "flashinfer" in methods:
            from dispatcher.flashinfer_a2a import FlashInferDispatcher

            ours["flashinfer"] = FlashInferDispatcher(cfg, ep, device=device)
        raw = _make_raw(ep, max_tokens, args.top_k, args.experts, hidden) if "raw" in methods else None
        for d in ours.values():
            d.warmup()
        if ep.rank == 0:
            print(f"[hidden {hidden}] built {sorted(ours) + (['raw'] if raw else [])} in "
                  f"{time.monotonic() - t0:.1f} s", flush=True)
        for tokens in tokens_list:
            x, ids, w = _inputs(tokens, hidden, args.experts, args.top_k, device, seed=tokens + ep.rank)
            plan = FixedPlan.uniform(ep.size, tokens)
            row = {"hidden": hidden, "tokens_per_rank": tokens,
                   "ws_bytes_per_rank": flashinfer_workspace_bytes_per_rank(ep.size, tokens, hidden, args.top_k,
                                                                            torch.bfloat16)}
            rounds = {name: _ours_round(d, x, ids, w, plan) for name, d in ours.items()}
            if raw is not None:
                rounds["raw"] = _raw_round(raw, x, ids, w, tokens)
            for name, fn in rounds.items():
                row[name] = _time_rounds(ep, device, fn, args.iters, args.warmup)
            if on_gpu and not args.no_graph:
                # The same rounds captured in CUDA graphs: device time with the host's launch cost
                # taken out, which is what a captured decode step pays.
                for name in ("flashinfer", "raw"):
                    if name in rounds:
                        graph = _capture(rounds[name], ep)
                        row[f"{name}_graph"] = _time_rounds(ep, device, graph.replay, args.iters, args.warmup)
                        del graph
            rows.append(row)
            if ep.rank == 0:
                print("  " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
        for d in ours.values():
            d.close()
        del raw
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=ep.cpu_group)
    if ep.rank == 0:
        _print_table(rows, methods, ep, device, notes, time.monotonic() - started, args)
        if args.json:
            args.json.write_text(json.dumps({"ep_size": ep.size, "device": _device_name(device), "commit": _commit(),
                                             "rows": rows}, indent=1))
    dist.destroy_process_group()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _print_table(rows, methods, ep, device, notes, seconds, args) -> None:
    cols = [m for m in ("all_gather", "all_to_all", "flashinfer", "raw") if m in methods]
    print()
    print(f"# dispatch + combine round, median us (slowest rank); ep_size={ep.size}, {_device_name(device)}, "
          f"top-{args.top_k} of {args.experts} experts, bf16, commit {_commit()}, "
          f"{datetime.date.today().isoformat()}, sweep {seconds:.0f} s")
    for note in notes:
        print(f"# {note}")
    head = ["hidden", "tok/rank", "ws_B/rank", *cols]
    if "flashinfer" in cols and "raw" in cols:
        head.append("fi/raw")
    if "flashinfer" in cols and "all_to_all" in cols:
        head.append("a2a/fi")
    graphs = [c for c in ("flashinfer_graph", "raw_graph") if rows and c in rows[0]]
    head += graphs
    if len(graphs) == 2:
        head.append("fi/raw graph")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for r in rows:
        cells = [str(r["hidden"]), str(r["tokens_per_rank"]), str(r["ws_bytes_per_rank"])]
        cells += [f"{r[c]:.1f}" for c in cols]
        if "fi/raw" in head:
            cells.append(f"{r['flashinfer'] / r['raw']:.2f}")
        if "a2a/fi" in head:
            cells.append(f"{r['all_to_all'] / r['flashinfer']:.2f}")
        cells += [f"{r[c]:.1f}" for c in graphs]
        if len(graphs) == 2:
            cells.append(f"{r['flashinfer_graph'] / r['raw_graph']:.2f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
