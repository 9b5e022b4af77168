"""Prometheus metrics for `/metrics`, on a registry owned by the server instance (no module globals).

Request-level series are observed when a response is sent, from the same figures the response
reports; engine gauges read the snapshot the engine published after its last step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from stratum.engine.outputs import RequestStats
from stratum.telemetry.cost import CostFields

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    def __init__(self, snapshot_source=None, replica_source=None, in_flight_source=None, models=None):
        """Args:
            snapshot_source: a zero-argument callable returning the engine's latest EngineSnapshot
                (the replicas' summed, when the engine is several; the default model's, when several
                models are served).
            replica_source: a zero-argument callable returning each replica's ReplicaView (or none).
            in_flight_source: a zero-argument callable returning how many requests the server admitted
                and has not yet released (`lifecycle.RequestLifecycle`).
            models: the served models (`server.models.ModelSet`): each one's state and engine gauges,
                labelled with its name.
        """
        r = self.registry = CollectorRegistry()
        self.requests = Counter("stratum_request_count", "Requests answered, by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.cache_hit_tokens = Counter("stratum_cache_hit_count", "Prompt tokens served from the prefix cache",
                                        registry=r)
        self.cache_query_tokens = Counter("stratum_cache_query_count", "Prompt tokens looked up in the prefix cache",
                                          registry=r)
        self.kv_sparsity = Histogram("stratum_kv_sparsity", "Per-request attention coverage (kv_sparsity)",
                                     buckets=_RATIO_BUCKETS, registry=r)
        self.cost = Counter("stratum_cost_dollars", "Estimated cost in USD by the configured pricing model",
                            ["model", "cache_hit"], registry=r)
        self.prompt_tokens = Counter("stratum_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generation_tokens = Counter("stratum_generation_tokens", "Generated tokens of answered requests",
                                         registry=r)
        self.ttft = Histogram("stratum_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("stratum_inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("stratum_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("stratum_queue_time_seconds", "Arrival to first scheduled",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("stratum_prefill_time_seconds", "First scheduled to first token (prefill_latency_us)",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.rejections = Counter("stratum_admission_rejections", "Requests rejected before any work, by reason",
                                  ["reason"], registry=r)
        self.advice = Counter("stratum_pollution_advice", "Responses carrying x-stratum-advice", registry=r)
        self.policy_matches = Counter("stratum_policy_matches", "Content policy rules matched (`server.policy`), by "
                                      "rule, tenant, where (prompt or answer) and action", ["rule", "tenant", "scope",
                                                                                            "action"], registry=r)
        self.model_requests = Counter("stratum_model_request_count", "Requests answered, by the model that ran them",
                                      ["model"], registry=r)
        self.model_tokens = Counter("stratum_model_tokens", "Prompt and generated tokens of answered requests, by "
                                    "model", ["model", "kind"], registry=r)
        self._speculative_series()
        if models is not None:
            r.register(_ModelCollector(models))
        # The console's window: (wall time, tenant, ttft s, inter-token gaps, output tokens, usd) per answered request
        self.recent: deque[tuple[float, str, float | None, list[float], int, float]] = deque(maxlen=4096)
        self.num_answered = self.num_hit_tokens = self.num_query_tokens = 0  # the console's totals
        self._snapshot = snapshot_source
        if snapshot_source is not None:
            self._engine_gauges(snapshot_source)
        if replica_source is not None:
            r.register(_ReplicaCollector(replica_source))
        if in_flight_source is not None:
            Gauge("stratum_num_requests_in_flight", "Requests admitted by the server and not yet released",
                  registry=r).set_function(in_flight_source)

    def _speculative_series(self) -> None:
        """Speculative decoding, over answered requests: counters, and their ratios as gauges."""
        r = self.registry
        self.spec_proposed = Counter("stratum_spec_proposed_tokens",
                                     "Tokens proposed for verification (speculative decoding)", registry=r)
        self.spec_accepted = Counter("stratum_spec_accepted_tokens", "Proposed tokens the target model accepted",
                                     registry=r)
        self.spec_steps = Counter("stratum_spec_verify_steps", "Steps in which a request verified proposed tokens",
                                  registry=r)
        self.num_spec = [0, 0, 0]  # proposed, accepted, verify steps
        Gauge("stratum_spec_acceptance_rate", "Accepted / proposed tokens since start", registry=r).set_function(
            lambda: self.num_spec[1] / self.num_spec[0] if self.num_spec[0] else 0.0)
        Gauge("stratum_spec_tokens_per_verify_step",
              "Tokens a verify step yielded (accepted + the target's own), mean since start", registry=r).set_function(
            lambda: (self.num_spec[1] + self.num_spec[2]) / self.num_spec[2] if self.num_spec[2] else 0.0)

    def _engine_gauges(self, snapshot_source) -> None:
        r = self.registry

        def read(fn):
            return lambda: float(fn(snapshot_source()))

        Gauge("stratum_num_requests_running", "Requests in the running batch",
              registry=r).set_function(read(lambda s: s.num_running))
        Gauge("stratum_num_requests_waiting", "Requests in the waiting queue",
              registry=r).set_function(read(lambda s: s.num_waiting))
        Gauge("stratum_kv_cache_usage_ratio", "KV blocks held by running requests / all blocks",
              registry=r).set_function(read(lambda s: s.kv_usage))
        Gauge("stratum_kv_cache_cached_blocks", "Unreferenced blocks kept by the prefix cache",
              registry=r).set_function(read(lambda s: s.kv_blocks.cached))
        Gauge("stratum_num_preemptions", "Recompute preemptions since start (in the current scheduler)",
              registry=r).set_function(read(lambda s: s.num_preemptions))
        Gauge("stratum_runtime_overhead_ratio", "Time outside the model forward / step time, over recent steps",
              registry=r).set_function(read(lambda s: s.overhead_ratio))
        Gauge("stratum_engine_steps", "Engine steps run", registry=r).set_function(read(lambda s: s.num_steps))
        Gauge("stratum_engine_alive", "1 while the engine loop runs", registry=r).set_function(read(lambda s: s.alive))
        r.register(_TierCollector(snapshot_source))
        mode = Gauge("stratum_engine_mode", "1 for the engine's current mode", ["mode"], registry=r)
        mode.labels("normal").set_function(read(lambda s: s.mode == "normal"))
        mode.labels("basic").set_function(read(lambda s: s.mode == "basic"))

    def observe_request(self, endpoint: str, model: str, stats: RequestStats, cost: CostFields, usd: float,
                        tenant: str = "") -> None:
        self.requests.labels(endpoint, "ok").inc()
        self.model_requests.labels(model).inc()
        self.model_tokens.labels(model, "prompt").inc(stats.num_prompt_tokens)
        self.model_tokens.labels(model, "generation").inc(stats.num_output_tokens)
        self.num_answered += 1
        self.num_hit_tokens += stats.num_cached_tokens
        self.num_query_tokens += stats.num_prompt_tokens
        ttft = stats.first_token_time - stats.arrival_time if stats.first_token_time is not None else None
        tail = stats.token_times[-257:]  # the last 256 gaps at most
        gaps = [b - a for a, b in zip(tail, tail[1:])]
        self.recent.append((time.time(), tenant, ttft, gaps, stats.num_output_tokens, max(0.0, usd)))
        self.cache_hit_tokens.inc(stats.num_cached_tokens)
        self.cache_query_tokens.inc(stats.num_prompt_tokens)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_output_tokens)
        if stats.num_spec_steps:
            self.spec_proposed.inc(stats.num_spec_proposed_tokens)
            self.spec_accepted.inc(stats.num_spec_accepted_tokens)
            self.spec_steps.inc(stats.num_spec_steps)
            for i, n in enumerate((stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens,
                                   stats.num_spec_steps)):
                self.num_spec[i] += n
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

    def window(self, tenant: str | None = None, span_s: float = 60.0, rate_s: float = 10.0) -> dict:
        """What the console shows: over the last span_s, TTFT and inter-token percentiles and each
        tenant's requests and cost per minute (only `tenant`'s when given); throughput over rate_s;
        the engine's state from its snapshot."""
        now = time.time()
        recent = [r for r in self.recent if r[0] >= now - span_s]
        ttfts = [1e3 * r[2] for r in recent if r[2] is not None]
        gaps = [1e3 * g for r in recent for g in r[3]]
        by_tenant: dict[str, list] = {}
        for r in recent:
            if tenant is None or r[1] == tenant:
                entry = by_tenant.setdefault(r[1], [0, 0.0])
                entry[0] += 1
                entry[1] += r[5]
        minutes = span_s / 60.0
        hits, queries = self.num_hit_tokens, self.num_query_tokens
        snap = self._snapshot() if self._snapshot is not None else None
        kv = snap.kv_blocks if snap is not None else None
        return {
            "requests_total": self.num_answered,
            "throughput_tok_s": sum(r[4] for r in recent if r[0] >= now - rate_s) / rate_s,
            "ttft_ms": _percentiles(ttfts), "itl_ms": _percentiles(gaps),
            "running": snap.num_running if snap else 0, "waiting": snap.num_waiting if snap else 0,
            "kv_blocks": {"total": kv.total, "free": kv.free, "cached": kv.cached, "in_use": kv.in_use} if kv else {},
            "cache_hit_ratio": hits / queries if queries else 0.0, "mode": snap.mode if snap else "normal",
            "tenants": [{"tenant": t, "requests_per_min": round(n / minutes, 2), "cost_per_min": usd / minutes}
                        for t, (n, usd) in sorted(by_tenant.items())],
        }

    def observe_error(self, path: str, status: int) -> None:
        """A request answered with an error `status` (499: the client closed it first), by its route."""
        self.requests.labels(endpoint_of(path), str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None}
    values = sorted(values)
    return {"p50": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))]}


# The routes a request is counted under; any other path is "other", so that no client can grow the
# series without bound (a scan of random paths).
ENDPOINTS = ("/v1/messages/count_tokens", "/v1/messages/batches", "/v1/messages", "/v1/chat/completions",
             "/v1/completions", "/v1/responses/input_tokens", "/v1/responses", "/v1/models", "/v1/embeddings",
             "/v1/rerank", "/v2/rerank", "/rerank", "/api/embed", "/api/embeddings", "/health", "/metrics", "/console")


def endpoint_of(path: str) -> str:
    """The `endpoint` label of a request's path: the route it names (a batch's or a response's id left
    out), else "other"."""
    for endpoint in ENDPOINTS:
        if path == endpoint or path.startswith(endpoint + "/"):
            return endpoint
    return "other"


class _ReplicaCollector:
    """Each replica's engine gauges, labelled with the replica, read from its last report at scrape time."""

    GAUGES = (
        ("stratum_replica_alive", "1 while the replica's engine loop runs", lambda v: v.snapshot.alive),
        ("stratum_replica_requests_running", "Requests in the replica's running batch",
         lambda v: v.snapshot.num_running),
        ("stratum_replica_requests_waiting", "Requests in the replica's waiting queue",
         lambda v: v.snapshot.num_waiting),
        ("stratum_replica_requests_in_flight", "Requests routed to the replica, not yet completed",
         lambda v: v.in_flight),
        ("stratum_replica_kv_cache_usage_ratio", "The replica's KV blocks held by running requests / all",
         lambda v: v.snapshot.kv_usage),
        ("stratum_replica_kv_cache_cached_blocks", "The replica's unreferenced cached blocks",
         lambda v: v.snapshot.kv_blocks.cached),
        ("stratum_replica_kv_cache_free_blocks", "The replica's free KV blocks", lambda v: v.snapshot.kv_blocks.free),
        ("stratum_replica_engine_steps", "Engine steps the replica has run", lambda v: v.snapshot.num_steps),
        ("stratum_replica_num_preemptions", "The replica's recompute preemptions",
         lambda v: v.snapshot.num_preemptions),
    )

    def __init__(self, source):
        self.source = source

    def describe(self):
        return []  # collected at scrape time only: the replicas come and go

    def collect(self):
        views = self.source()
        for name, doc, value in self.GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for v in views:
                family.add_metric([v.name], float(value(v)))
            yield family


class _ModelCollector:
    """Each served model's state and engine gauges, labelled with its name, at scrape time."""

    STATES = ("unloaded", "loading", "loaded", "failed")

    def __init__(self, models):
        self.models = models

    def describe(self):
        return []  # collected at scrape time only: models load and unload

    def collect(self):
        served = list(self.models.models.values())
        state = GaugeMetricFamily("stratum_model_state", "1 for each served model's state", labels=["model", "state"])
        in_flight = GaugeMetricFamily("stratum_model_requests_in_flight", "Requests holding the model",
                                      labels=["model"])
        running = GaugeMetricFamily("stratum_model_requests_running", "Requests in the model's running batch",
                                    labels=["model"])
        waiting = GaugeMetricFamily("stratum_model_requests_waiting", "Requests in the model's waiting queue",
                                    labels=["model"])
        usage = GaugeMetricFamily("stratum_model_kv_cache_usage_ratio", "The model's KV blocks held by running "
                                  "requests / all", labels=["model"])
        for m in served:
            for s in self.STATES:
                state.add_metric([m.name, s], float(m.state == s))
            in_flight.add_metric([m.name], float(m.num_in_flight))
            if m.engine is not None:
                snap = m.engine.snapshot
                running.add_metric([m.name], float(snap.num_running))
                waiting.add_metric([m.name], float(snap.num_waiting))
                usage.add_metric([m.name], float(snap.kv_usage))
        yield from (state, in_flight, running, waiting, usage)


class _TierCollector:
    """The prefix cache's tiers ("pool", "disk"), labelled, from the engine's snapshot at scrape time."""

    COUNTERS = (
        ("stratum_kv_tier_hit_tokens", "Prompt tokens the tier served", "hit_tokens"),
        ("stratum_kv_tier_read_bytes", "KV bytes read from the tier for hits", "read_bytes"),
        ("stratum_kv_tier_written_bytes", "KV bytes written to the tier", "written_bytes"),
        ("stratum_kv_tier_evicted_blocks", "Blocks the tier evicted", "evicted_blocks"),
        ("stratum_kv_tier_dropped_blocks", "Blocks not written to the tier (queue full, evicted first)",
         "dropped_blocks"),
        ("stratum_kv_tier_corrupt_blocks", "Blocks that failed their checksum on read (dropped, recomputed)",
         "corrupt_blocks"),
        ("stratum_kv_tier_write_cpu_seconds", "CPU time of the tier's writer thread (its own clock)", "write_cpu_s"),
        ("stratum_kv_tier_read_cpu_seconds", "CPU time of the tier's reader thread (its own clock)", "read_cpu_s"),
    )
    GAUGES = (
        ("stratum_kv_tier_size_bytes", "Bytes the tier holds", "size_bytes"),
        ("stratum_kv_tier_blocks", "Blocks the tier holds", "blocks"),
        ("stratum_kv_tier_limit_bytes", "The tier's size bound", "limit_bytes"),
        ("stratum_kv_tier_enabled", "1 while the tier is in use (a full disk turns the disk tier off)", "enabled"),
    )

    def __init__(self, source):
        self.source = source

    def describe(self):
        return []  # collected at scrape time only: the tiers are the engine's

    def collect(self):
        tiers = self.source().kv_tiers
        for families, kind in ((self.COUNTERS, CounterMetricFamily), (self.GAUGES, GaugeMetricFamily)):
            for name, doc, key in families:
                family = kind(name, doc, labels=["tier"])
                for tier, figures in sorted(tiers.items()):
                    if key in figures:
                        family.add_metric([tier], float(figures[key]))
                yield family
