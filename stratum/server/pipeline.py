"""One request's way through the runtime, shared by both APIs.

    admit (503 draining, 418 pollution, 429 cost, 529 queue: before any tokenization)
      -> controls (X-Stratum-Mode, system-prompt hints, priority)
      -> prompt (chat template; compressive mode; cache_control pins)
      -> reserve (429 unless the tenant's budget holds the request's upper bound)
      -> engine stream (prefix-cache blocks salted with the tenant when tenants are isolated)
      -> telemetry (x-stratum-cost, trace, metrics, budget settlement, rate-limit headers)
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from stratum.engine.admission import CostAdmission, PollutionDetector
from stratum.engine.client import EngineClient, QueueFull, RequestGroup, RequestStream
from stratum.engine.outputs import EngineDeadError, RequestOutput, RequestStats
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams
from stratum.server.batches import BATCH_PRIORITY
from stratum.server.chat import Prompt
from stratum.server.errors import (APIError, CachePollution, EngineUnavailable, InvalidRequest, Overloaded, RateLimited,
                                   as_api_error, is_openai)
from stratum.telemetry.cost import CostFields, PricingModel
from stratum.telemetry.metrics import Metrics
from stratum.telemetry.trace import build_trace, encode_trace, hardware_view

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
    draining: bool = False  # shutting down: new requests get 503
    active: dict[str, "Job"] = field(default_factory=dict)  # admitted and not yet finished or released
    aggressive_ttl_s: float = 600.0
    warmup_ttl_s: float = 300.0
    compress_threshold_tokens: int = 1024
    compress_chunk_tokens: int = 384
    compress_summary_tokens: int = 64


@dataclass
class Job:
    """Everything decided about one request before it runs."""

    endpoint: str
    request_id: str
    tenant: str
    session: str
    cache_salt: str | None = None
    reserved: int = 0  # tokens reserved against the tenant's budget: upper bounds of what runs for this request
    spent: int = 0  # measured cost of the engine work done for it before the answer (compressive summaries)
    budget_reset_at: float | None = None  # the budget window the reservations were made in
    cache_breakpoint: int = 0  # prompt tokens up to the last cache_control breakpoint (0: none marked)
    cache_mode: str = "default"  # default | aggressive | bypass
    priority: int = 0
    is_low_latency: bool = False
    is_high_value: bool = False
    is_batch: bool = False  # a Message Batches request: runs below every interactive one
    debug: str | None = None  # None | "true" | "full"
    advise: bool = False
    prompt: Prompt | None = None
    prompt_text: str = ""
    compression: dict[str, Any] | None = None
    is_settled: bool = False  # the reservation was replaced by the measured cost
    stream: RequestStream | RequestGroup | None = None  # once submitted to the engine
    choices: dict[str, int] = field(default_factory=lambda: {})  # engine request id -> choice index (n samples)
    n: int = 1  # samples per prompt
    prompt_ids: list[list[int]] = field(default_factory=list)  # the prompts queued (several on /v1/completions)
    cancelled: APIError | None = None  # ended by the server (a drain that ran out of time) before submission
    is_context_capped: bool = False  # max_tokens was lowered to the room the context leaves (`fit_context`)
    cpu0: float = field(default_factory=time.process_time)
    wall0: float = field(default_factory=time.perf_counter)

    @property
    def cache_policy(self) -> CachePolicy:
        if self.cache_mode == "bypass":
            return CachePolicy.bypass()
        return CachePolicy()


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


def admit(rt: Runtime, request: Request, endpoint: str, max_tokens: int | None, user_id: str | None) -> Job:
    """Decide before any tokenization: 503 if draining or the engine is gone, 418 on pollution, 429 if
    the tenant's budget cannot hold even max_tokens and one prompt token, 529 if the queue is full.
    From here on the request counts against the queue (see `release`)."""
    if rt.draining:
        raise EngineUnavailable("the server is shutting down", headers={"connection": "close"})
    if not rt.engine.is_alive:
        raise EngineUnavailable(f"the engine is not running ({rt.engine.snapshot.error or 'stopped'})")
    check_control_headers(request)
    tenant = tenant_of(request, user_id)
    session = request.headers.get("x-stratum-session-id") or user_id or tenant
    job = Job(endpoint, request.state.request_id, tenant, session, cache_salt=tenant if rt.isolate_tenants else None,
              is_batch=bool(getattr(request.state, "batch_tenant", None)))
    if rt.pollution.is_polluted(session):
        if rt.pollution.policy == "reject":
            rt.pollution.reset(session)
            rt.metrics.rejections.labels("cache_pollution").inc()
            raise CachePollution(
                "the last requests of this session missed the prefix cache and differ only in high-entropy values "
                "(UUIDs, timestamps, ids); " + PollutionDetector.ADVICE,
                headers={"x-stratum-advice": PollutionDetector.ADVICE}, extra={"stratum_reason": "cache_pollution"})
        job.advise = True
    if rt.admission.is_enabled:
        least = 1 + (max_tokens or 0)
        d = rt.admission.check(tenant, least)
        if not d.is_admitted:
            raise _over_budget(rt, job, d, least, f"this request costs at least {least} tokens (max_tokens and its prompt)")
    try:
        rt.engine.admit(job.request_id)
    except QueueFull as e:
        rt.metrics.rejections.labels("queue_full").inc()
        raise Overloaded(str(e), headers={"retry-after": str(e.retry_after_s), **ratelimit_headers(rt, job)}) from None
    except EngineDeadError as e:
        raise EngineUnavailable(str(e)) from None
    rt.active[job.request_id] = job
    return job


def reserve(rt: Runtime, job: Job, num_prompt_tokens: int, max_tokens: int, what: str = "this request") -> None:
    """Reserve an upper bound of what running a prompt can cost, against the tenant's budget: every
    prompt token (whether or not the cache will serve it) and every token it may generate.

    Raises:
        RateLimited: the bound does not fit in what the tenant has left in this window.
    """
    if not rt.admission.is_enabled:
        return
    bound = num_prompt_tokens + max_tokens
    d = rt.admission.admit(job.tenant, bound)
    if not d.is_admitted:
        raise _over_budget(rt, job, d, bound, f"{what} may cost up to {bound} tokens ({num_prompt_tokens} prompt tokens + "
                                       f"max_tokens {max_tokens})")
    job.reserved += bound
    if job.budget_reset_at is None:
        job.budget_reset_at = d.reset_at


def _over_budget(rt: Runtime, job: Job, d, tokens: int, why: str) -> RateLimited:
    rt.metrics.rejections.labels("cost_threshold_exceeded").inc()
    return RateLimited(
        f"{why}, more than the {d.remaining} tokens left to this tenant in the current "
        f"{rt.admission.window_s:g}s window",
        headers={"retry-after": str(d.retry_after_s), **ratelimit_headers(rt, job, d)},
        extra={"stratum_reason": "cost_threshold_exceeded", "stratum_cost_tokens": tokens},
    )


def ratelimit_headers(rt: Runtime, job: Job, d=None) -> dict[str, str]:
    """The tenant's budget window as it stands, in Anthropic's headers (and OpenAI's on its routes)."""
    if not rt.admission.is_enabled:
        return {}
    d = d or rt.admission.check(job.tenant)
    headers = {
        "anthropic-ratelimit-tokens-limit": str(d.limit),
        "anthropic-ratelimit-tokens-remaining": str(d.remaining),
        "anthropic-ratelimit-tokens-reset": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(d.reset_at)),
    }
    if is_openai(job.endpoint):
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


def release(rt: Runtime, job: Job) -> None:
    """A request that ends without `finish` (refused after admission, aborted, disconnected) is settled
    at what was measured before its answer (compressive summaries): its own run was not measured,
    so it is not charged. It leaves the waiting queue too."""
    rt.engine.release(job.request_id)
    rt.active.pop(job.request_id, None)
    settle(rt, job, job.spent)


def settle(rt: Runtime, job: Job, cost: int) -> None:
    """Replace the request's reservations by its measured cost, once."""
    if not job.is_settled and job.reserved:
        rt.admission.settle(job.tenant, job.reserved, cost, job.budget_reset_at)
    job.is_settled = True


def apply_controls(job: Job, request: Request, system_text: str) -> None:
    """System-prompt hints first, then headers, which override them."""
    lowered = system_text.lower()
    if HINT_AGGRESSIVE in lowered:
        job.cache_mode = "aggressive"
    if HINT_LOW_LATENCY in lowered:
        job.is_low_latency = True
    if HINT_HIGH_VALUE in lowered:
        job.is_high_value = True
        job.priority = TOP_PRIORITY
    mode = request.headers.get("x-stratum-mode", "").strip().lower()
    if mode:
        job.cache_mode = mode
    if job.is_batch:
        job.priority = BATCH_PRIORITY
    debug = request.headers.get("x-stratum-debug", "").strip().lower()
    if debug in ("true", "1", "full"):
        job.debug = "full" if debug == "full" else "true"


def check_request(rt: Runtime, prompt: Prompt, sampling: SamplingParams) -> None:
    """Validate against the context length; a prompt with tools also stops at the end of a tool call, and
    keeps in its text the tool-call markers that are special tokens (Mistral's [TOOL_CALLS]), to be read."""
    stop = prompt.tool_format.stop
    if prompt.tool_names and stop is not None and stop not in sampling.stop:
        sampling.stop.append(stop)
    if prompt.tool_names and prompt.tool_format.special_tokens:
        sampling.skip_special_tokens = False
    try:
        rt.engine.check_request(len(prompt.token_ids), sampling)
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None


def fit_context(rt: Runtime, job: Job, num_prompt_tokens: int, sampling: SamplingParams) -> None:
    """The Messages API's rule: a prompt longer than the context is a 400 naming both counts, in
    Anthropic's words; a max_tokens beyond what the context leaves is lowered to it, and an answer
    that fills the context ends with stop_reason model_context_window_exceeded (`is_context_capped`).

    Raises:
        InvalidRequest: the prompt leaves no room in the context.
    """
    limit = rt.engine.config.max_model_len
    if num_prompt_tokens > limit:
        raise InvalidRequest(f"prompt is too long: {num_prompt_tokens} tokens > {limit} maximum")
    room = limit - num_prompt_tokens
    if sampling.max_tokens > room:
        if room == 0:
            raise InvalidRequest(f"prompt is too long: {num_prompt_tokens} tokens leave no room for output in the "
                                 f"{limit}-token context")
        sampling.max_tokens = room
        job.is_context_capped = True


async def compress(rt: Runtime, job: Job, messages: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """X-Stratum-Context-Mode: compressive. The longest user message, when the prompt is long, is cut
    into chunks that the same engine summarises (all chunks batched together); the answer is then
    generated from the summaries."""
    template, tokenizer = rt.engine.chat_template, rt.engine.tokenizer
    original = len(await asyncio.to_thread(template.encode, messages))
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if original <= rt.compress_threshold_tokens or not users:
        job.compression = {"applied": False, "original_prompt_tokens": original, "threshold_tokens": rt.compress_threshold_tokens}
        return messages
    target = max(users, key=lambda i: len(messages[i]["content"]))
    ids = await asyncio.to_thread(tokenizer.encode, messages[target]["content"])
    size = rt.compress_chunk_tokens

    def summary_prompts() -> list[list[int]]:  # tokenizer work, off the event loop like the rest
        return [template.encode([
            {"role": "system", "content": "Summarize the user's text in two or three sentences. Keep names, numbers and facts."},
            {"role": "user", "content": tokenizer.decode(ids[i : i + size])},
        ]) for i in range(0, len(ids), size)]

    prompts = await asyncio.to_thread(summary_prompts)
    params = SamplingParams(max_tokens=rt.compress_summary_tokens, temperature=0.0)
    reserve(rt, job, sum(len(p) for p in prompts), len(prompts) * params.max_tokens, "its compression")

    async def summarise(i: int, prompt: list[int]) -> str:
        text = ""
        stream = rt.engine.submit(prompt, params, request_id=f"{request_id}-summary-{i}", priority=job.priority,
                                  cache_salt=job.cache_salt)
        try:
            async for out in stream:
                text = out.text
                if out.finished:
                    if out.stats is not None:
                        job.spent += measured_cost(usage_of(out))
                    break
        finally:
            await stream.close()
        return text.strip()

    summaries = await asyncio.gather(*(summarise(i, p) for i, p in enumerate(prompts)))
    compressed = [dict(m) for m in messages]
    compressed[target]["content"] = "Summary of the provided text, part by part:\n" + "\n".join(
        f"{i + 1}. {s}" for i, s in enumerate(summaries))
    after = len(await asyncio.to_thread(template.encode, compressed))
    job.compression = {"applied": True, "original_prompt_tokens": original, "compressed_prompt_tokens": after,
                       "ratio": round(after / original, 4), "chunks": len(prompts)}
    return compressed


def pins_for(template, messages: list[dict[str, Any]], marked: dict[int, str], tools) -> list[tuple[int, float]]:
    """cache_control on a message's block pins the prompt prefix through the end of that message."""
    pins = []
    for index, ttl in marked.items():
        prefix = template.encode(messages[: index + 1], tools=tools, add_generation_prompt=False)
        pins.append((len(prefix), PIN_TTLS.get(ttl or "5m", 300.0)))
    return pins


def start(rt: Runtime, job: Job, prompt: Prompt, sampling: SamplingParams,
          pins: list[tuple[int, float]] | None = None, n: int = 1,
          prompts: list[list[int]] | None = None) -> RequestStream | RequestGroup:
    """Queue the request in the engine; warm-up (max_tokens 0) and aggressive mode pin what they cache.
    n > 1 queues n samples of the prompt, each with its own seed (seed + i when the request gives one);
    `prompts` (completions) replaces the prompt's ids by several prompts, n samples each."""
    job.prompt = prompt
    policy = job.cache_policy
    if job.cache_mode == "aggressive":
        policy = CachePolicy(pin_ttl_s=rt.aggressive_ttl_s, pin_output=True)
    elif sampling.max_tokens == 0 and policy.write and sampling.prompt_logprobs is None:
        policy = CachePolicy(pin_ttl_s=rt.warmup_ttl_s)
    if policy.pin_ttl_s:  # asked to be cached, as a cache_control breakpoint on the whole prompt asks
        job.cache_breakpoint = len(prompt.token_ids)
    marker = None
    if prompt.tool_names:
        marker = "" if prompt.is_forced_tool else prompt.tool_format.marker
    if job.cancelled is not None:
        raise job.cancelled
    kwargs = dict(priority=job.priority, cache_policy=policy, cache_salt=job.cache_salt, tool_marker=marker,
                  pin_prefixes=pins or [], low_latency=job.is_low_latency)
    prompts = prompts or [prompt.token_ids]
    job.n, job.prompt_ids, total = n, prompts, len(prompts) * n
    job.choices = {job.request_id if i == 0 else f"{job.request_id}.{i}": i for i in range(total)}
    if total == 1:
        job.stream = rt.engine.submit(prompt.token_ids, sampling, request_id=job.request_id, **kwargs)
    else:
        samplings = [replace(sampling, seed=None if sampling.seed is None else sampling.seed + i % n) for i in range(total)]
        rids = list(job.choices)
        forks = [rids[i - i % n] if i % n else None for i in range(total)]  # sample j > 0 forks sample 0 of its prompt
        job.stream = rt.engine.submit_group([prompts[i // n] for i in range(total)], samplings, rids, forks, **kwargs)
    return job.stream


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
    for job in left:
        job.cancelled = EngineUnavailable(f"the server is shutting down; the request did not finish within the "
                                          f"{timeout_s:g}s drain timeout")
        if job.stream is not None:
            job.stream.cancel(job.cancelled)
    deadline = time.monotonic() + grace_s
    while rt.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return len(left)


def event_response(events, rt: Runtime, job: Job, headers: dict[str, str]) -> StreamingResponse:
    """An SSE response whose request is closed and released however the response ends, including a
    client that disconnects before the first event (when the generator's own cleanup never runs)."""

    async def close() -> None:
        if job.stream is not None:
            await job.stream.close()
        release(rt, job)

    return _EventStream(events, close, media_type="text/event-stream", headers={"cache-control": "no-cache", **headers})


class _EventStream(StreamingResponse):
    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def paced(stream: RequestStream | RequestGroup, first: RequestOutput | None, ping_interval_s: float):
    """A stream's outputs up to and including the last finished one (of every member of a group), with
    None whenever ping_interval_s passes without one (the caller sends a keep-alive).

    Raises:
        APIError: the engine failed the request, or the stream ended without a finished output.
    """
    out = first
    left = len(stream.members) if isinstance(stream, RequestGroup) else 1
    while True:
        if out is None:
            try:
                out = await stream.next(timeout=ping_interval_s)
            except StopAsyncIteration:
                raise APIError("the request ended without a result") from None
            except Exception as e:
                raise as_api_error(e) from None
        yield out
        if out is not None and out.finished:
            if out.finish_reason == "error":
                raise APIError(out.error or "generation failed")
            left -= 1
            if not left:
                return
        out = None


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
        num_tool_reserved_tokens=sum(s.num_tool_reserved_tokens for s in stats))
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


def admitted_usage(rt: Runtime, job: Job) -> dict[str, int]:
    """Usage before prefill has finished: the prompt, and what the engine said its cache will serve
    when it accepted the request (every prompt token as input if it has not said yet)."""
    n = len(job.prompt.token_ids) if job.prompt is not None else 0
    cached = min(n, (job.stream.expected_cached_tokens if job.stream is not None else None) or 0)
    block = rt.engine.config.block_size
    created = max(0, min(job.cache_breakpoint, n) // block * block - cached) if job.cache_breakpoint else 0
    return {"input_tokens": n - cached - created, "output_tokens": 0, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": created}


def early_headers(rt: Runtime, out: RequestOutput | None, job: Job) -> dict[str, str]:
    """Headers a stream can send after prefill: cost so far, the engine mode, the tenant's budget."""
    headers = {"x-stratum-mode": out.mode if out is not None else "normal", "x-stratum-cache-mode": job.cache_mode,
               **replica_header(job)}
    if out is not None and out.stats is not None:
        headers["x-stratum-cost"] = CostFields.from_stats(out.stats).header()
    if job.advise:
        headers["x-stratum-advice"] = PollutionDetector.ADVICE
    headers.update(ratelimit_headers(rt, job))
    return headers


def replica_header(job: Job) -> dict[str, str]:
    """Which replica served the request, when the engine is a set of replicas."""
    replica = job.stream.replica if job.stream is not None else None
    return {"x-stratum-replica": replica} if replica else {}


def finish(rt: Runtime, job: Job, out: RequestOutput) -> tuple[dict[str, str], dict[str, Any]]:
    """Telemetry for a finished request: headers, the final cost event's body, metrics, budget settlement.

    Returns:
        (response headers, {"cost": ..., "header": ..., "final_cost_estimate": ..., "trace": ...}).
    """
    stats = out.stats
    cost = CostFields.from_stats(stats)
    usage = usage_of(out, job.cache_breakpoint)
    usd = rt.pricing.price(cost, usage)
    headers = {"x-stratum-cost": cost.header(), "x-stratum-mode": out.mode, "x-stratum-cache-mode": job.cache_mode,
               **replica_header(job)}
    if job.advise:
        headers["x-stratum-advice"] = PollutionDetector.ADVICE
        rt.metrics.advice.inc()
    body: dict[str, Any] = {"cost": cost.as_dict(), "header": headers["x-stratum-cost"], "final_cost_estimate": round(usd, 10),
                            "mode": out.mode, "cache_written_tokens": stats.num_cache_written_tokens}
    if job.debug:
        extra: dict[str, Any] = {"engine_mode": out.mode, "cache_mode": job.cache_mode, "priority": job.priority,
                                 "low_latency": job.is_low_latency}
        if job.compression is not None:
            extra["compression"] = job.compression
        if "x-stratum-replica" in headers:
            extra["replica"] = headers["x-stratum-replica"]
        hardware = None
        if job.debug == "full":
            hardware = hardware_view(rt.engine.info, rt.engine.snapshot, time.process_time() - job.cpu0,
                                     time.perf_counter() - job.wall0)
        trace = encode_trace(build_trace(stats, cost, usage, rt.pricing, extra, hardware))
        headers["x-stratum-trace"] = trace
        body["trace"] = trace
    rt.metrics.observe_request(job.endpoint, rt.model_name, stats, cost, usd, job.tenant)
    rt.active.pop(job.request_id, None)
    settle(rt, job, job.spent + measured_cost(usage))
    headers.update(ratelimit_headers(rt, job))
    rt.pollution.record(job.session, cost.cache_hit_ratio, job.prompt_text)
    return headers, body


def make_runtime(engine: EngineClient, model_name: str, pricing: PricingModel, budget_tokens: int | None,
                 window_s: float, pollution_policy: str, isolate_tenants: bool = False) -> Runtime:
    metrics = Metrics(lambda: engine.snapshot, engine.replicas)
    return Runtime(engine, model_name, CostAdmission(budget_tokens, window_s), PollutionDetector(pollution_policy), pricing,
                   metrics, isolate_tenants=isolate_tenants)

