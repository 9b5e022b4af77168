"""Client-side Prometheus counters fed from the cost each Stratum response reports, on a registry the
application owns (`Stratum(metrics=ClientMetrics(registry))`).

    stratum_client_cost_dollars_total{model,cache_hit}   USD: the server's final_cost_estimate when the
                                                         response carries it (streams; X-Stratum-Debug),
                                                         else `pricing(cost, usage)`
    stratum_client_requests_total{model,mode}            responses with a Stratum cost
    stratum_client_tokens_total{model,kind}              input, output, cache_read, cache_creation
    stratum_client_cache_hit_ratio{model}                histogram of cache_hit_ratio
    stratum_client_prefill_latency_seconds{model}        histogram of prefill_latency_us
    stratum_client_kv_sparsity{model}                    histogram of kv_sparsity (when measured)
    stratum_client_retries_total{reason,action}          the retry policy's decisions
"""

from __future__ import annotations

from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from stratum.client.cost import StratumCost, StratumInfo
from stratum.telemetry.cost import ArticleFormula
from stratum.client.retry import RetryEvent

_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKEN_KINDS = {"input_tokens": "input", "output_tokens": "output", "cache_read_input_tokens": "cache_read",
                "cache_creation_input_tokens": "cache_creation"}


class ClientMetrics:
    """Args:
        registry: the application's CollectorRegistry (never the global default unless passed).
        pricing: USD for a response without a server estimate; defaults to the server's default
            `article` formula. Pass the formula your server runs with if it differs.
    """

    def __init__(self, registry: CollectorRegistry,
                 pricing: Callable[[StratumCost, Mapping[str, int]], float] = ArticleFormula().price):
        self.pricing = pricing
        self.cost = Counter("stratum_client_cost_dollars", "USD reported (or priced) per Stratum response",
                            ["model", "cache_hit"], registry=registry)
        self.requests = Counter("stratum_client_requests", "Responses that carried a Stratum cost", ["model", "mode"],
                                registry=registry)
        self.tokens = Counter("stratum_client_tokens", "Tokens by kind, from the responses' usage", ["model", "kind"],
                              registry=registry)
        self.cache_hit_ratio = Histogram("stratum_client_cache_hit_ratio", "cache_hit_ratio per response", ["model"],
                                         buckets=_RATIO_BUCKETS, registry=registry)
        self.prefill_latency = Histogram("stratum_client_prefill_latency_seconds", "prefill_latency_us per response",
                                         ["model"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.kv_sparsity = Histogram("stratum_client_kv_sparsity", "kv_sparsity per response (when measured)",
                                     ["model"], buckets=_RATIO_BUCKETS, registry=registry)
        self.retries = Counter("stratum_client_retries", "Retry policy decisions", ["reason", "action"],
                               registry=registry)

    def observe(self, model: str, info: StratumInfo) -> None:
        """One finished response (a stream once its stratum_cost event arrived)."""
        cost = info.cost
        if cost is None:
            return
        usd = info.final_cost_estimate if info.final_cost_estimate is not None else self.pricing(cost, info.usage)
        self.cost.labels(model, "true" if cost.is_cache_hit else "false").inc(max(0.0, usd))
        self.requests.labels(model, info.mode or "unknown").inc()
        for key, kind in _TOKEN_KINDS.items():
            if info.usage.get(key):
                self.tokens.labels(model, kind).inc(info.usage[key])
        self.cache_hit_ratio.labels(model).observe(cost.cache_hit_ratio)
        self.prefill_latency.labels(model).observe(cost.prefill_latency_s)
        if cost.kv_sparsity is not None:
            self.kv_sparsity.labels(model).observe(cost.kv_sparsity)

    def observe_retry(self, event: RetryEvent) -> None:
        self.retries.labels(event.reason, event.action).inc()
