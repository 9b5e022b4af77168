"""The state every request of the server shares (`Runtime`), and the policies applied to each one.

`lifecycle.RequestLifecycle` runs one request through them; nothing here holds a request: tenants,
controls, rate-limit headers, checks, usage and cost figures, merging n choices, and the drain.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request

from stratum.engine.admission import CostAdmission, PollutionDetector
from stratum.engine.client import EngineClient
from stratum.engine.outputs import RequestOutput, RequestStats
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams
from stratum.server.batches import BATCH_PRIORITY
from stratum.server.chat import Prompt
from stratum.server.errors import EngineUnavailable, InvalidRequest, RateLimited, is_openai
from stratum.telemetry.cost import PricingModel
from stratum.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from stratum.server.lifecycle import RequestLifecycle

log = logging.getLogger("stratum.server")

HINT_AGGRESSIVE = "use aggressive caching for repeated queries"
HINT_LOW_LATENCY = "prioritize low-latency over accuracy"
HINT_HIGH_VALUE = "this is a high-value request; spare no resources"
TOP_PRIORITY = -100
PIN_TTLS = {"5m": 300.0, "1h": 3600.0}


@dataclass
class Runtime:
    """The server's in-process orchestration state."""

    engine: EngineClient
    model_name: str
    admission: CostAdmission
    pollution: PollutionDetector
    pricing: PricingModel
    metrics: Metrics
    isolate_tenants: bool = False  # each tenant's prefix-cache blocks are salted with it
    header_wait_s: float = 2.0  # a stream waits this long for prefill before sending headers without its figures
    ping_interval_s: float = 5.0  # a stream sends a keep-alive after this long without an output
    draining: bool = False  # shutting down: new requests get 503
    active: dict[str, RequestLifecycle] = field(default_factory=dict)  # admitted and not yet ended
    aggressive_ttl_s: float = 600.0
    warmup_ttl_s: float = 300.0
    compress_threshold_tokens: int = 1024
    compress_chunk_tokens: int = 384
    compress_summary_tokens: int = 64


@dataclass(frozen=True, slots=True)
class Controls:
    """What a request's X-Stratum-* headers and system-prompt hints ask of the runtime."""

    cache_mode: str = "default"  # default | aggressive | bypass
    priority: int = 0
    is_low_latency: bool = False
    is_high_value: bool = False
    debug: str | None = None  # None | "true" | "full"

    @property
    def cache_policy(self) -> CachePolicy:
        if self.cache_mode == "bypass":
            return CachePolicy.bypass()
        return CachePolicy()


def controls_of(request: Request, system_text: str, is_batch: bool) -> Controls:
    """System-prompt hints first, then headers, which override them; a batch request runs at the batch priority."""
    lowered = system_text.lower()
    cache_mode = "aggressive" if HINT_AGGRESSIVE in lowered else "default"
    is_high_value = HINT_HIGH_VALUE in lowered
    priority = TOP_PRIORITY if is_high_value else 0
    mode = request.headers.get("x-stratum-mode", "").strip().lower()
    if mode:
        cache_mode = mode
    if is_batch:
        priority = BATCH_PRIORITY
    debug = request.headers.get("x-stratum-debug", "").strip().lower()
    return Controls(cache_mode, priority, HINT_LOW_LATENCY in lowered, is_high_value,
                    ("full" if debug == "full" else "true") if debug in ("true", "1", "full") else None)


def tenant_of(request: Request, user_id: str | None) -> str:
    """The API key, else metadata.user_id, else the client address; a batch request's is its batch's."""
    batch_tenant = getattr(request.state, "batch_tenant", None)
    if batch_tenant:
        return batch_tenant
    key = request.headers.get("x-api-key") or request.headers.get("authorization", "")[7:].strip()
    if key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    if user_id:
        return "user:" + user_id
    return "addr:" + (request.client.host if request.client else "unknown")


def over_budget(rt: Runtime, tenant: str, endpoint: str, d, tokens: int, why: str) -> RateLimited:
    """The 429 for a request whose cost does not fit in what its tenant has left (`d`: the decision)."""
    rt.metrics.rejections.labels("cost_threshold_exceeded").inc()
    return RateLimited(
        f"{why}, more than the {d.remaining} tokens left to this tenant in the current "
        f"{rt.admission.window_s:g}s window",
        headers={"retry-after": str(d.retry_after_s), **ratelimit_headers(rt, tenant, endpoint, d)},
        extra={"stratum_reason": "cost_threshold_exceeded", "stratum_cost_tokens": tokens},
    )


def ratelimit_headers(rt: Runtime, tenant: str, endpoint: str, d=None) -> dict[str, str]:
    """The tenant's budget window as it stands, in Anthropic's headers (and OpenAI's on its routes)."""
    if not rt.admission.is_enabled:
        return {}
    d = d or rt.admission.check(tenant)
    headers = {
        "anthropic-ratelimit-tokens-limit": str(d.limit),
        "anthropic-ratelimit-tokens-remaining": str(d.remaining),
        "anthropic-ratelimit-tokens-reset": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(d.reset_at)),
    }
    if is_openai(endpoint):
        headers["x-ratelimit-limit-tokens"] = str(d.limit)
        headers["x-ratelimit-remaining-tokens"] = str(d.remaining)
        headers["x-ratelimit-reset-tokens"] = f"{max(0.0, d.reset_at - time.time()):.3f}s"
    return headers


def check_control_headers(request: Request) -> None:
    """Reject malformed X-Stratum-* control headers before admission charges anything."""
    mode = request.headers.get("x-stratum-mode", "").strip().lower()
    if mode and mode not in ("aggressive", "bypass", "default"):
        raise InvalidRequest(f"X-Stratum-Mode must be aggressive, bypass or default, not {mode!r}")
    context = request.headers.get("x-stratum-context-mode", "").strip().lower()
    if context and context != "compressive":
        raise InvalidRequest(f"X-Stratum-Context-Mode must be compressive, not {context!r}")


def check_request(rt: Runtime, prompt: Prompt, sampling: SamplingParams) -> None:
    """Validate against the context length; a prompt with tools also stops at the end of a tool call when
    it may make only one, and keeps in its text the tool-call markers that are special tokens (Mistral's
    [TOOL_CALLS]), to be read."""
    stop = prompt.tool_format.stop
    if prompt.tool_names and not prompt.parallel_calls and stop is not None and stop not in sampling.stop:
        sampling.stop.append(stop)
    if prompt.tool_names and prompt.tool_format.special_tokens:
        sampling.skip_special_tokens = False
    try:
        rt.engine.check_request(len(prompt.token_ids), sampling)
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None


def pins_for(template, messages: list[dict[str, Any]], marked: dict[int, str], tools) -> list[tuple[int, float]]:
    """cache_control on a message's block pins the prompt prefix through the end of that message."""
    pins = []
    for index, ttl in marked.items():
        prefix = template.encode(messages[: index + 1], tools=tools, add_generation_prompt=False)
        pins.append((len(prefix), PIN_TTLS.get(ttl or "5m", 300.0)))
    return pins


async def drain(rt: Runtime, timeout_s: float, grace_s: float = 2.0) -> int:
    """Shut down gracefully: refuse new requests (503), let the admitted ones finish for up to
    timeout_s, then end the rest with an error (an error event on a stream, an error body otherwise)
    and give them grace_s to send it.

    Returns:
        how many requests were ended by the drain rather than finishing.
    """
    rt.draining = True
    deadline = time.monotonic() + timeout_s
    while rt.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = list(rt.active.values())
    for lc in left:
        lc.cancel(EngineUnavailable(f"the server is shutting down; the request did not finish within the "
                                    f"{timeout_s:g}s drain timeout"))
    deadline = time.monotonic() + grace_s
    while rt.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if rt.active:  # each ended request is released as it ends: one still held is a fault
        log.error("drain: %d requests still held after %gs of grace: %s", len(rt.active), grace_s, ", ".join(rt.active))
    return len(left)


def merge(outs: list[RequestOutput], n: int = 1) -> RequestOutput:
    """One output standing for the choices of a request (n samples of each of its prompts), for usage
    and telemetry: each prompt counted once (as its first sample read it), the work and the output
    tokens of all of them."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    stats = [o.stats for o in outs]
    s0 = stats[0]
    merged = RequestStats(
        num_prompt_tokens=sum(s.num_prompt_tokens for s in stats[::n]),
        num_cached_tokens=sum(s.num_cached_tokens for s in stats[::n]),
        num_prompt_tokens_computed=sum(s.num_prompt_tokens_computed for s in stats),
        num_cache_written_tokens=sum(s.num_cache_written_tokens for s in stats),
        num_output_tokens=sum(s.num_output_tokens for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats), arrival_time=min(s.arrival_time for s in stats),
        first_scheduled_time=min((s.first_scheduled_time for s in stats if s.first_scheduled_time), default=None),
        first_token_time=min((s.first_token_time for s in stats if s.first_token_time), default=None),
        prefill_done_time=max((s.prefill_done_time for s in stats if s.prefill_done_time), default=None),
        finish_time=max((s.finish_time for s in stats if s.finish_time), default=None),
        token_times=sorted(t for s in stats for t in s.token_times), kv_sparsity=s0.kv_sparsity,
        num_kv_sparsity_samples=s0.num_kv_sparsity_samples, num_prefill_chunks=s0.num_prefill_chunks,
        kv_bytes_at_first_token=sum(s.kv_bytes_at_first_token for s in stats),
        num_tool_reserved_tokens=sum(s.num_tool_reserved_tokens for s in stats),
        num_disk_cached_tokens=sum(s.num_disk_cached_tokens for s in stats[::n]),
        disk_read_s=max(s.disk_read_s for s in stats))
    return replace(first, stats=merged, kv_cache_efficiency=sum(o.kv_cache_efficiency for o in outs) / len(outs))


def stream_meta(out: RequestOutput) -> dict[str, Any]:
    return {"stratum_state": out.state, "kv_cache_efficiency": round(out.kv_cache_efficiency, 4)}


def measured_cost(usage: dict[str, int]) -> int:
    """What a finished request is charged against its tenant's budget: uncached prompt tokens + output."""
    return usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["output_tokens"]


def usage_of(out: RequestOutput, breakpoint: int = 0) -> dict[str, int]:
    """Anthropic's usage: cache reads are the prompt tokens the prefix cache served; cache writes are
    the tokens up to the request's last cache_control breakpoint (a warm-up or aggressive mode marks the
    whole prompt) that it wrote to the cache (they are pinned now); input_tokens is the rest. Automatic caching of unmarked prompts is not a
    cache write here (`stratum_cost.cache_written_tokens` reports it)."""
    s = out.stats
    written_end = s.num_cached_tokens + s.num_cache_written_tokens  # full blocks this request cached
    created = max(0, min(breakpoint, written_end) - s.num_cached_tokens)
    return {
        "input_tokens": s.num_prompt_tokens - s.num_cached_tokens - created,
        "output_tokens": s.num_output_tokens,
        "cache_read_input_tokens": s.num_cached_tokens,
        "cache_creation_input_tokens": created,
    }


def make_runtime(engine: EngineClient, model_name: str, pricing: PricingModel, budget_tokens: int | None,
                 window_s: float, pollution_policy: str, isolate_tenants: bool = False, header_wait_s: float = 2.0,
                 ping_interval_s: float = 5.0) -> Runtime:
    active: dict[str, RequestLifecycle] = {}
    metrics = Metrics(lambda: engine.snapshot, engine.replicas, lambda: len(active))
    return Runtime(engine, model_name, CostAdmission(budget_tokens, window_s), PollutionDetector(pollution_policy), pricing,
                   metrics, isolate_tenants=isolate_tenants, header_wait_s=header_wait_s, ping_interval_s=ping_interval_s,
                   active=active)
