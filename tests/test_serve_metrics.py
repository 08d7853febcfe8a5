"""The server's Prometheus registry: per-rank series read at scrape time, request histograms."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from dp_runtime.serving.request import RequestResult
from launch.server.metrics import ServerMetrics


@dataclass
class _Snapshot:
    """What engine.stats()/health() return, held fixed: the collector only reads them."""

    ranks: tuple
    restarts: int = 0
    queued: int = 0
    ok: bool = True
    state: str = "ready"

    def stats(self):
        return self

    def health(self):
        return self


def _rank(rank, **kw):
    base = dict(
        rank=rank,
        running=0,
        waiting=0,
        kv_slots=100,
        free_kv_slots=100,
        outstanding_tokens=0,
        routed_requests=0,
        prefill_tokens=0,
        in_flight=0,
        generated_tokens=0,
        steps=0,
    )
    return {**base, **kw}


def _samples(metrics):
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_rank_series_are_read_at_scrape_time_with_a_rank_label():
    engine = _Snapshot(
        (_rank(0, running=3, free_kv_slots=75, routed_requests=4, dp_balance=0.5, dp_sync_wait_s=1.5),
         _rank(1, generated_tokens=9)),
        restarts=1,
        queued=2,
    )
    m = ServerMetrics(engine)
    s = _samples(m)
    assert s[("dp_runtime_running_requests", (("rank", "0"),))] == 3
    assert s[("dp_runtime_kv_cache_usage_ratio", (("rank", "0"),))] == 0.25
    assert s[("dp_runtime_requests_routed_total", (("rank", "0"),))] == 4
    assert s[("dp_runtime_generation_tokens_total", (("rank", "1"),))] == 9
    assert s[("dp_runtime_dp_balance_ratio", (("rank", "0"),))] == 0.5
    assert s[("dp_runtime_dp_sync_wait_seconds_total", (("rank", "0"),))] == 1.5
    assert s[("dp_runtime_restarts_total", ())] == 1
    assert s[("dp_runtime_engine_queued_requests", ())] == 2
    assert s[("dp_runtime_engine_healthy", ())] == 1
    engine.ranks = (_rank(0, running=0, free_kv_slots=100), _rank(1))
    assert _samples(m)[("dp_runtime_kv_cache_usage_ratio", (("rank", "0"),))] == 0.0


def test_finished_requests_fill_the_histograms():
    m = ServerMetrics(_Snapshot((_rank(0), _rank(1))))
    r = RequestResult(
        rid="a",
        prompt_len=4,
        output_ids=(1, 2, 3),
        finish_reason="length",
        rank=1,
        queued_s=0.0,
        ttft_s=0.01,
        latency_s=0.05,
        decode_steps=2,
        token_times_s=(0.01, 0.03, 0.05),
    )
    m.observe(r)
    m.observe(r, "stop")
    s = _samples(m)
    assert s[("dp_runtime_time_to_first_token_seconds_count", (("rank", "1"),))] == 2
    assert s[("dp_runtime_inter_token_latency_seconds_count", (("rank", "1"),))] == 4
    assert abs(s[("dp_runtime_e2e_request_latency_seconds_sum", (("rank", "1"),))] - 0.1) < 1e-9
    assert (
        s[("dp_runtime_requests_finished_total", (("finish_reason", "length"), ("rank", "1")))] == 1
    )
    assert (
        s[("dp_runtime_requests_finished_total", (("finish_reason", "stop"), ("rank", "1")))] == 1
    )


def test_two_servers_do_not_share_series():
    a, b = ServerMetrics(_Snapshot((_rank(0),))), ServerMetrics(_Snapshot((_rank(0),)))
    r = RequestResult(
        rid="a",
        prompt_len=1,
        output_ids=(1,),
        finish_reason="length",
        rank=0,
        queued_s=0.0,
        ttft_s=0.01,
        latency_s=0.01,
        decode_steps=0,
        token_times_s=(0.01,),
    )
    a.observe(r)
    assert _samples(a)[("dp_runtime_time_to_first_token_seconds_count", (("rank", "0"),))] == 1
    assert ("dp_runtime_time_to_first_token_seconds_count", (("rank", "0"),)) not in _samples(b)
