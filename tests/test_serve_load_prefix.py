"""bench/serve_load.py with prefix caching: ``--shared-prefix-len`` starts every prompt with
the same tokens, ``--prefix-caching both`` serves the same workload without and with the cache
and reports the prompt tokens it served; a bad value is a one-line usage error."""

from __future__ import annotations

import json

from tests.support.bench_scripts import load_bench


def test_prefix_caching_both_serves_a_shared_prefix_workload_side_by_side(capsys):
    bench = load_bench("serve_load")
    code = bench.main(["--device", "cpu", "--model", "tiny", "--num-requests", "6", "--rates", "inf",
                       "--lengths", "random:6:4", "--shared-prefix-len", "40", "--max-running-requests", "2",
                       "--chunked-prefill-size", "32", "--warmup", "0", "--probe-tokens", "0",
                       "--prefix-caching", "both", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    assert report["header"]["prefix_caching"] == [False, True] and report["header"]["shared_prefix_len"] == 40
    off, on = report["rows"]
    for row in (off, on):
        assert row["completed"] == 6 and row["output_tokens"] == 24 and row["prompt_tokens"] == 6 * 46
    assert (off["prefix_caching"], off["cached_tokens"]) == (False, 0)
    # Two run at a time: the first two prefill the prefix, each later one reuses it at least.
    assert on["prefix_caching"] and on["cached_tokens"] >= 4 * 40


def test_a_negative_shared_prefix_is_a_usage_error(capsys):
    bench = load_bench("serve_load")
    assert bench.main(["--device", "cpu", "--shared-prefix-len", "-1"]) == 2
    assert "--shared-prefix-len must be >= 0" in capsys.readouterr().err


def test_prefix_groups_start_each_prompt_with_one_of_that_many_prefixes():
    from bench.load_workload import Lengths, make_requests

    reqs = make_requests(64, float("inf"), Lengths.parse("random:5:2"), "poisson", 1000, 0, "g",
                         shared_prefix_len=12, prefix_groups=4)
    heads = {tuple(r.prompt_ids[:12]) for r in reqs}
    assert len(heads) == 4  # 64 draws from 4 groups: every group drawn
    assert all(len(r.prompt_ids) == 17 for r in reqs)
    one = make_requests(8, float("inf"), Lengths.parse("random:5:2"), "poisson", 1000, 0, "g",
                        shared_prefix_len=12)
    assert {tuple(r.prompt_ids[:12]) for r in one} <= heads  # group 0 is the single prefix


def test_a_zero_prefix_groups_is_a_usage_error(capsys):
    bench = load_bench("serve_load")
    assert bench.main(["--device", "cpu", "--prefix-groups", "0"]) == 2
    assert "--prefix-groups must be >= 1" in capsys.readouterr().err
