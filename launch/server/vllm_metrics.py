"""vLLM's metric families (``vllm:``), beside the ``dp_runtime_*`` ones, so dashboards built for
vLLM read this server too. Labels as vLLM's: ``model_name`` (the served model) and ``engine``
(vLLM's data-parallel engine index: here the DP rank).

Read from ``engine.stats()`` at scrape time: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:prompt_tokens_total`` and
``vllm:generation_tokens_total``, ``vllm:prefix_cache_queries_total`` (prompt tokens looked up in
the prefix cache: prefilled plus served from it) and ``vllm:prefix_cache_hits_total`` (served
from it), ``vllm:num_preemptions_total`` (always 0: a rank admits a request only with KV for its
whole context, so it never preempts one).

Observed as each engine request finishes (the rank's own times): ``vllm:request_success_total
{finished_reason}``, the histograms ``vllm:request_prompt_tokens``,
``vllm:request_generation_tokens``, ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds`` (arrival to admission), ``vllm:request_prefill_time_seconds``
(admission to the first token), ``vllm:request_decode_time_seconds`` (first to last token),
``vllm:request_inference_time_seconds`` (admission to the last token); as each is submitted:
``vllm:request_params_n`` and ``vllm:request_params_max_tokens``.

Kept by each rank (the server sees requests, not steps) and read from ``engine.stats()`` too:
``vllm:iteration_tokens_total``, the histogram of tokens per step (prompt tokens prefilled plus
decode rows; vLLM's buckets), the rank's ``tokens_per_step`` (dp_runtime/step_token_histogram.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["VllmMetrics"]

_LABELS = ["model_name", "engine"]
_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
_N_BUCKETS = (1, 2, 5, 10, 20)


class _Scraped(Collector):
    """The ``engine.stats()`` series (module docstring)."""

    def __init__(self, engine: Any):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats, model = self._engine.stats(), getattr(self._engine, "model_name", "")
        gauge = lambda n, d: GaugeMetricFamily("vllm:" + n, d, labels=_LABELS)  # noqa: E731
        count = lambda n, d: CounterMetricFamily("vllm:" + n, d, labels=_LABELS)  # noqa: E731
        fams = {
            "running": gauge("num_requests_running", "Requests in the running batch."),
            "waiting": gauge("num_requests_waiting", "Requests waiting to be admitted."),
            "usage": gauge("kv_cache_usage_perc", "KV cache usage (1 means 100 percent)."),
            "prefill_tokens": count("prompt_tokens", "Prompt tokens prefilled."),
            "generated_tokens": count("generation_tokens", "Generation tokens."),
            "queries": count("prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache."),
            "prefix_hit_tokens": count("prefix_cache_hits",
                                       "Prompt tokens found in the prefix cache."),
            "preemptions": count("num_preemptions", "Preemptions (none: KV is reserved whole)."),
            "tokens_per_step": HistogramMetricFamily(
                "vllm:iteration_tokens_total",
                "Tokens per engine step (prompt tokens prefilled plus decode rows).",
                labels=_LABELS),
        }
        for r in stats.ranks:
            labels = [model, str(r["rank"])]
            for key in ("running", "waiting", "prefill_tokens", "generated_tokens",
                        "prefix_hit_tokens"):
                if key in r:
                    fams[key].add_metric(labels, float(r[key]))
            if r.get("kv_slots"):
                fams["usage"].add_metric(labels, 1.0 - r["free_kv_slots"] / r["kv_slots"])
            queries = r.get("prefill_tokens", 0) + r.get("prefix_hit_tokens", 0)
            fams["queries"].add_metric(labels, float(queries))
            fams["preemptions"].add_metric(labels, 0.0)
            if (h := r.get("tokens_per_step")) is not None:
                les = [floatToGoString(le) for le in (*h["le"], math.inf)]
                fams["tokens_per_step"].add_metric(
                    labels, list(zip(les, map(float, h["buckets"]), strict=True)),
                    sum_value=float(h["sum"]))
        yield from fams.values()


class VllmMetrics:
    """The ``vllm:`` families on ``registry`` (module docstring)."""

    def __init__(self, registry: CollectorRegistry, engine: Any):
        self._model = getattr(engine, "model_name", "")  # a bare stats source has none
        registry.register(_Scraped(engine))

        def hist(name: str, doc: str, buckets: tuple, labels: list[str] = _LABELS) -> Histogram:
            return Histogram("vllm:" + name, doc, labels, buckets=buckets, registry=registry)

        self.success = Counter("vllm:request_success", "Requests finished, by reason.",
                               [*_LABELS, "finished_reason"], registry=registry)
        self.prompt = hist("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.generation = hist("request_generation_tokens", "Generation tokens per request.",
                               _TOKEN_BUCKETS)
        self.n = hist("request_params_n", "The n of each request.", _N_BUCKETS, ["model_name"])
        self.max_tokens = hist("request_params_max_tokens", "The max_tokens of each request.",
                               _TOKEN_BUCKETS, ["model_name"])
        self.times = {
            name: hist(name, doc, _TIME_BUCKETS) for name, doc in (
                ("time_to_first_token_seconds", "Arrival to the first token."),
                ("inter_token_latency_seconds", "Between consecutive tokens."),
                ("e2e_request_latency_seconds", "Arrival to the last token."),
                ("request_queue_time_seconds", "Arrival to admission."),
                ("request_prefill_time_seconds", "Admission to the first token."),
                ("request_decode_time_seconds", "First to last token."),
                ("request_inference_time_seconds", "Admission to the last token."),
            )
        }

    def observe_params(self, n: int, max_tokens: int) -> None:
        """One submitted prompt's ``n`` and ``max_tokens``."""
        self.n.labels(self._model).observe(n)
        self.max_tokens.labels(self._model).observe(max_tokens)

    def observe(self, result: Any, finish_reason: str) -> None:
        """One finished engine request (a RequestResult)."""
        labels = (self._model, str(result.rank))
        self.success.labels(*labels, finish_reason).inc()
        self.prompt.labels(*labels).observe(result.prompt_len)
        self.generation.labels(*labels).observe(len(result.output_ids))
        times = list(result.token_times_s or ())
        if not times:
            return
        t = self.times
        t["time_to_first_token_seconds"].labels(*labels).observe(result.ttft_s)
        t["e2e_request_latency_seconds"].labels(*labels).observe(result.latency_s)
        t["request_queue_time_seconds"].labels(*labels).observe(result.queued_s)
        t["request_prefill_time_seconds"].labels(*labels).observe(result.ttft_s - result.queued_s)
        t["request_decode_time_seconds"].labels(*labels).observe(result.latency_s - result.ttft_s)
        t["request_inference_time_seconds"].labels(*labels).observe(
            result.latency_s - result.queued_s)
        itl = t["inter_token_latency_seconds"].labels(*labels)
        for a, b in itertools.pairwise(times):
            itl.observe(b - a)
