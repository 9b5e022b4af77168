"""Prometheus metrics for `/metrics`, on a registry owned by the server instance (no module globals).

Request-level series are observed when a response is sent, from the same figures the response
reports; engine gauges read the snapshot the engine published after its last step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stratum.engine.outputs import RequestStats
from stratum.telemetry.cost import CostFields

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    def __init__(self, snapshot_source=None):
        """Args: snapshot_source: a zero-argument callable returning the engine's latest EngineSnapshot."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("stratum_request_count", "Requests answered, by endpoint and outcome", ["endpoint", "status"], registry=r)
        self.cache_hit_tokens = Counter("stratum_cache_hit_count", "Prompt tokens served from the prefix cache", registry=r)
        self.cache_query_tokens = Counter("stratum_cache_query_count", "Prompt tokens looked up in the prefix cache", registry=r)
        self.kv_sparsity = Histogram("stratum_kv_sparsity", "Per-request attention coverage (kv_sparsity)", buckets=_RATIO_BUCKETS, registry=r)
        self.cost = Counter("stratum_cost_dollars", "Estimated cost in USD by the configured pricing model", ["model", "cache_hit"], registry=r)
        self.prompt_tokens = Counter("stratum_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generation_tokens = Counter("stratum_generation_tokens", "Generated tokens of answered requests", registry=r)
        self.ttft = Histogram("stratum_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("stratum_inter_token_latency_seconds", "Time between consecutive output tokens", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("stratum_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("stratum_queue_time_seconds", "Arrival to first scheduled", buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("stratum_prefill_time_seconds", "First scheduled to first token (prefill_latency_us)", buckets=_LATENCY_BUCKETS, registry=r)
        self.rejections = Counter("stratum_admission_rejections", "Requests rejected before any work, by reason", ["reason"], registry=r)
        self.advice = Counter("stratum_pollution_advice", "Responses carrying x-stratum-advice", registry=r)
        if snapshot_source is not None:
            self._engine_gauges(snapshot_source)

    def _engine_gauges(self, snapshot_source) -> None:
        r = self.registry

        def read(fn):
            return lambda: float(fn(snapshot_source()))

        Gauge("stratum_num_requests_running", "Requests in the running batch", registry=r).set_function(read(lambda s: s.num_running))
        Gauge("stratum_num_requests_waiting", "Requests in the waiting queue", registry=r).set_function(read(lambda s: s.num_waiting))
        Gauge("stratum_kv_cache_usage_ratio", "KV blocks held by running requests / all blocks", registry=r).set_function(read(lambda s: s.kv_usage))
        Gauge("stratum_kv_cache_cached_blocks", "Unreferenced blocks kept by the prefix cache", registry=r).set_function(read(lambda s: s.kv_blocks.cached))
        Gauge("stratum_num_preemptions", "Recompute preemptions since start (in the current scheduler)", registry=r).set_function(read(lambda s: s.num_preemptions))
        Gauge("stratum_runtime_overhead_ratio", "Time outside the model forward / step time, over recent steps", registry=r).set_function(read(lambda s: s.overhead_ratio))
        Gauge("stratum_engine_steps", "Engine steps run", registry=r).set_function(read(lambda s: s.num_steps))
        Gauge("stratum_engine_alive", "1 while the engine loop runs", registry=r).set_function(read(lambda s: s.alive))
        mode = Gauge("stratum_engine_mode", "1 for the engine's current mode", ["mode"], registry=r)
        mode.labels("normal").set_function(read(lambda s: s.mode == "normal"))
        mode.labels("basic").set_function(read(lambda s: s.mode == "basic"))

    def observe_request(self, endpoint: str, model: str, stats: RequestStats, cost: CostFields, usd: float) -> None:
        self.requests.labels(endpoint, "ok").inc()
        self.cache_hit_tokens.inc(stats.num_cached_tokens)
        self.cache_query_tokens.inc(stats.num_prompt_tokens)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_output_tokens)
        if cost.kv_sparsity is not None:
            self.kv_sparsity.observe(cost.kv_sparsity)
        self.cost.labels(model, "true" if stats.num_cached_tokens > 0 else "false").inc(max(0.0, usd))
        if stats.first_token_time is not None:
            self.ttft.observe(stats.first_token_time - stats.arrival_time)
        if stats.finish_time is not None:
            self.e2e.observe(stats.finish_time - stats.arrival_time)
        if stats.queue_s is not None:
            self.queue.observe(stats.queue_s)
        if stats.prefill_s is not None:
            self.prefill.observe(stats.prefill_s)
        times = stats.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)

    def observe_error(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
