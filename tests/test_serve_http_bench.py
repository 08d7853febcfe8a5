"""bench/serve_http.py's http path on the CPU: a real `dp-runtime serve` process (local launcher,
tiny preset) and the bench's aiohttp client. Every request completes, and the row carries the
server's own counts from /metrics: the prompt tokens its rank prefilled plus those its prefix
cache served add up to every prompt token sent, and prompts sharing a prefix hit the cache."""

from __future__ import annotations

import json

from tests.support.bench_scripts import load_bench


def test_http_rows_carry_the_servers_prefill_and_prefix_cache_counts(capsys):
    bench = load_bench("serve_http")
    code = bench.main(["--device", "cpu", "--model", "tiny", "--paths", "http", "--rates", "inf",
                       "--num-requests", "6", "--lengths", "random:8:4", "--shared-prefix-len", "40",
                       "--max-running-requests", "1", "--warmup", "0", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    (row,) = json.loads(out)["rows"]
    assert row["path"] == "http" and row["completed"] == 6 and row["errors"] == 0
    sent = row["input_tokens"]
    assert sent == 6 * 48
    # one rank: its prefill and its cache hits are every prompt token; one request at a time, so
    # each prompt after the first finds the shared prefix cached
    assert row["server_prefilled_by_rank"] == [row["server_prefilled_tokens"]]
    assert row["server_prefilled_tokens"] + row["server_cached_tokens"] == sent
    assert row["server_cached_tokens"] >= 5 * 32
