"""One request on the serving side, owned from admission to its end by a `RequestLifecycle`.

    admit    503 draining, 418 pollution, 429 cost, 529 queue: before any tokenization
    prepare  controls, the prompt (chat template; compressive mode; cache_control pins), the context
             rule, and its upper bound of cost reserved against the tenant's budget (429)
    submit   the engine stream (prefix-cache blocks salted with the tenant when tenants are isolated)
    outputs  the engine's outputs to the last one, paced; `events` is the one stream loop over them
    finish   telemetry: x-stratum-cost, trace, metrics, the budget settled at the measured cost
    close    however the request ended; `_end` is the one place it is released and settled

A route runs a request as `async with RequestLifecycle.admit(...) as lc:`; leaving the block closes
it, unless a streamed response has taken it over (`respond`), and then the response's own end does.
The API modules are `Renderer`s: they map outputs to their wire format and hold no resource.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Iterable, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from stratum.engine.admission import PollutionDetector
from stratum.engine.client import QueueFull, RequestGroup, RequestStream
from stratum.engine.outputs import EngineDeadError, RequestOutput
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import SamplingParams
from stratum.server.chat import ChatInput, Prompt, build_prompt
from stratum.server.errors import APIError, CachePollution, EngineUnavailable, InvalidRequest, Overloaded, as_api_error
from stratum.server.pipeline import (Controls, Runtime, check_control_headers, check_request, controls_of, measured_cost,
                                     merge, over_budget, pins_for, ratelimit_headers, tenant_of, usage_of)
from stratum.telemetry.cost import CostFields
from stratum.telemetry.trace import build_trace, encode_trace, hardware_view

log = logging.getLogger("stratum.server")

# A request read without streaming checks this often whether its client is still there.
_DISCONNECT_CHECK_S = 0.5


class Renderer(Protocol):
    """One API's wire format for one request (`anthropic_api`, `openai_api`, `responses_api`)."""

    ping: bytes  # the keep-alive sent when ping_interval_s passes without an output

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        """The response body of a request read to its end: the finished output of each choice, in order."""

    def start(self, first: RequestOutput | None) -> Iterable[bytes]:
        """The events before any output (`first`: the prefill's output, when it came before the headers)."""

    def output(self, out: RequestOutput, choice: int) -> Iterable[bytes]:
        """The events of one output of one choice."""

    def end(self, final: RequestOutput, cost: dict[str, Any]) -> Iterable[bytes]:
        """The closing events, the cost among them (`final`: every choice's finished output merged)."""

    def error(self, e: APIError) -> bytes:
        """The one event that ends a stream failing after its 200 (`errors.sse_error`)."""


@dataclass(slots=True, eq=False)
class RequestLifecycle:
    """One admitted request: what was decided about it, what it holds, and the steps that run it."""

    rt: Runtime
    request: Request
    request_id: str
    endpoint: str
    tenant: str
    session: str  # X-Stratum-Session-Id, else the user id, else the tenant: what pollution is judged over
    is_batch: bool  # a Message Batches request: runs below every interactive one
    cache_salt: str | None = None
    advise: bool = False  # the session pollutes the cache: answers carry advice
    controls: Controls = Controls()
    # the prompt, once prepared
    prompt: Prompt | None = None
    prompt_text: str = ""
    prompt_ids: list[list[int]] = field(default_factory=list)  # the prompts queued (several on /v1/completions)
    n: int = 1  # samples per prompt
    choices: dict[str, int] = field(default_factory=dict)  # engine request id -> choice index
    sampling: SamplingParams | None = None
    pins: list[tuple[int, float]] = field(default_factory=list)
    cache_breakpoint: int = 0  # prompt tokens up to the last cache_control breakpoint (0: none marked)
    is_context_capped: bool = False  # max_tokens was lowered to the room the context leaves (`_fit_context`)
    compression: dict[str, Any] | None = None
    # what it holds of the tenant's budget
    reserved: int = 0  # upper bounds of what runs for this request
    spent: int = 0  # measured cost of the engine work done for it before the answer (compressive summaries)
    budget_reset_at: float | None = None  # the budget window the reservations were made in
    # the engine's side, once submitted
    stream: RequestStream | RequestGroup | None = None
    first: RequestOutput | None = None  # the prefill's output, if it came within header_wait_s
    # its end
    cancelled: APIError | None = None  # ended by the server (a drain out of time)
    is_handed_over: bool = False  # a streamed response owns it now, and closes it
    is_ended: bool = False
    cpu0: float = field(default_factory=time.process_time)
    wall0: float = field(default_factory=time.perf_counter)

    # ---- admit ------------------------------------------------------------------------------------
    @classmethod
    def admit(cls, rt: Runtime, request: Request, endpoint: str, max_tokens: int | None,
              user_id: str | None) -> "RequestLifecycle":
        """Decide before any tokenization; from here on the request counts against the queue and is
        in `rt.active` until its end.

        Raises:
            EngineUnavailable: 503, draining or the engine is gone.
            CachePollution: 418, the session's policy is reject.
            RateLimited: 429, the tenant's budget cannot hold max_tokens and one prompt token.
            Overloaded: 529, the waiting queue is full.
        """
        if rt.draining:
            raise EngineUnavailable("the server is shutting down", headers={"connection": "close"})
        if not rt.engine.is_alive:
            raise EngineUnavailable(f"the engine is not running ({rt.engine.snapshot.error or 'stopped'})")
        check_control_headers(request)
        tenant = tenant_of(request, user_id)
        lc = cls(rt, request, request.state.request_id, endpoint, tenant,
                 session=request.headers.get("x-stratum-session-id") or user_id or tenant,
                 is_batch=bool(getattr(request.state, "batch_tenant", None)),
                 cache_salt=tenant if rt.isolate_tenants else None)
        if rt.pollution.is_polluted(lc.session):
            if rt.pollution.policy == "reject":
                rt.pollution.reset(lc.session)
                rt.metrics.rejections.labels("cache_pollution").inc()
                raise CachePollution(
                    "the last requests of this session missed the prefix cache and differ only in high-entropy values "
                    "(UUIDs, timestamps, ids); " + PollutionDetector.ADVICE,
                    headers={"x-stratum-advice": PollutionDetector.ADVICE}, extra={"stratum_reason": "cache_pollution"})
            lc.advise = True
        if rt.admission.is_enabled:
            least = 1 + (max_tokens or 0)
            d = rt.admission.check(tenant, least)
            if not d.is_admitted:
                raise over_budget(rt, tenant, endpoint, d, least,
                                  f"this request costs at least {least} tokens (max_tokens and its prompt)")
        try:
            rt.engine.admit(lc.request_id)
        except QueueFull as e:
            rt.metrics.rejections.labels("queue_full").inc()
            raise Overloaded(str(e), headers={"retry-after": str(e.retry_after_s),
                                              **ratelimit_headers(rt, tenant, endpoint)}) from None
        except EngineDeadError as e:
            raise EngineUnavailable(str(e)) from None
        rt.active[lc.request_id] = lc
        return lc

    async def __aenter__(self) -> "RequestLifecycle":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc is not None or not self.is_handed_over:
            await self.close()
        if isinstance(exc, APIError):  # refused after admission: the answer shows the budget as it now stands
            exc.headers = {**ratelimit_headers(self.rt, self.tenant, self.endpoint), **exc.headers}

    # ---- prepare ----------------------------------------------------------------------------------
    async def prepare(self, chat: ChatInput | None, sampling: SamplingParams, default_max: bool = False, n: int = 1,
                      raw: list[str | list[int]] | None = None, fit_context: bool = False) -> None:
        """Controls, compression, the prompt (in worker threads), checks, and the reservation.

        Args:
            chat: the conversation; None with `raw`, completions' prompts (texts or token ids) used as they are.
            default_max: max_tokens was not given: lower the default to what the context leaves.
            n: samples per prompt.
            fit_context: the Messages API's context rule (`_fit_context`).
        Raises:
            InvalidRequest: the request can never run on this engine.
            RateLimited: its upper bound of cost does not fit in the tenant's budget.
        """
        engine = self.rt.engine
        prompts = None
        if chat is None:
            self.controls = controls_of(self.request, "", self.is_batch)
            prompts = [list(p) if isinstance(p, list) else await asyncio.to_thread(engine.tokenizer.encode_prompt, p)
                       for p in raw]
            prompt, self.prompt_text = Prompt(prompts[0]), "\n".join(p for p in raw if isinstance(p, str))
        else:
            self.controls = controls_of(self.request, chat.system_text, self.is_batch)
            if self.request.headers.get("x-stratum-context-mode", "").strip().lower() == "compressive":
                chat = replace(chat, messages=await self._compress(chat.messages))
            prompt = await asyncio.to_thread(build_prompt, engine.chat_template, chat)
            self.prompt_text = chat.text
        sampling.grammar = prompt.grammar
        self.prompt, self.prompt_ids, self.n, self.sampling = prompt, prompts or [prompt.token_ids], n, sampling
        if default_max:
            sampling.max_tokens = max(1, min(sampling.max_tokens,
                                             engine.config.max_model_len - max(map(len, self.prompt_ids))))
        if fit_context:
            self._fit_context(len(prompt.token_ids), sampling)
        for ids in self.prompt_ids:
            check_request(self.rt, Prompt(ids, tool_names=prompt.tool_names, tool_format=prompt.tool_format,
                                          parallel_calls=prompt.parallel_calls), sampling)
        self._reserve(sum(map(len, self.prompt_ids)), len(self.prompt_ids) * n * sampling.max_tokens)
        if chat is not None and chat.pinned:
            self.pins = await asyncio.to_thread(pins_for, engine.chat_template, chat.messages, chat.pinned,
                                                prompt.template_tools)
            self.cache_breakpoint = max(length for length, _ in self.pins)

    def _reserve(self, num_prompt_tokens: int, max_tokens: int, what: str = "this request") -> None:
        """Reserve an upper bound of what running a prompt can cost, against the tenant's budget: every
        prompt token (whether or not the cache will serve it) and every token it may generate.

        Raises:
            RateLimited: the bound does not fit in what the tenant has left in this window.
        """
        rt = self.rt
        if not rt.admission.is_enabled:
            return
        bound = num_prompt_tokens + max_tokens
        d = rt.admission.admit(self.tenant, bound)
        if not d.is_admitted:
            raise over_budget(rt, self.tenant, self.endpoint, d, bound,
                              f"{what} may cost up to {bound} tokens ({num_prompt_tokens} prompt tokens + "
                              f"max_tokens {max_tokens})")
        self.reserved += bound
        if self.budget_reset_at is None:
            self.budget_reset_at = d.reset_at

    def _fit_context(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """The Messages API's rule: a prompt longer than the context is a 400 naming both counts, in
        Anthropic's words; a max_tokens beyond what the context leaves is lowered to it, and an answer
        that fills the context ends with stop_reason model_context_window_exceeded (`is_context_capped`).

        Raises:
            InvalidRequest: the prompt leaves no room in the context.
        """
        config = self.rt.engine.config
        limit = config.max_model_len
        if num_prompt_tokens > limit:
            raise InvalidRequest(f"prompt is too long: {num_prompt_tokens} tokens > {limit} maximum")
        room = limit - num_prompt_tokens
        if sampling.max_tokens > room and room == 0:
            raise InvalidRequest(f"prompt is too long: {num_prompt_tokens} tokens leave no room for output in the "
                                 f"{limit}-token context")
        # one sequence holds at most the KV pool (smaller than the context while a cold start serves
        # on the PyTorch step); a prompt beyond the pool is check_request's 400
        room = min(room, config.num_kv_blocks * config.block_size - num_prompt_tokens)
        if sampling.max_tokens > room > 0:
            sampling.max_tokens = room
            self.is_context_capped = True

    async def _compress(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """X-Stratum-Context-Mode: compressive. The longest user message, when the prompt is long, is cut
        into chunks that the same engine summarises (all chunks batched together); the answer is then
        generated from the summaries. What the summaries cost is measured into `spent`."""
        rt = self.rt
        template, tokenizer = rt.engine.chat_template, rt.engine.tokenizer
        original = len(await asyncio.to_thread(template.encode, messages))
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if original <= rt.compress_threshold_tokens or not users:
            self.compression = {"applied": False, "original_prompt_tokens": original,
                                "threshold_tokens": rt.compress_threshold_tokens}
            return messages
        target = max(users, key=lambda i: len(messages[i]["content"]))
        ids = await asyncio.to_thread(tokenizer.encode, messages[target]["content"])
        size = rt.compress_chunk_tokens

        def summary_prompts() -> list[list[int]]:  # tokenizer work, off the event loop like the rest
            return [template.encode([
                {"role": "system", "content": "Summarize the user's text in two or three sentences. Keep names, numbers "
                                              "and facts."},
                {"role": "user", "content": tokenizer.decode(ids[i : i + size])},
            ]) for i in range(0, len(ids), size)]

        prompts = await asyncio.to_thread(summary_prompts)
        params = SamplingParams(max_tokens=rt.compress_summary_tokens, temperature=0.0)
        self._reserve(sum(len(p) for p in prompts), len(prompts) * params.max_tokens, "its compression")

        async def summarise(i: int, prompt: list[int]) -> str:
            text = ""
            stream = rt.engine.submit(prompt, params, request_id=f"{self.request_id}-summary-{i}",
                                      priority=self.controls.priority, cache_salt=self.cache_salt)
            try:
                async for out in stream:
                    text = out.text
                    if out.finished:
                        if out.stats is not None:
                            self.spent += measured_cost(usage_of(out))
                        break
            finally:
                await stream.close()
            return text.strip()

        summaries = await asyncio.gather(*(summarise(i, p) for i, p in enumerate(prompts)))
        compressed = [dict(m) for m in messages]
        compressed[target]["content"] = "Summary of the provided text, part by part:\n" + "\n".join(
            f"{i + 1}. {s}" for i, s in enumerate(summaries))
        after = len(await asyncio.to_thread(template.encode, compressed))
        self.compression = {"applied": True, "original_prompt_tokens": original, "compressed_prompt_tokens": after,
                            "ratio": round(after / original, 4), "chunks": len(prompts)}
        return compressed

    # ---- submit -----------------------------------------------------------------------------------
    async def submit(self) -> None:
        """Queue the prepared request in the engine, then wait up to header_wait_s for its prefill, so
        a stream's headers can carry its figures. Warm-up (max_tokens 0) and aggressive mode pin what
        they cache; n > 1 queues n samples of each prompt, each with its own seed (seed + i when the
        request gives one), and sample j > 0 forks sample 0 of its prompt.

        Raises:
            APIError: the server ended it before it ran (a drain), or the engine refused or failed it.
        """
        rt, prompt, sampling = self.rt, self.prompt, self.sampling
        policy = self.controls.cache_policy
        if self.controls.cache_mode == "aggressive":
            policy = CachePolicy(pin_ttl_s=rt.aggressive_ttl_s, pin_output=True)
        elif sampling.max_tokens == 0 and policy.write and sampling.prompt_logprobs is None:
            policy = CachePolicy(pin_ttl_s=rt.warmup_ttl_s)
        if policy.pin_ttl_s:  # asked to be cached, as a cache_control breakpoint on the whole prompt asks
            self.cache_breakpoint = len(prompt.token_ids)
        marker = None
        if prompt.tool_names:
            marker = "" if prompt.is_forced_tool else prompt.tool_format.marker
        if self.cancelled is not None:
            raise self.cancelled
        options = dict(priority=self.controls.priority, cache_policy=policy, cache_salt=self.cache_salt,
                       tool_marker=marker, pin_prefixes=self.pins, low_latency=self.controls.is_low_latency)
        n, prompts = self.n, self.prompt_ids
        total = len(prompts) * n
        self.choices = {self.request_id if i == 0 else f"{self.request_id}.{i}": i for i in range(total)}
        if total == 1:
            self.stream = rt.engine.submit(prompt.token_ids, sampling, request_id=self.request_id, **options)
        else:
            samplings = [replace(sampling, seed=None if sampling.seed is None else sampling.seed + i % n)
                         for i in range(total)]
            rids = list(self.choices)
            forks = [rids[i - i % n] if i % n else None for i in range(total)]
            self.stream = rt.engine.submit_group([prompts[i // n] for i in range(total)], samplings, rids, forks,
                                                 **options)
        try:
            self.first = await self.stream.next(rt.header_wait_s)
        except StopAsyncIteration:
            self.first = None
        except Exception as e:
            raise as_api_error(e) from None

    # ---- outputs ----------------------------------------------------------------------------------
    async def outputs(self, wait_s: float) -> AsyncIterator[RequestOutput | None]:
        """The outputs up to and including the last finished one (of every choice), from the prefill's
        on; None whenever wait_s passes without one.

        Raises:
            APIError: the engine failed the request, or its stream ended without a finished output.
        """
        out, self.first = self.first, None
        left = len(self.choices)
        while True:
            if out is None:
                try:
                    out = await self.stream.next(timeout=wait_s)
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

    async def events(self, renderer: Renderer) -> AsyncIterator[bytes]:
        """The one stream loop: the renderer's opening events, its events for each output (its keep-alive
        whenever ping_interval_s passes without one), then `finish` and its closing events with the
        cost. After the 200 a failure becomes the renderer's one error event, and the stream ends."""
        try:
            for event in renderer.start(self.first):
                yield event
            finals: dict[int, RequestOutput] = {}
            async for out in self.outputs(self.rt.ping_interval_s):
                if out is None:
                    yield renderer.ping
                    continue
                choice = self.choices[out.request_id]
                if out.finished:
                    finals[choice] = out
                for event in renderer.output(out, choice):
                    yield event
            final = merge([finals[i] for i in range(len(finals))], self.n)
            _, cost = self.finish(final)
            for event in renderer.end(final, cost):
                yield event
        except Exception as e:
            if not isinstance(e, APIError):
                log.exception("stream failed")
            yield renderer.error(as_api_error(e))

    async def collect(self) -> list[RequestOutput]:
        """Read the request to its end, without streaming; a client that disconnects aborts it (checked
        every _DISCONNECT_CHECK_S, while tokens flow too).

        Returns:
            the finished output of each choice, in choice order.
        """
        finals: dict[int, RequestOutput] = {}
        next_check = time.monotonic() + _DISCONNECT_CHECK_S
        async for out in self.outputs(_DISCONNECT_CHECK_S):
            if out is not None and out.finished:
                finals[self.choices[out.request_id]] = out
            if len(finals) < len(self.choices) and time.monotonic() >= next_check:
                next_check = time.monotonic() + _DISCONNECT_CHECK_S
                if await self.request.is_disconnected():
                    raise EngineUnavailable("client disconnected")
        return [finals[i] for i in range(len(finals))]

    async def respond(self, renderer: Renderer, is_stream: bool) -> Response:
        """The response: a stream of the renderer's events, which takes the request over (and closes it
        however it ends, a client gone before the first event too), or the body of its finished outputs."""
        if is_stream:
            self.is_handed_over = True
            return _EventStream(self.events(renderer), self.close, media_type="text/event-stream",
                                headers={"cache-control": "no-cache", **self.early_headers()})
        outs = await self.collect()
        headers, _ = self.finish(merge(outs, self.n))
        return JSONResponse(renderer.body(outs), headers=headers)

    # ---- telemetry ----------------------------------------------------------------------------------
    def admitted_usage(self) -> dict[str, int]:
        """Usage before prefill has finished: the prompt, and what the engine said its cache will serve
        when it accepted the request (every prompt token as input if it has not said yet)."""
        n = len(self.prompt.token_ids) if self.prompt is not None else 0
        cached = min(n, (self.stream.expected_cached_tokens if self.stream is not None else None) or 0)
        block = self.rt.engine.config.block_size
        created = max(0, min(self.cache_breakpoint, n) // block * block - cached) if self.cache_breakpoint else 0
        return {"input_tokens": n - cached - created, "output_tokens": 0, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": created}

    def early_headers(self) -> dict[str, str]:
        """Headers a stream can send after prefill: cost so far, the engine mode, the tenant's budget."""
        out = self.first
        headers = {"x-stratum-mode": out.mode if out is not None else "normal",
                   "x-stratum-cache-mode": self.controls.cache_mode, **self._replica_header()}
        if out is not None and out.stats is not None:
            headers["x-stratum-cost"] = CostFields.from_stats(out.stats).header()
        if self.advise:
            headers["x-stratum-advice"] = PollutionDetector.ADVICE
        headers.update(ratelimit_headers(self.rt, self.tenant, self.endpoint))
        return headers

    def _replica_header(self) -> dict[str, str]:
        """Which replica served the request, when the engine is a set of replicas."""
        replica = self.stream.replica if self.stream is not None else None
        return {"x-stratum-replica": replica} if replica else {}

    # ---- finish, close ------------------------------------------------------------------------------
    def finish(self, final: RequestOutput) -> tuple[dict[str, str], dict[str, Any]]:
        """Telemetry for the finished request (`final`: its choices merged): metrics, and the budget
        settled at its measured cost (`_end`).

        Returns:
            (response headers, the cost event's body: {"cost", "header", "final_cost_estimate", "mode",
            "cache_written_tokens", and "trace" when asked}).
        """
        rt, controls, stats = self.rt, self.controls, final.stats
        cost = CostFields.from_stats(stats)
        usage = usage_of(final, self.cache_breakpoint)
        usd = rt.pricing.price(cost, usage)
        headers = {"x-stratum-cost": cost.header(), "x-stratum-mode": final.mode,
                   "x-stratum-cache-mode": controls.cache_mode, **self._replica_header()}
        if self.advise:
            headers["x-stratum-advice"] = PollutionDetector.ADVICE
            rt.metrics.advice.inc()
        body: dict[str, Any] = {"cost": cost.as_dict(), "header": headers["x-stratum-cost"],
                                "final_cost_estimate": round(usd, 10), "mode": final.mode,
                                "cache_written_tokens": stats.num_cache_written_tokens}
        if controls.debug:
            extra: dict[str, Any] = {"engine_mode": final.mode, "cache_mode": controls.cache_mode,
                                     "priority": controls.priority, "low_latency": controls.is_low_latency and
                                     rt.engine.info.kernel_choices.get("low_latency_lm_head") is not None,
                                     "low_latency_asked": controls.is_low_latency}
            if self.compression is not None:
                extra["compression"] = self.compression
            if "x-stratum-replica" in headers:
                extra["replica"] = headers["x-stratum-replica"]
            hardware = None
            if controls.debug == "full":
                hardware = hardware_view(rt.engine.info, rt.engine.snapshot, time.process_time() - self.cpu0,
                                         time.perf_counter() - self.wall0)
            trace = encode_trace(build_trace(stats, cost, usage, rt.pricing, extra, hardware))
            headers["x-stratum-trace"] = trace
            body["trace"] = trace
        rt.metrics.observe_request(self.endpoint, rt.model_name, stats, cost, usd, self.tenant)
        self._end(measured_cost(usage))
        headers.update(ratelimit_headers(rt, self.tenant, self.endpoint))
        rt.pollution.record(self.session, cost.cache_hit_ratio, self.prompt_text)
        return headers, body

    def cancel(self, error: APIError) -> None:
        """End the request from the server's side (a drain out of time): unsubmitted, it will not be
        submitted; running, the engine aborts it and its reader gets `error` after what it has not read."""
        self.cancelled = error
        if self.stream is not None:
            self.stream.cancel(error)

    async def close(self) -> None:
        """However the request ended (answered, refused after admission, failed, disconnected, cancelled):
        its engine stream is closed, which aborts it in the engine if it still runs (its blocks are
        freed), and it is released and settled (`_end`). Idempotent."""
        if self.stream is not None:
            await self.stream.close()
        self._end(0)

    def _end(self, run_cost: int) -> None:
        """The one place a request is released and settled, once: it leaves the waiting queue and
        `rt.active`, and its reservations are replaced by its measured cost: what was spent before its
        answer (compressive summaries) plus `run_cost`, what its own run measured (0 when it did not
        finish: an unfinished run is not charged)."""
        if self.is_ended:
            return
        self.is_ended = True
        rt = self.rt
        rt.engine.release(self.request_id)
        rt.active.pop(self.request_id, None)
        if self.reserved:
            rt.admission.settle(self.tenant, self.reserved, self.spent + run_cost, self.budget_reset_at)


class _EventStream(StreamingResponse):
    """A streamed response that runs `on_close` however it ends, a client gone before its first event
    too (when the events generator's own cleanup never runs)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
