"""Serving under load through the HTTP endpoint, side by side with the in-process engine.

    python bench/serve_http.py --device cpu --model tiny --num-requests 16 \
        --lengths random:32:16 --rates 4,inf
    python bench/serve_http.py --model qwen3-30b-a3b --device cuda --max-running-requests 64 \
        --rates 4,16,inf

The workload is ``bench/serve_load.py``'s (``--lengths``, ``--rates``, ``--arrival``,
``--num-requests``, ``--seed``, ``--shared-prefix-len``, ``--prefix-groups``: the same
requests), and so are the
columns. Prefix caching is on (the default); at ``--dp 2`` the engine's routing is then
cache-aware (launch/prefix_routing.py): with a shared prefix, run it beside an earlier tree. The paths
(``--paths``) run one after the other on the same machine (the server first: its process gives
its GPU memory back when it exits):

- ``rank`` (the in-process run, default): serve_load.py's: the Engine gets every request at
  once, each with its arrival time, and the ranks' step loop times each one from its arrival;
- ``engine``: the Engine in this process, each request submitted at its arrival time and read
  with ``Engine.stream`` by an asyncio client in the same process (its client and the ranks share
  one interpreter: on an H100 its TTFT at rate 16 was seconds, not milliseconds);
- ``http``: ``python -m launch serve`` in a subprocess with the same options; each request is a
  streaming ``POST /v1/completions`` (token-id prompt, greedy, ``ignore_eos``, ``max_tokens`` its
  output length, ``return_token_ids``) sent at its arrival time by an aiohttp client, tokens
  counted from each chunk's ``token_ids``. Its rows also give the server's own counts over the rate, read from
  ``/metrics`` before and after it: ``server_prefilled_tokens`` (prompt tokens the ranks
  prefilled), ``server_cached_tokens`` (served from their prefix caches) and
  ``server_prefilled_by_rank`` (how routing spread the prefill work).

For http and engine, TTFT and E2E run from the request's send to its first / last token as the
client sees it; ITL is the gap between consecutive token arrivals. The last table lines compare
HTTP with the in-process paths: its output tok/s as a share of theirs, and the TTFT p50 overhead
in ms (what the server, the network stack and the client add).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.load_workload import Lengths, make_requests, warmup_requests
from bench.serve_load import _commit, _model_config, summarize_rate
from dp_runtime.serving.request import Request, RequestResult
from launch.cli_errors import UsageError, bench_main

PATHS = ("rank", "engine", "http")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="tiny", help="preset (tiny, qwen3-30b-a3b) or a checkpoint directory"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--launcher", default="local", choices=("local", "ray"))
    p.add_argument("--dp", type=int, default=1)
    p.add_argument(
        "--rates", default="4,16,inf", help="requests/s, comma-separated; inf: all at once"
    )
    p.add_argument("--arrival", default="poisson", choices=("poisson", "fixed"))
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--lengths", default="sharegpt", help="sharegpt | random:IN:OUT[:RATIO]")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="every prompt starts with the same this many tokens (as serve_load's)")
    p.add_argument("--prefix-groups", type=int, default=1,
                   help="--shared-prefix-len's prefixes: each prompt starts with one of this many, drawn")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--paths", default="rank,http",
                   help="rank, engine and/or http (comma-separated; module docstring)")
    p.add_argument("--policy", default="fcfs", choices=("fcfs", "lof"),
                   help="admission order (serve's --schedule-policy, serve_load's --policy)")
    p.add_argument("--dispatcher", default="auto", help="auto | all_gather | all_to_all | flashinfer (DP > 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    try:
        args.rates = [float(x) for x in args.rates.split(",")]
        args.lengths = Lengths.parse(args.lengths)
    except ValueError as e:
        raise UsageError(f"--rates/--lengths: {e}") from e
    args.paths = [x for x in args.paths.split(",") if x]
    if not args.paths or any(x not in PATHS for x in args.paths):
        raise UsageError(f"--paths must name some of {', '.join(PATHS)}, got {','.join(args.paths)!r}")
    if args.launcher == "local" and args.dp != 1:
        raise UsageError(f"--launcher local runs one rank; got --dp {args.dp}")
    if args.shared_prefix_len < 0:
        raise UsageError(f"--shared-prefix-len must be >= 0, got {args.shared_prefix_len}")
    if args.prefix_groups < 1:
        raise UsageError(f"--prefix-groups must be >= 1, got {args.prefix_groups}")
    return args


def _result(
    req: Request, sent: float, times: list[float], ids: list[int], rank: int, error: str | None
) -> RequestResult:
    """The client's view of one request as a RequestResult (times from its send)."""
    rel = tuple(t - sent for t in times)
    return RequestResult(
        rid=req.rid,
        prompt_len=len(req.prompt_ids),
        output_ids=tuple(ids),
        finish_reason="error" if error else "length",
        rank=rank,
        queued_s=0.0,
        ttft_s=rel[0] if rel else 0.0,
        latency_s=rel[-1] if rel else 0.0,
        decode_steps=max(0, len(ids) - 1),
        error=error,
        token_times_s=rel,
    )


async def _paced(reqs: list[Request], one) -> list[RequestResult]:
    """Run ``one(req)`` for each request at its arrival time; results in order."""
    t0 = time.perf_counter()

    async def at(req: Request) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
        return await one(req)

    return list(await asyncio.gather(*(at(r) for r in reqs)))


def _spec(args, context_len: int):
    from dp_runtime.rank_spec import RankSpec
    from launch.process_group import resolve_device

    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return RankSpec.create(
        args.model,
        dp_size=args.dp,
        device=device,
        dtype=dtype,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_context_len=context_len,
        seed=args.seed,
        schedule_policy=args.policy,
        dispatcher=args.dispatcher,
    )


# A path's results per rate, and per rate what it adds to its row (the http path's server counts).
Runs = tuple[list[list[RequestResult]], list[dict[str, Any]]]


def run_engine(args, batches, warm, context_len: int) -> Runs:
    from launch.engine import Engine, EngineOptions

    engine = Engine(
        _spec(args, context_len), EngineOptions(launcher=args.launcher, max_queued=1 << 20)
    ).start()

    async def one(req: Request) -> RequestResult:
        sent, times, ids, error = time.perf_counter(), [], [], None
        async for out in engine.stream(req):
            now = time.perf_counter()
            times += [now] * len(out.new_token_ids)
            ids += out.new_token_ids
            if out.finished and out.result.error:
                error = out.result.error
        return _result(req, sent, times, ids, 0, error)

    try:
        asyncio.run(_paced(warm, one))
        return [asyncio.run(_paced(reqs, one)) for _, reqs in batches], [{} for _ in batches]
    finally:
        engine.shutdown()


def run_ranks(args, batches, warm, context_len: int) -> Runs:
    """serve_load's run: the Engine gets the requests with their arrival times, and the ranks'
    step loop times them (no client, no asyncio beside the ranks; bench/load_ranks.py)."""
    from bench.load_ranks import EngineRanks

    ranks = EngineRanks(_spec(args, context_len), args.launcher, False)
    try:
        if warm:
            ranks.run(warm)
        return [ranks.run(reqs) for _, reqs in batches], [{} for _ in batches]
    finally:
        ranks.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_http(args, batches, warm, context_len: int) -> Runs:
    import aiohttp

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "launch",
        "serve",
        "--model",
        args.model,
        "--launcher",
        args.launcher,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--port",
        str(port),
        "--context-len",
        str(context_len),
        "--max-running-requests",
        str(args.max_running_requests),
        "--max-queued",
        str(1 << 20),
        "--chunked-prefill-size",
        str(args.chunked_prefill_size),
        "--seed",
        str(args.seed),
        "--schedule-policy",
        args.policy,
        "--dispatcher",
        args.dispatcher,
    ]
    if args.launcher == "ray":
        cmd += ["--dp", str(args.dp)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)  # keep what the caller had
    # Its own process group: what it starts (a local Ray cluster's processes) goes with it.
    server = subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONPATH": path}, start_new_session=True)
    try:
        name = _wait_up(url, server)

        async def all_batches() -> Runs:
            # A connection per request (force_close): a pooled connection that a server (an
            # earlier tree's, at uvicorn's 5 s keep-alive) closes as a request goes out on it
            # fails that request with "Server disconnected" and with it the run.
            limits = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(
                connector=limits, timeout=aiohttp.ClientTimeout(total=None)
            ) as http:

                async def one(req: Request) -> RequestResult:
                    body = {
                        "model": name,
                        "prompt": list(req.prompt_ids),
                        "max_tokens": req.sampling.max_new_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        # a server with a tokenizer sends each chunk's ids only when asked
                        "return_token_ids": True,
                        "stream": True,
                    }
                    sent, times, ids, error = time.perf_counter(), [], [], None
                    async with http.post(url + "/v1/completions", json=body) as resp:
                        if resp.status != 200:
                            return _result(
                                req, sent, [], [], 0, f"HTTP {resp.status}: {await resp.text()}"
                            )
                        async for line in resp.content:
                            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                                continue
                            now = time.perf_counter()
                            new = json.loads(line[6:])["choices"][0].get("token_ids") or []
                            times += [now] * len(new)
                            ids += new
                    return _result(req, sent, times, ids, 0, error)

                await _paced(warm, one)
                out, counts, before = [], [], await _server_counts(http, url)
                for _, reqs in batches:
                    out.append(await _paced(reqs, one))
                    after = await _server_counts(http, url)
                    counts.append(_counts_row(before, after))
                    before = after
                return out, counts

        return asyncio.run(all_batches())
    finally:  # a run being stopped (SIGTERM, Ctrl-C) has seconds: timeout -k kills it 10 s later
        _stop(server, 8 if sys.exc_info()[0] in (SystemExit, KeyboardInterrupt) else 120)


# The per-rank counters of the server's /metrics the http rows report (launch/server/metrics.py).
_COUNTERS = {
    "dp_runtime_prompt_tokens_total": "prefilled",
    "dp_runtime_prefix_cache_hit_tokens_total": "cached",
}


async def _server_counts(http, url: str) -> dict[str, dict[str, float]]:
    """The server's per-rank prefill and prefix-cache counters now: {"prefilled": {rank: n},
    "cached": {rank: n}}."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, dict[str, float]] = {"prefilled": {}, "cached": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _COUNTERS:
                out[_COUNTERS[sample.name]][sample.labels["rank"]] = sample.value
    return out


def _counts_row(before: dict, after: dict) -> dict[str, Any]:
    """The server counts of one rate: what ``after`` adds to ``before``."""
    delta = {k: {r: int(v - before[k].get(r, 0)) for r, v in after[k].items()} for k in after}
    ranks = sorted(delta["prefilled"], key=int)
    return dict(
        server_prefilled_tokens=sum(delta["prefilled"].values()),
        server_cached_tokens=sum(delta["cached"].values()),
        server_prefilled_by_rank=[delta["prefilled"][r] for r in ranks],
    )


def _stop(server: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM: the server drains and stops its ranks (and a Ray cluster it started). Within
    ``wait_s``, else SIGKILL to its whole process group, so no server or Ray process outlives
    the run."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _wait_up(url: str, server: subprocess.Popen) -> str:
    """The served model's name once /health is 200."""
    while server.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    with urllib.request.urlopen(url + "/v1/models", timeout=5) as m:
                        return json.loads(m.read())["data"][0]["id"]
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"serve exited with {server.returncode} before it was up")


def run(args: argparse.Namespace) -> dict[str, Any]:
    vocab = _model_config(args.model).vocab_size
    batches = [
        (
            rate,
            make_requests(
                args.num_requests, rate, args.lengths, args.arrival, vocab, args.seed, f"q{i}",
                shared_prefix_len=args.shared_prefix_len, prefix_groups=args.prefix_groups,
            ),
        )
        for i, rate in enumerate(args.rates)
    ]
    warm = warmup_requests(
        args.warmup,
        args.lengths,
        args.arrival,
        vocab,
        args.seed,
        chunk=args.chunked_prefill_size,
        max_prompt=_model_config(args.model).max_positions - 1,
        world=args.dp,
    )
    every = [r for _, b in batches for r in b] + warm
    context_len = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in every)
    rows = []
    # The server process first: it gives its GPU memory back when it exits, where the in-process
    # engine's stays cached in this process (the server after it ran out of memory on an H100).
    runs = {"rank": run_ranks, "engine": run_engine, "http": run_http}
    for path in sorted(args.paths, key=lambda p: p != "http"):
        results, extra = runs[path](args, batches, warm, context_len)
        gc.collect()  # the in-process ranks' memory goes before the next path's are built
        for (rate, reqs), res, more in zip(batches, results, extra, strict=True):
            # The client cannot tell which rank served a request: http/engine rows are one "rank".
            world = args.dp if path == "rank" else 1
            rows.append({"path": path, **summarize_rate(rate, reqs, res, world), **more})
    header = dict(
        commit=_commit(),
        command=" ".join(sys.argv),
        model=args.model,
        device=args.device,
        launcher=args.launcher,
        dp=args.dp,
        max_running_requests=args.max_running_requests,
        policy=args.policy,
        dispatcher=args.dispatcher,
        num_requests=args.num_requests,
        arrival=args.arrival,
    )
    return dict(header=header, rows=rows)


def print_table(report: dict[str, Any]) -> None:
    h = report["header"]
    print(
        f"commit {h['commit']}  model {h['model']} ({h['device']}, {h['launcher']} x{h['dp']}); "
        f"max running {h['max_running_requests']}, {h['policy']}, dispatcher {h['dispatcher']}; "
        f"{h['num_requests']} requests per rate, {h['arrival']} arrivals"
    )
    print(
        f"{'path':>7} {'rate':>6} {'done':>5} {'req/s':>7} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'TPOT p50':>9} {'p99':>7} "
        f"{'E2E p50':>8} {'p99':>7}"
    )
    for r in report["rows"]:

        def p(key: str, q: str, r: dict[str, Any] = r) -> str:
            v = r[key][q]
            return f"{'-':>7}" if v is None else f"{v * 1e3:>7.1f}"

        rate = "inf" if r["rate"] is None else f"{r['rate']:g}"
        print(
            f"{r['path']:>7} {rate:>6} {r['completed']:>5} {r['request_throughput'] or 0:>7.2f} "
            f"{r['output_tok_s'] or 0:>10.1f}  {p('ttft_s', 'p50')} {p('ttft_s', 'p99')}  "
            f"{p('itl_s', 'p50')} {p('itl_s', 'p99')}  {p('tpot_s', 'p50')} {p('tpot_s', 'p99')}  "
            f"{p('e2e_s', 'p50')} {p('e2e_s', 'p99')}"
        )
    by = {(r["path"], r["rate"]): r for r in report["rows"]}
    for (path, rate), r in by.items():
        for against in ("rank", "engine"):
            base = by.get((against, rate))
            if path == "http" and base and base["output_tok_s"] and r["ttft_s"]["p50"] is not None:
                share = r["output_tok_s"] / base["output_tok_s"]
                overhead = (r["ttft_s"]["p50"] - base["ttft_s"]["p50"]) * 1e3
                label = "inf" if rate is None else f"{rate:g}"
                print(f"rate {label}: http out tok/s = {share:.1%} of {against}; "
                      f"TTFT p50 overhead {overhead:+.1f} ms")
    print("times in ms: http and engine at the client from each request's send, rank at the rank "
          "from each request's arrival")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, print_table)


if __name__ == "__main__":
    # A run stopped by `timeout` (SIGTERM) unwinds like Ctrl-C, so its server is stopped too
    # (Python's default SIGTERM ends the process with no `finally`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main())
