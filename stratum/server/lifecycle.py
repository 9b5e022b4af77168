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

from stratum.engine.client import EngineClient, QueueFull, RequestGroup, RequestStream
from stratum.engine.outputs import EngineDeadError, MetaState, RequestOutput, RequestStats
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import SamplingParams
from stratum.server import sampling as fit
from stratum.server.auth import tenant_of
from stratum.server.budget import Reservation
from stratum.server.chat import ChatInput, Prompt, build_prompt, pins_for
from stratum.server.compression import compress
from stratum.server.controls import Controls, check_control_headers, controls_of
from stratum.server.errors import (APIError, ClientDisconnected, EngineUnavailable, InvalidRequest, Overloaded,
                                   as_api_error)
from stratum.server.models import ServedModel
from stratum.server.policy import Matcher, OutputScreen, Rule, mask_messages, mask_text, prompt_texts, screen_prompt
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
    refusal: Rule | None = None  # a content policy rule blocked the prompt: nothing is submitted
    task: str = "generate"  # or "embed", "score": prefill only, each prompt's output a vector (`server.embeddings`)


class _Admission:
    """`RequestLifecycle.admit` as an async context: the bounded wait for a restarting engine, then the
    admission itself; the lifecycle it admitted is what the block gets, and what leaving it closes."""

    def __init__(self, decide, rt: Runtime, engine: EngineClient):
        self.decide, self.rt, self.engine = decide, rt, engine
        self.lc: RequestLifecycle | None = None

    async def __aenter__(self) -> "RequestLifecycle":
        await _engine_back(self.engine, self.rt.restart_wait_s)
        self.lc = self.decide()
        return self.lc

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.lc.__aexit__(exc_type, exc, tb)


async def _engine_back(engine: EngineClient, wait_s: float, poll_s: float = 0.05) -> None:
    """While the engine's supervisor replaces a dead engine, wait for the new one, up to wait_s."""
    sup = engine.supervision
    if sup is None or engine.is_alive:
        return
    deadline = time.monotonic() + wait_s
    while not engine.is_alive and engine.supervision.state == "restarting" and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)


def held_model(request: Request, rt: Runtime) -> ServedModel:
    """The model the request holds (`models.hold_model`, when its body named it); else the default, loaded."""
    served = getattr(request.state, "held_model", None)
    if served is None:
        served = rt.models.default
        if served.engine is None:
            raise EngineUnavailable(f"model {served.name!r} is not loaded")
    return served


@dataclass(slots=True, eq=False)
class RequestLifecycle:
    """One admitted request: what was decided about it, what it holds, and the steps that run it."""

    rt: Runtime
    request: Request
    request_id: str
    endpoint: str
    who: Admitted
    reservation: Reservation
    model: ServedModel  # the model it runs on, held until its response is sent (`models.hold_model`)
    client: EngineClient  # that model's engine at admission (a model started again later has a new one)
    controls: Controls = Controls()
    prepared: Prepared | None = None
    # the engine's side, once submitted
    stream: RequestStream | RequestGroup | None = None
    first: RequestOutput | None = None  # the prefill's output, if it came within header_wait_s
    answer_policy: Matcher | None = None  # the content policy's answer rules for this tenant
    screens: dict[int, OutputScreen] = field(default_factory=dict)  # choice -> its answer's screen
    policy_s: float = 0.0  # the prompt's screening time
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

    @property
    def engine(self) -> EngineClient:
        """The engine of the model the request named (each served model has its own)."""
        return self.client

    # ---- admit ------------------------------------------------------------------------------------
    @classmethod
    def admit(cls, rt: Runtime, request: Request, endpoint: str, max_tokens: int | None,
              user_id: str | None) -> "_Admission":
        """`async with` it: the request, decided before any tokenization; from there on it counts
        against the queue and is in `rt.active` until its end. While a dead engine is being replaced
        it waits for the new one, up to `rt.restart_wait_s`.

        Raises (on entering):
            EngineUnavailable: 503, draining or the engine is gone (with retry-after while it restarts).
            CachePollution: 418, the session's policy is reject.
            RateLimited: 429, the tenant's budget cannot hold max_tokens and one prompt token.
            Overloaded: 529, the waiting queue is full.
        """
        model = held_model(request, rt)
        return _Admission(lambda: cls._admit(rt, request, endpoint, max_tokens, user_id, model), rt, model.engine)

    @classmethod
    def _admit(cls, rt: Runtime, request: Request, endpoint: str, max_tokens: int | None,
               user_id: str | None, model: ServedModel) -> "RequestLifecycle":
        if rt.draining:
            raise EngineUnavailable("the server is shutting down", headers={"connection": "close"})
        engine = model.engine
        if not engine.is_alive:
            sup = engine.supervision
            if sup is not None and sup.state == "restarting":
                raise EngineUnavailable(f"the engine is restarting after its death ({sup.last_death}); retry "
                                        f"in {sup.retry_after_s}s", headers={"retry-after": str(sup.retry_after_s)})
            raise EngineUnavailable(f"the engine is not running ({engine.snapshot.error or 'stopped'})")
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
        lc = cls(rt, request, request.state.request_id, endpoint, who, reservation, model, engine)
        try:
            engine.take_queue_slot(lc.request_id)
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
                      raw: list[str | list[int]] | None = None, fit_context: bool = False,
                      openai_limit: fit.OpenAILimit | None = None, like: Prompt | None = None) -> None:
        """Controls, compression, the prompt (in worker threads), the sampling fitted to it, checks, and
        the reservation.

        Args:
            chat: the conversation; None with `raw`, completions' prompts (texts or token ids) used as they are.
            sampling: what the request asked for, over the server's defaults (`sampling.SamplingDefaults`).
            default_max: max_tokens was not given: lower the default to what the context leaves.
            n: samples per prompt.
            fit_context: the Messages API's context rule (`sampling.fit_to_context`).
            openai_limit: OpenAI's context rule, naming the request's fields (`sampling.check_openai_context`).
            like: with `raw`, a prompt whose reading rules (grammar, tools, thought) the raw prompt keeps
                (Ollama's `context` continued, or a raw prompt with a `format`).
        Raises:
            InvalidRequest: the request can never run on this engine (an encoder generates nothing).
            RateLimited: its upper bound of cost does not fit in the tenant's budget.
        """
        rt, engine = self.rt, self.engine
        if "generate" not in engine.info.tasks:  # an encoder: embeddings or scores only (`server.embeddings`)
            words = {"embed": "embeddings", "score": "rerank scores"}
            serves = " and ".join(words.get(t, t) for t in engine.info.tasks)
            raise InvalidRequest(f"the model {self.model.name!r} does not generate text: it serves {serves} only",
                                 param="model", code="model_not_supported")
        compression = None
        refusal, chat, raw = await self._screen_prompt(chat, raw)
        if self.answer_policy is not None and sampling.logprobs is not None:  # tokens would show what is held back
            raise InvalidRequest("logprobs are not available where a content policy screens answers")
        if refusal is not None:
            self.controls = controls_of(self.request, chat.system_text if chat is not None else "", self.is_batch)
            sampling = fit.for_prompt(sampling, Prompt([]))
            policy = self.controls.cache_policy(sampling, rt.aggressive_ttl_s, rt.warmup_ttl_s)
            self.prepared = Prepared(Prompt([]), tuple([] for _ in range(len(raw or [None]))), "", sampling, n,
                                     policy, (), 0, False, None, refusal)
            return
        if chat is None:
            self.controls = controls_of(self.request, "", self.is_batch)
            prompts = [list(p) if isinstance(p, list) else await asyncio.to_thread(engine.tokenizer.encode_prompt, p)
                       for p in raw]
            prompt = Prompt(prompts[0]) if like is None else replace(like, token_ids=prompts[0])
            text = "\n".join(p for p in raw if isinstance(p, str))
        else:
            self.controls = controls_of(self.request, chat.system_text, self.is_batch)
            if self.controls.is_compressive:
                messages, compression = await compress(engine, rt.compression, chat.messages, self.request_id,
                                                       self.controls.priority, self.who.cache_salt, self.reservation)
                chat = replace(chat, messages=messages)
            prompt = await asyncio.to_thread(build_prompt, engine.chat_template, chat, rt.parse_thought)
            prompts, text = [prompt.token_ids], chat.text
        sampling = fit.for_prompt(sampling, prompt)
        if openai_limit is not None:
            fit.check_openai_context(sampling, engine.config, max(map(len, prompts)), openai_limit)
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

    async def _screen_prompt(self, chat: ChatInput | None, raw: list[str | list[int]] | None):
        """The content policy on the prompt, before it is tokenized (a blocked prompt costs no prefill):
        (the block rule that matched or None, the chat and raw prompts with mask rules applied). Takes the
        answer's rules for the request too."""
        store = self.rt.policy
        if store is None:
            return None, chat, raw
        policy, tenant = store.current(), self.who.tenant
        self.answer_policy = policy.matcher(tenant, "answer")
        matcher = policy.matcher(tenant, "prompt")
        if matcher is None:
            return None, chat, raw
        texts = prompt_texts(chat.messages) if chat is not None else [p for p in raw if isinstance(p, str)]
        verdict = await asyncio.to_thread(screen_prompt, matcher, texts)
        self.policy_s += verdict.seconds
        self._count(verdict.matched, "prompt")
        if verdict.blocked is None and any(r.action == "mask" for r in verdict.matched):
            if chat is not None:
                chat = replace(chat, messages=await asyncio.to_thread(mask_messages, matcher, chat.messages))
            else:
                raw = [mask_text(matcher, p) if isinstance(p, str) else p for p in raw]
        return verdict.blocked, chat, raw

    def _count(self, rules: list[Rule], scope: str) -> None:
        for rule in rules:
            self.rt.metrics.policy_matches.labels(rule.id, self.who.tenant, scope, rule.action).inc()

    def render_context(self, model: str) -> RenderContext:
        """What the request's renderer knows of it (`model`: the name the client sent)."""
        p = self.prepared
        return RenderContext(self.request_id, self.endpoint, model, p.prompt, p.prompt_ids, p.n, p.cache_breakpoint,
                             p.is_context_capped, self.rt.thoughts, self.controls.is_meta)

    # ---- submit -----------------------------------------------------------------------------------
    async def submit(self) -> None:
        """Queue the prepared request in the engine, then wait up to header_wait_s for its prefill, so
        a stream's headers can carry its figures. n > 1 queues n samples of each prompt, each with its
        own seed (seed + i when the request gives one), and sample j > 0 forks sample 0 of its prompt.

        Raises:
            APIError: the server ended it before it ran (a drain), or the engine refused or failed it.
        """
        p, engine = self.prepared, self.engine
        if self.cancelled is not None:
            raise self.cancelled
        if p.refusal is not None:  # refused before the engine: one finished output per choice, nothing run
            self.choices = {self.request_id if i == 0 else f"{self.request_id}.{i}": i
                            for i in range(len(p.prompt_ids) * p.n)}
            return
        marker = None
        if p.prompt.tool_names:
            marker = "" if p.prompt.is_forced_tool else p.prompt.tool_format.marker
        reasoning = p.prompt.reasoning
        if reasoning is not None and reasoning.budget is None and self.rt.reasoning_budget is not None:
            reasoning = replace(reasoning, budget=self.rt.reasoning_budget)
        options = dict(priority=self.controls.priority, cache_policy=p.cache_policy, cache_salt=self.who.cache_salt,
                       tool_marker=marker, pin_prefixes=list(p.pins), low_latency=self.controls.is_low_latency,
                       reasoning=reasoning, task=p.task)
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
        if self.prepared.refusal is not None:
            for rid in self.choices:
                yield self._refused(rid)
            return
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
            if out is not None and self.answer_policy is not None:
                shown = self._screen(out)
                if shown is None:  # blocked already: nothing until the engine's last output
                    out = None
                    continue
                yield shown
            else:
                yield out
            if out is not None and out.finished:
                left -= 1
                if not left:
                    return
            out = None

    def _screen(self, out: RequestOutput) -> RequestOutput | None:
        """An output through its choice's answer screen; the first block stops the choice in the engine
        (its blocks are freed; its last output still comes, with what it generated, and is billed)."""
        choice = self.choices[out.request_id]
        screen = self.screens.get(choice)
        if screen is None:
            screen = self.screens[choice] = OutputScreen(self.answer_policy)
        was_blocked = screen.blocked is not None
        shown = screen.screen(out)
        if screen.blocked is not None and not was_blocked:
            self._count([screen.blocked], "answer")
            if not out.finished:
                self.stream.stop(out.request_id)
        if out.finished:
            self._count([r for r in screen.matched if r.action == "mask"], "answer")
        return shown

    def _refused(self, request_id: str) -> RequestOutput:
        """A blocked prompt's answer: finished, nothing generated, nothing computed."""
        now = time.perf_counter()
        stats = RequestStats(num_prompt_tokens=0, num_cached_tokens=0, num_prompt_tokens_computed=0,
                             num_cache_written_tokens=0, num_output_tokens=0, num_preemptions=0, arrival_time=now,
                             first_scheduled_time=None, first_token_time=None, prefill_done_time=None,
                             finish_time=now, token_times=[])
        return RequestOutput(request_id, "", [], "", [], True, "content_filter", self.prepared.refusal.id, stats,
                             MetaState.POLICY_BLOCKED)

    def policy_report(self) -> dict[str, Any] | None:
        """What the request says of the content policy: the block rule's id (never what matched), the
        rules that masked, and the screening time."""
        if self.rt.policy is None:
            return None
        p = self.prepared
        blocked = p.refusal if p is not None else None
        masked: list[str] = []
        seconds = self.policy_s
        for screen in self.screens.values():
            blocked = blocked or screen.blocked
            masked += [r.id for r in screen.matched if r.action == "mask"]
            seconds += screen.seconds
        return {"blocked": blocked.id if blocked is not None else None, "masked": sorted(set(masked)),
                "screening_us": round(seconds * 1e6, 1)}

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

    async def respond(self, renderer: Renderer, is_stream: bool, media_type: str = "text/event-stream") -> Response:
        """The response: a stream of the renderer's events (SSE, or `media_type`: Ollama's NDJSON), which
        takes the request over (and closes it however it ends, a client gone before the first event too),
        or the body of its finished outputs."""
        if is_stream:
            self.is_handed_over = True
            return _EventStream(self.events(renderer), self.close, media_type=media_type,
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
        block = self.engine.config.block_size
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
                     p.compression if p is not None else None, self.policy_report(), self.model.name,
                     len(self.rt.models.models) > 1)

    # ---- finish, close ------------------------------------------------------------------------------
    def finish(self, final: RequestOutput) -> Report:
        """Telemetry for the finished request (`final`: its choices merged): the cost headers, trace and
        metrics (`report`), and the reservation settled at its measured cost (`_end`)."""
        p = self.prepared
        usage = usage_of(final, p.cache_breakpoint)
        done = final_report(self.rt, self.engine, final, usage, self.facts(), time.process_time() - self.cpu0,
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
        self.engine.release(self.request_id)
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
