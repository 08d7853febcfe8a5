"""The table bench/serve_load.py prints without ``--json`` (its docstring says what the columns
mean)."""

from __future__ import annotations

from typing import Any

from bench.load_summary import STEP_KINDS

__all__ = ["print_table"]


def print_table(report: dict[str, Any]) -> None:
    h = report["header"]
    layers = f" ({h['layers']} layers)" if h["layers"] else ""
    kv = h.get("kv_cache_dtype")
    dtype = h["dtype"] + (f", KV {kv}" if kv and kv != h["dtype"] else "")
    print(f"date {h['date']}  {h['device']} x{h['world_size']} ({h['launcher']})  commit {h['commit']}\n"
          f"command: {h['command']}\nmodel {h['model']}{layers} {dtype}, "
          f"dispatcher {h['dispatcher']}, attention {h['attention']}, graphs {h['graphs']}; lengths {h['lengths']}; "
          f"{_batches(h)}; max running {h['max_running_requests']}, "
          f"prefill chunk {h['chunked_prefill_size']}; build {h['build_s']:.0f} s")
    print(f"{'mixed':>5} {'policy':>6} {'cache':>5} {'rate':>6} {'done':>5} {'req/s':>7} {'out tok/s':>10} "
          f"{'/GPU':>8} {'TTFT p50':>9} "
          f"{'p99':>7} {'ITL p50':>8} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'E2E p50':>8} {'p99':>7} "
          f"{'max run':>8} {'steps d/e/m':>16} {'bound':>8} {'eff':>5} {'occ':>5} {'ideal':>5} {'cached':>6} "
          f"{'DP bal':>6}")
    for r in report["rows"]:
        def p(key: str, q: str, r: dict[str, Any] = r) -> str:
            v = r[key][q]
            return f"{'-':>7}" if v is None else f"{v * 1e3:>7.1f}"

        def pct(v: float | None) -> str:
            return f"{100 * v:>4.0f}%" if v else f"{'-':>5}"

        rate = _rate(r)
        steps = "/".join(str(r["steps"][k]) for k in STEP_KINDS)
        bound = f"{r['decode_bound_tok_s']:>8.1f}" if r["decode_bound_tok_s"] else f"{'-':>8}"
        cache = "on" if r.get("prefix_caching") else "off"
        cached = r.get("cached_tokens", 0) / r["prompt_tokens"] if r.get("prompt_tokens") else 0
        print(f"{'on' if r['mixed'] else 'off':>5} {r['policy']:>6} {cache:>5} {rate:>6} {r['completed']:>5} "
              f"{r['request_throughput'] or 0:>7.2f} {r['output_tok_s'] or 0:>10.1f} "
              f"{(r['output_tok_s'] or 0) / h['world_size']:>8.1f}  {p('ttft_s', 'p50')} "
              f"{p('ttft_s', 'p99')}  {p('itl_s', 'p50')} {p('itl_s', 'p99')}  {p('tpot_s', 'p50')} "
              f"{p('tpot_s', 'p99')}  {p('e2e_s', 'p50')} {p('e2e_s', 'p99')} {max(r['max_running']):>8} "
              f"{steps:>16} {bound} {pct(r['efficiency'])} {pct(r['occupancy'])} {pct(r['ideal_occupancy'])} {pct(cached):>6} "
              f"{pct(r.get('dp_balance')):>6}")
    print("times in ms; rate cN: --concurrency N (N requests a rank at once); /GPU: out tok/s per GPU; "
          "max run: the most requests running at once on one rank; steps: decode/extend/mixed "
          "(all ranks); bound: decode-only out tok/s at max run (decode probe); eff: out tok/s / bound; "
          "occ: output tokens / (steps x max run); ideal: the occupancy of an ideal rank (load_summary); "
          "cache: prefix caching; cached: prompt tokens served from the prefix cache; DP bal: mean over max "
          "tokens a rank per step, over the run's steps (dp_balance; dp_sync_wait_s in --json)")
    for r in report["rows"]:
        g = r.get("gpu")
        if not g:
            continue
        rate = _rate(r)
        spans = ", ".join(f"{k} {v['n']} x {v['mean_ms']:.2f} ms" for k, v in g["steps"].items())
        eff = f"; the run's decode steps' bound {g['decode_bound_tok_s']:.1f} tok/s, eff {100 * g['efficiency']:.1f}%" \
            if g.get("efficiency") else ""
        print(f"gpu (mixed {'on' if r['mixed'] else 'off'}, {r['policy']}, rate {rate}): busy {100 * g['busy']:.2f}%, "
              f"idle {g['idle_s']:.3f} s (gaps p50 {g['gap_p50_ms']:.3f} ms, max {g['gap_max_ms']:.2f}); {spans}{eff}")


def _rate(row: dict[str, Any]) -> str:
    if row.get("concurrency"):
        return f"c{row['concurrency']}"
    return "inf" if row["rate"] is None else f"{row['rate']:g}"


def _batches(h: dict[str, Any]) -> str:
    if h.get("concurrency"):
        return f"concurrency {h['concurrency']} a rank, each one wave all at once"
    return f"{h['arrival']} arrivals, {h['num_requests']} requests per rate"
