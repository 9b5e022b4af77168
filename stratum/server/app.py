"""The ASGI application: routes, authentication, size limits; errors are shaped by `errors.py`.

The event loop only does I/O: chat templates and tokenization of a request run in a worker thread,
and `/health` and `/metrics` read the engine's published snapshot, never waiting for a step."""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import hmac
import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from stratum.engine.client import EngineClient, ReplicaView
from stratum.engine.sampling_params import SamplingParams
from stratum.server import anthropic_api, batches, openai_api, pipeline, responses_api
from stratum.server.chat import anthropic_input, build_prompt, openai_input, responses_input
from stratum.server.errors import (APIError, AuthenticationFailed, BodyTimeout, ClientDisconnected, InvalidRequest,
                                   MethodNotAllowed, NotFound, Overloaded, RequestTooLarge, error_response, new_request_id)
from stratum.server.http import OVER_LIMIT
from stratum.server.lifecycle import RequestLifecycle
from stratum.server.protocol import (BatchCreateRequest, ChatCompletionRequest, CompletionRequest, CountTokensRequest,
                                     MessagesRequest, ResponsesRequest)
from stratum.telemetry.cost import ArticleFormula, PricingModel

log = logging.getLogger("stratum.server")

OPEN_PATHS = ("/health", "/metrics", "/docs", "/openapi.json", "/console")  # /console/stats checks keys itself
NEGOTIATION_VERSION = "v1"
# What an OpenAI request without max_tokens may generate, at most (less when the context ends sooner).
DEFAULT_MAX_TOKENS = 1024
BATCHES_PATH = "/v1/messages/batches"
# Choices one request may ask for: prompts x n on /v1/completions.
MAX_CHOICES = 64
# Response headers a browser page may read (CORS): the request id, the cost and the budget.
EXPOSED_HEADERS = ["request-id", "x-stratum-cost", "x-stratum-trace", "x-stratum-mode", "x-stratum-cache-mode",
                   "x-stratum-advice", "retry-after", "anthropic-ratelimit-tokens-limit",
                   "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset",
                   "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"]


@dataclass(frozen=True)
class ServerSettings:
    """Args:
        model_name: the id clients send in `model`; aliases are accepted too.
        model_patterns: globs of other model names served by the loaded model (`_check_model`).
        api_keys: accepted keys; empty means no authentication. Only their SHA-256 digests are kept.
        max_body_bytes: request bodies above this get 413 before any parsing.
        header_wait_s: a stream waits this long for prefill before sending headers without its figures.
        tenant_budget_tokens: admission by cost, tokens per tenant per window; None disables it.
        pollution_policy: reject (418), advise (header only) or off.
        share_prefix_cache: with API keys, let every key hit every other key's cached prompts (one
            organisation, several keys); by default each key is a tenant with a cache of its own.
        body_timeout_s: a request body that stalls this long between chunks gets 408.
        cors_origins: web origins allowed to call the API from a browser ("*" for any); none by default.
        data_dir: where Message Batches are kept (SQLite); None serves no batches.
        console: serve the console pages under /console (its figures need a key when keys are set).
        batch_ttl_s, batch_retention_s: a batch expires this long after creation; its results are kept
            this long after it ends.
    """

    model_name: str
    aliases: tuple[str, ...] = ()
    model_patterns: tuple[str, ...] = ("claude-*",)
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    ping_interval_s: float = 5.0
    header_wait_s: float = 2.0
    default_temperature: float = 1.0  # Anthropic's default when a request omits it
    default_top_p: float = 1.0
    tenant_budget_tokens: int | None = None
    budget_window_s: float = 60.0
    pollution_policy: str = "advise"
    share_prefix_cache: bool = False
    body_timeout_s: float = 30.0
    cors_origins: tuple[str, ...] = ()
    data_dir: Path | None = None
    console: bool = False
    batch_ttl_s: float = 86400.0
    batch_retention_s: float = 29 * 86400.0
    max_batch_bytes: int = 256 * 2**20  # Anthropic's limit on a batch's body
    pricing: PricingModel = field(default_factory=ArticleFormula)
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))

    @property
    def key_digests(self) -> tuple[bytes, ...]:
        return tuple(hashlib.sha256(k.encode()).digest() for k in self.api_keys)

    @property
    def isolate_tenants(self) -> bool:
        """Keys are tenants, and one tenant's prompts must never be observable by another through the
        prefix cache (its hit ratio, its timing). Without keys every client is one trust domain."""
        return bool(self.api_keys) and not self.share_prefix_cache


def is_ready(snap) -> bool:
    """Whether a request would run now: the engine has reported its KV pool and the step it runs
    (before its first report the snapshot is a placeholder with neither)."""
    return snap.kv_blocks.total > 0 and bool(snap.step)


def create_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="Stratum", version="0.1.0", docs_url="/docs", redoc_url=None)
    rt = pipeline.make_runtime(engine, settings.model_name, settings.pricing, settings.tenant_budget_tokens,
                               settings.budget_window_s, settings.pollution_policy, settings.isolate_tenants,
                               settings.header_wait_s, settings.ping_interval_s)
    app.state.runtime = rt
    digests = settings.key_digests

    runner = None
    if settings.data_dir is not None:
        store = batches.BatchStore(Path(settings.data_dir) / "batches.sqlite3")
        runner = batches.BatchRunner(store, app, rt, retention_s=settings.batch_retention_s)
        app.router.on_startup.append(runner.start)
        app.router.on_shutdown.append(runner.stop)
        _batch_routes(app, rt, settings, store)
    if settings.console:
        _console_routes(app, rt, settings, runner)
    app.add_middleware(Envelope, max_body_bytes=settings.max_body_bytes, digests=digests, runner=runner,
                       max_batch_bytes=settings.max_batch_bytes)
    if settings.cors_origins:  # outermost: a browser's preflight is answered before authentication
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"], expose_headers=EXPOSED_HEADERS, max_age=600)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        if not isinstance(e, ClientDisconnected):
            rt.metrics.observe_error(request.url.path, e.status)
        return error_response(e, request.state.request_id, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            err: APIError = NotFound(f"no route {request.method} {request.url.path}")
        elif e.status_code == 405:
            err = MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}")
        else:
            err = InvalidRequest(str(e.detail))
        return error_response(err, request.state.request_id, request.url.path)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(APIError("internal server error"), request.state.request_id, request.url.path)

    @app.get("/health")
    async def health():
        snap = engine.snapshot
        status = "dead" if not snap.alive else "draining" if rt.draining else "ok" if is_ready(snap) else "loading"
        body: dict[str, Any] = {"status": status, "model": settings.model_name, "mode": snap.mode,
                                "running": snap.num_running, "waiting": snap.num_waiting, "queued": engine.num_queued,
                                "kv_blocks": asdict(snap.kv_blocks)}
        if snap.step:
            body["step"] = snap.step
        if status == "loading":
            body["stage"] = "waiting for the engine's first report"
        if snap.preparing:  # a cold start serves on PyTorch while its native kernels are prepared
            body["preparing"] = snap.preparing
        if snap.degraded_reason:
            body["degraded_reason"] = snap.degraded_reason
        if snap.error:
            body["error"] = snap.error
        if rt.draining:
            body["in_flight"] = len(rt.active)
        replicas = engine.replicas()
        if replicas:
            body["replicas"] = [replica_health(v) for v in replicas]
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(rt.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.options("/v1/messages")
    async def negotiate(request: Request):
        headers = {"allow": "OPTIONS, POST"}
        if request.headers.get("x-stratum-negotiate", "").strip().lower() == NEGOTIATION_VERSION:
            headers["x-stratum-supported"] = NEGOTIATION_VERSION
        return Response(status_code=200, headers=headers)

    @app.get("/v1/models")
    async def list_models():
        card = _model_card(settings)
        return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        _check_model(settings, model_id)
        return _model_card(settings)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        req = await _read_request(request, settings, CountTokensRequest)
        _check_model(settings, req.model)
        prompt = await asyncio.to_thread(build_prompt, engine.chat_template, anthropic_input(req))
        return {"input_tokens": len(prompt.token_ids)}

    _generation_routes(app, rt, settings)
    return app


def _generation_routes(app: FastAPI, rt: pipeline.Runtime, settings: ServerSettings) -> None:
    """The routes that run a request on the engine: each reads and checks its body, then runs it as a
    `RequestLifecycle` and answers through its API's renderer."""
    engine = rt.engine

    @app.post("/v1/messages")
    async def messages(request: Request):
        req = await _read_request(request, settings, MessagesRequest)
        _check_model(settings, req.model)
        chat = anthropic_input(req)
        sampling = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=settings.default_temperature if req.temperature is None else req.temperature,
            top_p=req.top_p or settings.default_top_p, top_k=req.top_k or 0,
            stop=list(req.stop_sequences or []), seed=req.seed, ignore_eos=req.ignore_eos,
        )
        user_id = req.metadata.user_id if req.metadata else None
        # what max_tokens can cost is bounded by the context (`_fit_context` lowers it to fit)
        async with RequestLifecycle.admit(rt, request, "/v1/messages", min(req.max_tokens, engine.config.max_model_len),
                                          user_id) as lc:
            await lc.prepare(chat, sampling, fit_context=True)
            await lc.submit()
            return await lc.respond(anthropic_api.Messages(lc, req.model), req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _read_request(request, settings, ChatCompletionRequest)
        _check_model(settings, req.model)
        chat = openai_input(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sampling = _openai_sampling(req, settings, max_tokens, req.top_logprobs or 0 if req.logprobs else None)
        async with RequestLifecycle.admit(rt, request, "/v1/chat/completions", max_tokens, req.user) as lc:
            await lc.prepare(chat, sampling, default_max=max_tokens is None, n=req.n)
            await lc.submit()
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await lc.respond(openai_api.Chat(lc, req.model, include_usage, engine.tokenizer), req.stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _read_request(request, settings, CompletionRequest)
        _check_model(settings, req.model)
        prompts = req.prompt if isinstance(req.prompt, list) and not isinstance(req.prompt[0], int) else [req.prompt]
        if len(prompts) * req.n > MAX_CHOICES:
            raise InvalidRequest(f"{len(prompts)} prompts x n {req.n} exceeds {MAX_CHOICES} choices per request")
        sampling = _openai_sampling(req, settings, req.max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None:  # score the prompt too (what evaluation harnesses ask)
            sampling.prompt_logprobs = req.logprobs
        async with RequestLifecycle.admit(rt, request, "/v1/completions", req.max_tokens, req.user) as lc:
            await lc.prepare(None, sampling, default_max=req.max_tokens is None, n=req.n, raw=prompts)
            await lc.submit()
            echoes = [(p if isinstance(p, str) else await asyncio.to_thread(engine.tokenizer.decode, p))
                      if req.echo else "" for p in prompts]
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await lc.respond(openai_api.Text(lc, req.model, include_usage, engine.tokenizer, echoes), req.stream)

    @app.post("/v1/responses")
    async def responses(request: Request):
        req = await _read_request(request, settings, ResponsesRequest)
        _check_model(settings, req.model)
        chat = responses_input(req)
        sampling = SamplingParams(
            max_tokens=req.max_output_tokens or DEFAULT_MAX_TOKENS,
            temperature=settings.default_temperature if req.temperature is None else req.temperature,
            top_p=req.top_p or settings.default_top_p, seed=req.seed)
        async with RequestLifecycle.admit(rt, request, "/v1/responses", req.max_output_tokens,
                                          req.safety_identifier or req.user) as lc:
            await lc.prepare(chat, sampling, default_max=req.max_output_tokens is None)
            await lc.submit()
            shell = responses_api.ResponseShell(req, sampling.temperature, sampling.top_p)
            return await lc.respond(responses_api.Responses(lc, shell), req.stream)


CONSOLE_FILES = {"console.css": "text/css", "console.js": "text/javascript"}


def _console_routes(app: FastAPI, rt: pipeline.Runtime, settings: ServerSettings, runner) -> None:
    """The console: a chat page and a live dashboard, static files of this package (no CDN), and the
    figures the dashboard polls every second."""
    from importlib import resources

    pages = resources.files("stratum.server") / "console"
    digests = settings.key_digests

    def page(name: str, media_type: str = "text/html") -> Response:
        return Response((pages / name).read_bytes(), media_type=media_type, headers={"cache-control": "no-cache"})

    @app.get("/console")
    async def console_chat():
        return page("chat.html")

    @app.get("/console/dashboard")
    async def console_dashboard():
        return page("dashboard.html")

    @app.get("/console/static/{name}")
    async def console_static(name: str):
        if name not in CONSOLE_FILES:
            raise NotFound(f"no console file {name!r}")
        return page(name, CONSOLE_FILES[name])

    @app.get("/console/stats")
    async def console_stats(request: Request):
        if digests:
            _authenticate(request, digests)
        tenant = pipeline.tenant_of(request, None) if rt.isolate_tenants else None
        figures = rt.metrics.window(tenant)
        figures["batches_in_flight"] = await asyncio.to_thread(runner.store.num_unended) if runner is not None else 0
        return figures


def _batch_routes(app: FastAPI, rt: pipeline.Runtime, settings: ServerSettings, store: "batches.BatchStore") -> None:
    """Message Batches: create, retrieve, list, cancel, delete, results (JSONL). With tenants, a batch is
    visible to its own tenant only."""

    def owner(request: Request) -> str | None:
        return pipeline.tenant_of(request, None) if rt.isolate_tenants else None

    async def get(request: Request, batch_id: str) -> dict[str, Any]:
        batch = await asyncio.to_thread(store.get, batch_id, owner(request))
        if batch is None:
            raise NotFound(f"no message batch {batch_id!r}")
        return batch

    @app.post(BATCHES_PATH)
    async def create_batch(request: Request):
        req = await _read_request(request, settings, BatchCreateRequest, settings.max_batch_bytes)
        ids = [r.custom_id for r in req.requests]
        if len(set(ids)) != len(ids):
            raise InvalidRequest("requests: custom_id values must be unique within a batch")
        batch_id = await asyncio.to_thread(store.create, pipeline.tenant_of(request, None),
                                           [(r.custom_id, r.params) for r in req.requests], settings.batch_ttl_s)
        return await get(request, batch_id)

    @app.get(BATCHES_PATH)
    async def list_batches(request: Request, limit: int = 20, after_id: str | None = None, before_id: str | None = None):
        if not 1 <= limit <= 1000:
            raise InvalidRequest("limit must be in [1, 1000]")
        page = await asyncio.to_thread(store.list, owner(request), limit, after_id, before_id)
        return {"data": page.data, "has_more": page.has_more, "first_id": page.data[0]["id"] if page.data else None,
                "last_id": page.data[-1]["id"] if page.data else None}

    @app.get(BATCHES_PATH + "/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str):
        return await get(request, batch_id)

    @app.post(BATCHES_PATH + "/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        await get(request, batch_id)
        await asyncio.to_thread(store.cancel, batch_id)
        return await get(request, batch_id)

    @app.delete(BATCHES_PATH + "/{batch_id}")
    async def delete_batch(request: Request, batch_id: str):
        if (await get(request, batch_id))["processing_status"] != "ended":
            raise InvalidRequest("a message batch can be deleted once it has ended: cancel it first")
        await asyncio.to_thread(store.delete, batch_id)
        return {"id": batch_id, "type": "message_batch_deleted"}

    @app.get(BATCHES_PATH + "/{batch_id}/results")
    async def batch_results(request: Request, batch_id: str):
        if (await get(request, batch_id))["processing_status"] != "ended":
            raise InvalidRequest("the batch has not ended: its results are not available yet")
        lines = await asyncio.to_thread(store.results, batch_id)
        return Response("".join(line + "\n" for line in lines), media_type="application/x-jsonl")


class Envelope:
    """Pure ASGI middleware: a request id on every response, the connection limit (see `http.protocol`),
    the body-size limit and authentication, before any route runs. (Not BaseHTTPMiddleware: it hides
    client disconnects from the routes.)"""

    def __init__(self, app, max_body_bytes: int, digests: tuple[bytes, ...], runner=None, max_batch_bytes: int = 0):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.digests = digests
        self.runner = runner  # its in-process calls carry a secret instead of a key, and their batch's tenant
        self.max_batch_bytes = max_batch_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"request-id"]
                message = {**message, "headers": headers + [(b"request-id", request_id.encode())]}
            await send(message)

        request = Request(scope)
        try:
            if scope["state"].get(OVER_LIMIT):
                raise Overloaded("too many connections to this server; retry shortly",
                                 headers={"retry-after": "1", "connection": "close"})
            limit = self.max_batch_bytes if scope["path"] == BATCHES_PATH else self.max_body_bytes
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                raise RequestTooLarge(f"request body exceeds {limit} bytes")
            if self.runner is not None and self.runner.is_internal(request.headers):
                scope["state"]["batch_tenant"] = request.headers.get(batches.TENANT_HEADER, "")
            elif self.digests and not scope["path"].startswith(OPEN_PATHS) and scope["method"] != "OPTIONS":
                _authenticate(request, self.digests)
        except APIError as e:
            return await error_response(e, request_id, scope["path"])(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)


def _openai_sampling(req, settings: ServerSettings, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS,
        temperature=settings.default_temperature if req.temperature is None else req.temperature,
        top_p=req.top_p or settings.default_top_p, top_k=req.top_k or 0, stop=stop, seed=req.seed,
        ignore_eos=req.ignore_eos, logprobs=logprobs,
    )


# ---- request checks ----------------------------------------------------------------------------
def _authenticate(request: Request, digests: tuple[bytes, ...]) -> None:
    key = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if key is None and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    if not key:
        raise AuthenticationFailed("missing API key: send x-api-key or Authorization: Bearer")
    digest = hashlib.sha256(key.encode()).digest()
    ok = False
    for d in digests:  # every digest is compared, so timing does not reveal which one matched
        ok |= hmac.compare_digest(digest, d)
    if not ok:
        raise AuthenticationFailed("invalid API key")


# Bodies above this are parsed in a worker thread, so a large one does not hold up other clients.
_PARSE_INLINE_BYTES = 64 * 1024


async def _read_request(request: Request, settings: ServerSettings, model: type[BaseModel], limit: int | None = None):
    limit = limit or settings.max_body_bytes
    body = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), settings.body_timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise BodyTimeout(f"the request body stalled for {settings.body_timeout_s:g}s; received "
                              f"{len(body)} bytes", headers={"connection": "close"}) from None
        except ClientDisconnect:
            log.info("%s: client disconnected while sending its body (%d bytes received)",
                     request.state.request_id, len(body))
            raise ClientDisconnected("client disconnected") from None
        body += chunk
        if len(body) > limit:
            raise RequestTooLarge(f"request body exceeds {limit} bytes")
    if len(body) <= _PARSE_INLINE_BYTES:
        return _parse(model, _decode_json(bytes(body)))
    return await asyncio.to_thread(lambda: _parse(model, _decode_json(bytes(body))))


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _decode_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8") from None
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body):  # only an escape can put a lone surrogate in valid UTF-8 JSON
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("request body contains a lone UTF-16 surrogate") from None
    return data


def _parse(model: type[BaseModel], data: dict[str, Any]):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        sep = "." if first["type"] == "unsupported_content" else ": "  # its message starts with the block's path
        raise InvalidRequest(f"{loc}{sep}{first['msg']}" if loc else first["msg"]) from None


def _check_model(settings: ServerSettings, name: str) -> None:
    """The served name, an alias, or a name matching one of `model_patterns` (by default any Claude
    model id, so Anthropic's clients, which name Claude models, run on the loaded model unchanged)."""
    if name == settings.model_name or name in settings.aliases:
        return
    if not any(fnmatch.fnmatchcase(name, p) for p in settings.model_patterns):
        raise NotFound(f"model {name!r} not found; this server serves {settings.model_name!r}")


def replica_health(v: ReplicaView) -> dict[str, Any]:
    snap = v.snapshot
    return {"replica": v.name, "pid": v.pid, "status": "ok" if snap.alive else "dead", "mode": snap.mode,
            "running": snap.num_running, "waiting": snap.num_waiting, "in_flight": v.in_flight,
            "kv_blocks": asdict(snap.kv_blocks),
            "held_blocks": v.held_blocks, "reported_s_ago": round(max(0.0, time.time() - v.reported_at), 3)}


def _model_card(settings: ServerSettings) -> dict[str, Any]:
    return {"type": "model", "id": settings.model_name, "display_name": settings.model_name, "created_at": settings.created_at}
