"""One request on the serving side, owned from admission to its end by a `RequestLifecycle`.

    admit    503 draining, 418 pollution, 429 cost, 529 queue: before any tokenization
    prepare  controls, the prompt (chat template; `compression`; cache_control pins), `sampling` fitted to
             it, and its upper bound of cost reserved against the tenant's budget (`budget.Reservation`)
    submit   the engine stream (prefix-cache blocks salted with the tenant when tenants are isolated)
    outputs  the engine's outputs to the last one, paced; `events` is the one stream loop over them
    finish   telemetry (`report`), the reservation settled at the measured cost
    close    however the request ended; `_end` is the one place it is released and settled

A route runs a request as `async with RequestLifecycle.admit(...) as lc:`; leaving the block closes
it, unless a streamed response has taken it over (`respond`), and then the response's own end does.
The API modules are `render.Renderer`s over its `render_context`: they map outputs to their wire format
and hold no resource.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stratum.engine.client import QueueFull, RequestGroup, RequestStream
from stratum.engine.outputs import EngineDeadError, RequestOutput
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import SamplingParams
from stratum.server import sampling as fit
from stratum.server.auth import tenant_of
from stratum.server.budget import Reservation
from stratum.server.chat import ChatInput, Prompt, build_prompt, pins_for
from stratum.server.compression import compress
from stratum.server.controls import Controls, check_control_headers, controls_of
from stratum.server.errors import APIError, ClientDisconnected, EngineUnavailable, Overloaded, as_api_error
from stratum.server.render import RenderContext, Renderer
from stratum.server.report import Facts, Report, early_headers, final_report
from stratum.server.runtime import Runtime
from stratum.server.usage import merge, usage_of

log = logging.getLogger("stratum.server")

# A request read without streaming checks this often whether its client is still there.
_DISCONNECT_CHECK_S = 0.5


@dataclass(frozen=True, slots=True)
class Admitted:
    """Who a request is, decided at admission."""

    tenant: str
    session: str  # X-Stratum-Session-Id, else the user id, else the tenant: what pollution is judged over
    is_batch: bool  # a Message Batches request: runs below every interactive one
    cache_salt: str | None  # the tenant, when tenants' prefix caches are isolated
    is_advised: bool  # the session pollutes the cache: answers carry advice


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to queue: its prompts and what they run with."""

    prompt: Prompt  # the first prompt, with its tools and grammar (every prompt shares them)
    prompt_ids: tuple[list[int], ...]  # the prompts queued (several on /v1/completions)
    prompt_text: str  # what the pollution detector reads
    sampling: SamplingParams
    n: int  # samples per prompt
    cache_policy: CachePolicy
    pins: tuple[tuple[int, float], ...]  # (prefix length, ttl) of cache_control breakpoints
    cache_breakpoint: int  # prompt tokens up to the last breakpoint (0: none marked)
    is_context_capped: bool  # max_tokens was lowered to the room the context leaves (`sampling.fit_to_context`)
    compression: dict[str, Any] | None  # the compressive mode's report, when it was asked for


@dataclass(slots=True, eq=False)
class RequestLifecycle:
    """One admitted request: what was decided about it, what it holds, and the steps that run it."""

    rt: Runtime
    request: Request
    request_id: str
    endpoint: str
    who: Admitted
    reservation: Reservation
    controls: Controls = Controls()
    prepared: Prepared | None = None
    # the engine's side, once submitted
    stream: RequestStream | RequestGroup | None = None
    first: RequestOutput | None = None  # the prefill's output, if it came within header_wait_s
    choices: dict[str, int] = field(default_factory=dict)  # engine request id -> choice index
    # its end
    cancelled: APIError | None = None  # ended by the server (a drain out of time)
    is_handed_over: bool = False  # a streamed response owns it now, and closes it
    stream_error: APIError | None = None  # what ended its stream after the 200
    is_ended: bool = False
    cpu0: float = field(default_factory=time.process_time)
    wall0: float = field(default_factory=time.perf_counter)

    @property
    def is_batch(self) -> bool:
        return self.who.is_batch

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
        session = request.headers.get("x-stratum-session-id") or user_id or tenant
        is_polluted = rt.pollution.is_polluted(session)
        if is_polluted and rt.pollution.policy == "reject":
            rt.metrics.rejections.labels("cache_pollution").inc()
            raise rt.pollution.refuse(session)
        who = Admitted(tenant, session, is_batch=bool(getattr(request.state, "batch_tenant", None)),
                       cache_salt=tenant if rt.isolate_tenants else None, is_advised=is_polluted)
        reservation = Reservation(rt.admission, tenant, endpoint, rt.metrics)
        reservation.check(max_tokens or 0)
        lc = cls(rt, request, request.state.request_id, endpoint, who, reservation)
        try:
            rt.engine.take_queue_slot(lc.request_id)
        except QueueFull as e:
            rt.metrics.rejections.labels("queue_full").inc()
            raise Overloaded(str(e), headers={"retry-after": str(e.retry_after_s), **reservation.headers()}) from None
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
            exc.headers = {**self.reservation.headers(), **exc.headers}

    # ---- prepare ----------------------------------------------------------------------------------
    async def prepare(self, chat: ChatInput | None, sampling: SamplingParams, default_max: bool = False, n: int = 1,
                      raw: list[str | list[int]] | None = None, fit_context: bool = False) -> None:
        """Controls, compression, the prompt (in worker threads), the sampling fitted to it, checks, and
        the reservation.

        Args:
            chat: the conversation; None with `raw`, completions' prompts (texts or token ids) used as they are.
            sampling: what the request asked for, over the server's defaults (`sampling.SamplingDefaults`).
            default_max: max_tokens was not given: lower the default to what the context leaves.
            n: samples per prompt.
            fit_context: the Messages API's context rule (`sampling.fit_to_context`).
        Raises:
            InvalidRequest: the request can never run on this engine.
            RateLimited: its upper bound of cost does not fit in the tenant's budget.
        """
        rt, engine = self.rt, self.rt.engine
        compression = None
        if chat is None:
            self.controls = controls_of(self.request, "", self.is_batch)
            prompts = [list(p) if isinstance(p, list) else await asyncio.to_thread(engine.tokenizer.encode_prompt, p)
                       for p in raw]
            prompt, text = Prompt(prompts[0]), "\n".join(p for p in raw if isinstance(p, str))
        else:
            self.controls = controls_of(self.request, chat.system_text, self.is_batch)
            if self.controls.is_compressive:
                messages, compression = await compress(engine, rt.compression, chat.messages, self.request_id,
                                                       self.controls.priority, self.who.cache_salt, self.reservation)
                chat = replace(chat, messages=messages)
            prompt = await asyncio.to_thread(build_prompt, engine.chat_template, chat, rt.parse_thought)
            prompts, text = [prompt.token_ids], chat.text
        sampling = fit.for_prompt(sampling, prompt)
        if default_max:
            sampling = fit.default_max_to_context(sampling, engine.config, max(map(len, prompts)))
        is_capped = False
        if fit_context:
            sampling, is_capped = fit.fit_to_context(sampling, engine.config, len(prompt.token_ids))
        fit.check(engine, prompts, sampling)
        self.reservation.reserve(sum(map(len, prompts)), len(prompts) * n * sampling.max_tokens)
        pins: list[tuple[int, float]] = []
        if chat is not None and chat.pinned:
            pins = await asyncio.to_thread(pins_for, engine.chat_template, chat.messages, chat.pinned,
                                           prompt.template_tools)
        policy = self.controls.cache_policy(sampling, rt.aggressive_ttl_s, rt.warmup_ttl_s)
        # a pinned prompt is asked to be cached, as a cache_control breakpoint on the whole prompt asks
        breakpoint = len(prompt.token_ids) if policy.pin_ttl_s else max((length for length, _ in pins), default=0)
        self.prepared = Prepared(prompt, tuple(prompts), text, sampling, n, policy, tuple(pins), breakpoint,
                                 is_capped, compression)

    def render_context(self, model: str) -> RenderContext:
        """What the request's renderer knows of it (`model`: the name the client sent)."""
        p = self.prepared
        return RenderContext(self.request_id, self.endpoint, model, p.prompt, p.prompt_ids, p.n, p.cache_breakpoint,
                             p.is_context_capped, self.rt.thoughts)

    # ---- submit -----------------------------------------------------------------------------------
    async def submit(self) -> None:
        """Queue the prepared request in the engine, then wait up to header_wait_s for its prefill, so
        a stream's headers can carry its figures. n > 1 queues n samples of each prompt, each with its
        own seed (seed + i when the request gives one), and sample j > 0 forks sample 0 of its prompt.

        Raises:
            APIError: the server ended it before it ran (a drain), or the engine refused or failed it.
        """
        p, engine = self.prepared, self.rt.engine
        if self.cancelled is not None:
            raise self.cancelled
        marker = None
        if p.prompt.tool_names:
            marker = "" if p.prompt.is_forced_tool else p.prompt.tool_format.marker
        reasoning = p.prompt.reasoning
        if reasoning is not None and reasoning.budget is None and self.rt.reasoning_budget is not None:
            reasoning = replace(reasoning, budget=self.rt.reasoning_budget)
        options = dict(priority=self.controls.priority, cache_policy=p.cache_policy, cache_salt=self.who.cache_salt,
                       tool_marker=marker, pin_prefixes=list(p.pins), low_latency=self.controls.is_low_latency,
                       reasoning=reasoning)
        n, total = p.n, len(p.prompt_ids) * p.n
        self.choices = {self.request_id if i == 0 else f"{self.request_id}.{i}": i for i in range(total)}
        if total == 1:
            self.stream = engine.submit(p.prompt.token_ids, p.sampling, request_id=self.request_id, **options)
        else:
            seed = p.sampling.seed
            samplings = [replace(p.sampling, seed=None if seed is None else seed + i % n) for i in range(total)]
            rids = list(self.choices)
            forks = [rids[i - i % n] if i % n else None for i in range(total)]
            self.stream = engine.submit_group([p.prompt_ids[i // n] for i in range(total)], samplings, rids, forks,
                                              **options)
        try:
            self.first = await self.stream.next(self.rt.header_wait_s)
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
                left -= 1
                if not left:
                    return
            out = None

    async def events(self, renderer: Renderer) -> AsyncIterator[bytes]:
        """The one stream loop: the renderer's opening events, its events for each output (its keep-alive
        whenever ping_interval_s passes without one), then `finish` and its closing events with the
        cost. After the 200 a failure becomes the renderer's one error event, and the stream ends."""
        try:
            for event in renderer.start(self.first, self.admitted_usage()):
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
            final = merge([finals[i] for i in range(len(finals))], self.prepared.n)
            for event in renderer.end(final, self.finish(final).cost):
                yield event
        except Exception as e:
            if not isinstance(e, APIError):
                log.exception("stream failed")
            error = as_api_error(e)
            self.stream_error = error
            self.rt.metrics.observe_error(self.endpoint, error.status)  # after its 200: counted by what it was
            yield renderer.error(error)

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
                    raise ClientDisconnected("client disconnected")
        return [finals[i] for i in range(len(finals))]

    async def respond(self, renderer: Renderer, is_stream: bool) -> Response:
        """The response: a stream of the renderer's events, which takes the request over (and closes it
        however it ends, a client gone before the first event too), or the body of its finished outputs."""
        if is_stream:
            self.is_handed_over = True
            return _EventStream(self.events(renderer), self.close, media_type="text/event-stream",
                                headers={"cache-control": "no-cache", **self.early_headers()})
        outs = await self.collect()
        return JSONResponse(renderer.body(outs), headers=self.finish(merge(outs, self.prepared.n)).headers)

    # ---- telemetry ----------------------------------------------------------------------------------
    def admitted_usage(self) -> dict[str, int]:
        """Usage before prefill has finished: the prompt, and what the engine said its cache will serve
        when it accepted the request (every prompt token as input if it has not said yet)."""
        p = self.prepared
        n = len(p.prompt.token_ids) if p is not None else 0
        cached = min(n, (self.stream.expected_cached_tokens if self.stream is not None else None) or 0)
        block = self.rt.engine.config.block_size
        breakpoint = p.cache_breakpoint if p is not None else 0
        created = max(0, min(breakpoint, n) // block * block - cached) if breakpoint else 0
        return {"input_tokens": n - cached - created, "output_tokens": 0, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": created}

    def early_headers(self) -> dict[str, str]:
        """Headers a stream can send after prefill: cost so far, the engine mode, the tenant's budget."""
        return {**early_headers(self.first, self.facts()), **self.reservation.headers()}

    def facts(self) -> Facts:
        p = self.prepared
        replica = self.stream.replica if self.stream is not None else None
        return Facts(self.endpoint, self.who.tenant, self.controls, replica, self.who.is_advised,
                     p.compression if p is not None else None)

    # ---- finish, close ------------------------------------------------------------------------------
    def finish(self, final: RequestOutput) -> Report:
        """Telemetry for the finished request (`final`: its choices merged): the cost headers, trace and
        metrics (`report`), and the reservation settled at its measured cost (`_end`)."""
        p = self.prepared
        usage = usage_of(final, p.cache_breakpoint)
        done = final_report(self.rt, final, usage, self.facts(), time.process_time() - self.cpu0,
                            time.perf_counter() - self.wall0)
        self._end(usage)
        self.rt.pollution.record(self.who.session, done.cache_hit_ratio, p.prompt_text)
        return done.with_headers(self.reservation.headers())

    def cancel(self, error: APIError) -> None:
        """End the request from the server's side (a drain out of time): unsubmitted, it will not be
        submitted; running, the engine aborts it and its reader gets `error` after what it has not read."""
        self.cancelled = error
        if self.stream is not None:
            self.stream.cancel(error)

    async def close(self) -> None:
        """However the request ended (answered, refused after admission, failed, disconnected, cancelled):
        its engine stream is closed, which aborts it in the engine if it still runs (its blocks are
        freed), and it is released and settled (`_end`). Idempotent. A stream that ends neither finished
        nor failed nor cancelled was closed by its client: counted as 499."""
        if self.is_handed_over and not self.is_ended and self.stream_error is None and self.cancelled is None:
            self.rt.metrics.observe_error(self.endpoint, ClientDisconnected.status)
        if self.stream is not None:
            await self.stream.close()
        self._end(None)

    def _end(self, usage: dict[str, int] | None) -> None:
        """The one place a request is released and settled, once: it leaves the waiting queue and
        `rt.active`, and its reservation is settled (`usage`: what its own run measured; None when it
        did not finish: an unfinished run is not charged)."""
        if self.is_ended:
            return
        self.is_ended = True
        self.rt.engine.release(self.request_id)
        self.rt.active.pop(self.request_id, None)
        self.reservation.settle(usage)


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
