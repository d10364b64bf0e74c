"""``GET /metrics``: the server's Prometheus metrics, in a registry of its own.

==============================================  =========  =================================
metric                                          kind       from
==============================================  =========  =================================
mpexec_num_requests_running / _waiting          gauge      the scheduler's queues
mpexec_kv_cache_usage_ratio                     gauge      KV blocks in use / all blocks
mpexec_prompt_tokens_total                      counter    prompts queued
mpexec_generation_tokens_total                  counter    tokens sampled
mpexec_requests_total{finish_reason}            counter    requests the server answered
mpexec_time_to_first_token_seconds              histogram  arrival to first token, per
                                                           request, seen by the server
mpexec_inter_token_latency_seconds              histogram  between a request's tokens
mpexec_executor_call_latency_seconds            gauge      ``executor.stats()`` p50/p90/p99
  {method, quantile}                                       and max of each method
mpexec_executor_calls_total{method}             counter    calls made, per method
mpexec_engine_steps_total                       counter    engine steps
mpexec_engine_step_seconds_total                counter    synchronous steps: driver time
mpexec_engine_worker_seconds_total              counter    ... of which inside the workers
==============================================  =========  =================================

Gauges and the executor's figures are read when scraped (a collector), so
nothing is updated per step on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mpexec.engine.async_llm import AsyncLLM

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        load = self.engine.load()
        for name, key, text in (
                ("mpexec_num_requests_running", "running", "requests in the running batch"),
                ("mpexec_num_requests_waiting", "waiting", "requests waiting to be scheduled"),
                ("mpexec_kv_cache_usage_ratio", "kv_cache_usage",
                 "fraction of the KV-cache blocks in use")):
            gauge = GaugeMetricFamily(name, text, labels=["model_name"])
            gauge.add_metric([self.model_name], load[key])
            yield gauge
        for name, value, text in (
                ("mpexec_prompt_tokens", self.engine.num_prompt_tokens, "prompt tokens queued"),
                ("mpexec_generation_tokens", self.engine.num_generation_tokens,
                 "tokens generated")):
            counter = CounterMetricFamily(name, text, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter
        steps = self.engine.engine.stats
        for name, total, text in (
                ("mpexec_engine_steps", float(steps.steps), "engine steps run"),
                ("mpexec_engine_step_seconds", steps.sync_step_total_s,
                 "driver time of synchronous steps (execute_model + sample_tokens)"),
                ("mpexec_engine_worker_seconds", steps.sync_worker_total_s,
                 "time the output rank spent inside those steps' methods")):
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], total)
            yield counter
        stats = self.engine.engine.executor.stats()
        latency = GaugeMetricFamily("mpexec_executor_call_latency_seconds",
                                    "latency of the executor's calls (executor.stats())",
                                    labels=["method", "quantile"])
        calls = CounterMetricFamily("mpexec_executor_calls", "executor calls made",
                                    labels=["method"])
        for method, s in sorted(stats.items()):
            for quantile, seconds in (("0.5", s.p50_s), ("0.9", s.p90_s), ("0.99", s.p99_s),
                                    ("1", s.max_s)):
                latency.add_metric([method, quantile], seconds)
            calls.add_metric([method], s.calls)
        yield latency
        yield calls


class ServerMetrics:
    """The registry of one server; the request handlers record into it."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.requests = Counter("mpexec_requests", "requests answered",
                                ["finish_reason"], registry=self.registry)
        self.ttft = Histogram("mpexec_time_to_first_token_seconds",
                              "time from a request's arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("mpexec_inter_token_latency_seconds",
                             "time between two tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def observe_tokens(metrics: ServerMetrics, arrival: float, last: float | None, now: float,
                   new_tokens: int) -> None:
    """Record the TTFT (first tokens) or the ITL of ``new_tokens`` that came at ``now``."""
    if new_tokens <= 0:
        return
    if last is None:
        metrics.ttft.observe(now - arrival)
        new_tokens -= 1
        last = now
    for _ in range(new_tokens):
        metrics.itl.observe((now - last) / max(1, new_tokens))

