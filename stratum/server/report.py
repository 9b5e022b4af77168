"""What a request reports of itself: its x-stratum-* headers (early, on a stream's head, and final), the
cost event's body, the debug trace (X-Stratum-Debug), and the metrics it is counted in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from stratum.engine.client import EngineClient
from stratum.engine.outputs import RequestOutput
from stratum.server.controls import Controls
from stratum.server.pollution import PollutionDetector
from stratum.server.runtime import Runtime
from stratum.telemetry.cost import CostFields
from stratum.telemetry.trace import build_trace, encode_trace, hardware_view


@dataclass(frozen=True, slots=True)
class Facts:
    """What the report says of a request besides its outputs."""

    endpoint: str
    tenant: str
    controls: Controls
    replica: str | None  # the replica that served it, when the engine is a set of replicas
    is_advised: bool  # its session pollutes the cache: x-stratum-advice
    compression: dict[str, Any] | None = None  # the compressive mode's report, when it was asked for
    policy: dict[str, Any] | None = None  # the content policy's report (`RequestLifecycle.policy_report`)
    model: str = ""  # the served model that ran it
    is_named: bool = False  # several models are served: x-stratum-cost names the one that ran


@dataclass(frozen=True, slots=True)
class Report:
    headers: dict[str, str]
    # the cost event's body: cost, header, final_cost_estimate, mode, cache_written_tokens[, trace]
    cost: dict[str, Any]
    cache_hit_ratio: float

    def with_headers(self, more: dict[str, str]) -> "Report":
        return dataclasses.replace(self, headers={**self.headers, **more})


def _headers(mode: str, facts: Facts) -> dict[str, str]:
    headers = {"x-stratum-mode": mode, "x-stratum-cache-mode": facts.controls.cache_mode.value}
    if facts.replica:
        headers["x-stratum-replica"] = facts.replica
    if facts.policy is not None and facts.policy["blocked"]:  # the rule's id, never what it matched
        headers["x-stratum-policy"] = quote(facts.policy["blocked"], safe="")
    return headers


def cost_header(cost: CostFields, facts: Facts) -> str:
    """`x-stratum-cost`, ending in `model=NAME` (URL-quoted) where the server serves several models."""
    header = cost.header()
    return f"{header},model={quote(facts.model, safe='')}" if facts.is_named else header


def early_headers(first: RequestOutput | None, facts: Facts) -> dict[str, str]:
    """Headers a stream can send after prefill (`first`: the prefill's output, if it came): cost so far,
    the engine mode, the cache mode, advice."""
    headers = _headers(first.mode if first is not None else "normal", facts)
    if first is not None and first.stats is not None:
        headers["x-stratum-cost"] = cost_header(CostFields.from_stats(first.stats), facts)
    if facts.is_advised:
        headers["x-stratum-advice"] = PollutionDetector.ADVICE
    return headers


def ran_low_latency_head(engine: EngineClient) -> bool:
    """Whether a request that asked for low latency ran on the int8 head: only where the engine built one."""
    return engine.info.kernel_choices.get("low_latency_lm_head") is not None


def final_report(rt: Runtime, engine: EngineClient, final: RequestOutput, usage: dict[str, int], facts: Facts,
                 cpu_s: float, wall_s: float) -> Report:
    """The finished request's report (`final`: its choices merged; `usage`: Anthropic's usage of it, on
    `engine`, its model's), priced by the server's pricing model, traced when X-Stratum-Debug asks, and
    counted in the metrics under its model."""
    controls, stats = facts.controls, final.stats
    cost = CostFields.from_stats(stats)
    usd = rt.pricing.price(cost, usage)
    headers = {"x-stratum-cost": cost_header(cost, facts), **_headers(final.mode, facts)}
    if facts.is_advised:
        headers["x-stratum-advice"] = PollutionDetector.ADVICE
        rt.metrics.advice.inc()
    body: dict[str, Any] = {"cost": cost.as_dict(), "header": headers["x-stratum-cost"],
                            "final_cost_estimate": round(usd, 10), "mode": final.mode,
                            "cache_written_tokens": stats.num_cache_written_tokens}
    if facts.is_named:
        body["model"] = facts.model
    if facts.policy is not None:
        body["policy"] = facts.policy
    if controls.debug:
        extra: dict[str, Any] = {"engine_mode": final.mode, "cache_mode": controls.cache_mode.value,
                                 "priority": controls.priority,
                                 "low_latency": controls.is_low_latency and ran_low_latency_head(engine),
                                 "low_latency_asked": controls.is_low_latency}
        if facts.compression is not None:
            extra["compression"] = facts.compression
        if facts.policy is not None:
            extra["policy"] = facts.policy
        if facts.replica:
            extra["replica"] = facts.replica
        hardware = None
        if controls.debug == "full":
            hardware = hardware_view(engine.info, engine.snapshot, cpu_s, wall_s)
        trace = encode_trace(build_trace(stats, cost, usage, rt.pricing, extra, hardware))
        headers["x-stratum-trace"] = trace
        body["trace"] = trace
    rt.metrics.observe_request(facts.endpoint, facts.model, stats, cost, usd, facts.tenant)
    return Report(headers, body, cost.cache_hit_ratio)
