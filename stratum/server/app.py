"""The ASGI app: its own routes (/health, /metrics, models, count_tokens, negotiation, the console; Ollama's
in `ollama_routes`), the middleware that bounds and authenticates every request, and the error handlers.
The event loop only does I/O: tokenization runs in worker threads; /health and /metrics read the engine's
published snapshot."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from stratum.engine.client import EngineClient, ReplicaView
from stratum.server import batches
from stratum.server.auth import authenticate, tenant_of
from stratum.server.body import read_request
from stratum.server.budget import BudgetStore
from stratum.server.chat import anthropic_input, build_prompt
from stratum.server.counting import TokenCounter
from stratum.server.embeddings import embedding_routes
from stratum.server.errors import (APIError, HeadersTooLarge, InvalidRequest, MethodNotAllowed, NotFound, Overloaded,
                                   RequestTooLarge, error_response, new_request_id)
from stratum.server.http import OVER_LIMIT
from stratum.server.ollama_routes import ollama_routes
from stratum.server.openapi import describe_bodies
from stratum.server.protocol import (BatchCreateRequest, ChatCompletionRequest, CompletionRequest, CountTokensRequest,
                                     InputTokensRequest, MessagesRequest, ResponsesRequest)
from stratum.server.models import ModelCatalogue, ModelSet, hold_model, release_held
from stratum.server.routes import generation_routes
from stratum.server.runtime import Runtime, make_runtime
from stratum.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]

log = logging.getLogger("stratum.server")

OPEN_PATHS = ("/health", "/metrics", "/docs", "/openapi.json", "/console")  # /console/stats checks keys itself
NEGOTIATION_VERSION = "v1"
# Response headers a browser page may read (CORS): the request id, the cost and the budget.
EXPOSED_HEADERS = ["request-id", "x-stratum-cost", "x-stratum-trace", "x-stratum-mode", "x-stratum-cache-mode",
                   "x-stratum-advice", "x-stratum-replica", "x-stratum-supported", "x-stratum-policy",
                   "retry-after", "anthropic-ratelimit-tokens-limit", "anthropic-ratelimit-tokens-remaining",
                   "anthropic-ratelimit-tokens-reset", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                   "x-ratelimit-reset-tokens"]


def create_app(models: ModelSet | EngineClient, settings: ServerSettings) -> FastAPI:
    """The app serving `models` (or one running engine, served as `settings.model_name`) with `settings`;
    its `state.runtime` is the `Runtime` its requests share."""
    if isinstance(models, EngineClient):
        models = ModelSet.of_engine(settings.model_name, models, settings.aliases, settings.model_patterns)
    app = FastAPI(title="Stratum", version="0.1.0", docs_url="/docs", redoc_url=None)
    # the tenants' settled spending, beside the batches: a restart reads it back
    budgets = (BudgetStore(Path(settings.data_dir) / "budgets.sqlite3")
               if settings.data_dir is not None and settings.tenant_budget_tokens is not None else None)
    rt = make_runtime(models, settings.pricing, settings.tenant_budget_tokens,
                      settings.budget_window_s, settings.pollution_policy, settings.isolate_tenants,
                      settings.header_wait_s, settings.ping_interval_s, settings.responses_store_bytes, budgets)
    rt.parse_thought, rt.reasoning_budget = settings.reasoning_format != "none", settings.reasoning_budget
    rt.restart_wait_s = settings.restart_wait_s
    app.state.runtime = rt
    rt.policy = settings.content_policy
    _supervision_metrics(rt)
    runner = _batches(app, rt, settings)
    if settings.console:
        _console_routes(app, rt, settings, runner)
    app.router.on_startup.append(models.start_reaper)
    app.router.on_shutdown.append(models.stop_reaper)
    app.add_middleware(Envelope, max_body_bytes=settings.max_body_bytes, digests=settings.key_digests, runner=runner,
                       models=models,
                       max_batch_bytes=settings.max_batch_bytes, metrics=rt.metrics,
                       max_header_bytes=settings.max_header_bytes, max_header_count=settings.max_header_count)
    if settings.cors_origins:  # outermost: a browser's preflight is answered before authentication
        # every header a request asks for is allowed (the SDKs' browser modes send x-api-key, anthropic-*,
        # authorization, x-stratum-* and x-stainless-*, which no fixed list keeps up with); the origin is
        # echoed with credentials allowed, as llama-server's --cors answers
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"],
                           allow_credentials=True, expose_headers=EXPOSED_HEADERS, max_age=600)
    _error_handlers(app, rt)

    @app.get("/health")
    async def health():
        return health_response(rt)

    @app.get("/metrics")
    async def metrics():
        return Response(rt.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.options("/v1/messages")
    async def negotiate(request: Request):
        headers = {"allow": "OPTIONS, POST"}
        if request.headers.get("x-stratum-negotiate", "").strip().lower() == NEGOTIATION_VERSION:
            headers["x-stratum-supported"] = NEGOTIATION_VERSION
        return Response(status_code=200, headers=headers)

    catalogue = ModelCatalogue(models, settings.created_at)

    @app.get("/v1/models")
    async def list_models():
        return catalogue.page()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        return catalogue.card(models.find(model_id))

    counter = TokenCounter(rt.admission, rt.metrics)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        req = await read_request(request, CountTokensRequest, settings.max_body_bytes, settings.body_timeout_s)
        engine = (await hold_model(request, models, req.model)).engine
        chat = anthropic_input(req, rt.thought_signer(engine))
        async with counter.admit(request, "/v1/messages/count_tokens", request.state.num_body_bytes) as counting:
            prompt = await counting.count(build_prompt, engine.chat_template, chat, rt.parse_thought)
        return {"input_tokens": len(prompt.token_ids)}

    generation_routes(app, rt, settings, counter)
    embedding_routes(app, rt, settings, counter)
    ollama_routes(app, rt, settings)
    describe_bodies(app, {"/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
                          "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/responses": ResponsesRequest, "/v1/responses/input_tokens": InputTokensRequest,
                          batches.BATCHES_PATH: BatchCreateRequest})
    return app


def health_response(rt: Runtime) -> JSONResponse:
    """/health: the default model's engine's state in a word (ok, loading, draining, restarting, dead) and
    what explains it, and each served model's state; 200 only when a request would run now (an
    unloaded default model is started by the request that names it)."""
    default = rt.models.default
    engine = default.engine
    if engine is None:  # unloaded (idle past its keep-alive, or evicted) or failed: requests start it
        status = "draining" if rt.draining else "ok"
        body = {"status": status, "model": default.name, "models": [m.view() for m in rt.models.models.values()]}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)
    snap, sup = engine.snapshot, engine.supervision
    status = ("restarting" if sup is not None and sup.state == "restarting" else "dead" if not snap.alive
              else "draining" if rt.draining else "ok" if is_ready(snap) else "loading")
    body: dict[str, Any] = {"status": status, "model": default.name, "mode": snap.mode,
                            "running": snap.num_running, "waiting": snap.num_waiting, "queued": engine.num_queued,
                            "kv_blocks": asdict(snap.kv_blocks), "engine_pid": engine.engine_pid}
    headers = {}
    if sup is not None:
        body["restarts"] = sup.num_restarts
        if sup.last_restart_s is not None:
            body["last_restart_s"] = round(sup.last_restart_s, 3)
        if status == "restarting":
            body["error"] = sup.last_death
            headers["retry-after"] = str(sup.retry_after_s)
    if snap.step:
        body["step"] = snap.step
    if status == "loading":
        body["stage"] = "waiting for the engine's first report"
    if snap.preparing:  # a cold start serves on PyTorch while its native kernels are prepared
        body["preparing"] = snap.preparing
    if snap.degraded_reason:
        body["degraded_reason"] = snap.degraded_reason
    if snap.error and status != "restarting":
        body["error"] = snap.error
    if rt.draining:
        body["in_flight"] = len(rt.active)
    replicas = engine.replicas()
    if replicas:
        body["replicas"] = [replica_health(v) for v in replicas]
    body["models"] = [m.view() for m in rt.models.models.values()]
    return JSONResponse(body, status_code=200 if status == "ok" else 503, headers=headers)


def is_ready(snap) -> bool:
    """Whether a request would run now: the engine has reported its KV pool and the step it runs
    (before its first report the snapshot is a placeholder with neither); an encoder has no KV pool."""
    return (snap.kv_blocks.total > 0 or snap.step == "encoder") and bool(snap.step)


def _supervision_metrics(rt: Runtime) -> None:
    """/metrics' series of the engines' supervisors, where they have one (`engine/supervisor.py`): summed
    over the loaded models' engines (each model's engine has a supervisor of its own)."""
    from prometheus_client import Gauge

    def supervisions():
        return [s for m in rt.models.loaded() if (s := m.engine.supervision) is not None]

    engine = rt.engine
    if engine is not None and engine.supervision is None and len(rt.models.models) == 1:
        return
    Gauge("stratum_engine_restarts", "Engine processes started again after a death, since the server started",
          registry=rt.metrics.registry).set_function(lambda: sum(s.num_restarts for s in supervisions()))
    Gauge("stratum_engine_restarting", "1 while a dead engine process is being replaced",
          registry=rt.metrics.registry).set_function(lambda: any(s.state == "restarting" for s in supervisions()))


def _batches(app: FastAPI, rt: Runtime, settings: ServerSettings) -> batches.BatchRunner | None:
    """Message Batches' store, runner and routes, with a data directory; None without one."""
    if settings.data_dir is None:
        return None
    store = batches.BatchStore(Path(settings.data_dir) / "batches.sqlite3")
    runner = batches.BatchRunner(store, app, rt, retention_s=settings.batch_retention_s)
    app.router.on_startup.append(runner.start)
    app.router.on_shutdown.append(runner.stop)
    batches.batch_routes(app, rt, settings, store)
    return runner


def _error_handlers(app: FastAPI, rt: Runtime) -> None:
    """Every error answers in its route's API shape (`errors.error_response`), with the request id."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        rt.metrics.observe_error(request.url.path, e.status_on(request.url.path))  # a ClientDisconnected as 499
        return error_response(e, request.state.request_id, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            err: APIError = NotFound(f"no route {request.method} {request.url.path}")
        elif e.status_code == 405:
            err = MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}")
        else:
            err = InvalidRequest(str(e.detail))
        rt.metrics.observe_error(request.url.path, err.status)
        return error_response(err, request.state.request_id, request.url.path)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        log.exception("unhandled error")
        rt.metrics.observe_error(request.url.path, 500)
        return error_response(APIError("internal server error"), request.state.request_id, request.url.path)


CONSOLE_FILES = {"console.css": "text/css", "console.js": "text/javascript"}


def _console_routes(app: FastAPI, rt: Runtime, settings: ServerSettings, runner) -> None:
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
            authenticate(request, digests)
        tenant = tenant_of(request, None) if rt.isolate_tenants else None
        figures = rt.metrics.window(tenant)
        figures["batches_in_flight"] = await asyncio.to_thread(runner.store.num_unended) if runner is not None else 0
        return figures


class Envelope:
    """Pure ASGI middleware: a request id on every response, the connection limit (see `http.protocol`),
    the body-size limit and authentication, before any route runs. (Not BaseHTTPMiddleware: it hides
    client disconnects from the routes.)"""

    def __init__(self, app, max_body_bytes: int, digests: tuple[bytes, ...], runner=None, max_batch_bytes: int = 0,
                 metrics=None, max_header_bytes: int = 32 * 1024, max_header_count: int = 256, models=None):
        self.app = app
        self.models = models  # the request's hold on its model is released once its response is sent
        self.max_header_bytes = max_header_bytes
        self.max_header_count = max_header_count
        self.metrics = metrics  # its refusals are counted as the routes' are
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
            self._check_headers(scope["headers"])
            if scope["state"].get(OVER_LIMIT):
                raise Overloaded("too many connections to this server; retry shortly",
                                 headers={"retry-after": "1", "connection": "close"})
            limit = self.max_batch_bytes if scope["path"] == batches.BATCHES_PATH else self.max_body_bytes
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                raise RequestTooLarge(f"request body exceeds {limit} bytes")
            if self.runner is not None and self.runner.is_internal(request.headers):
                scope["state"]["batch_tenant"] = request.headers.get(batches.TENANT_HEADER, "")
            elif self.digests and not scope["path"].startswith(OPEN_PATHS) and scope["method"] != "OPTIONS":
                authenticate(request, self.digests)
        except APIError as e:
            if self.metrics is not None:
                self.metrics.observe_error(scope["path"], e.status)
            return await error_response(e, request_id, scope["path"])(scope, receive, send_with_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.models is not None:
                release_held(scope, self.models)


    def _check_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        """The header limits, over the headers as parsed: the HTTP parser bounds only headers still
        arriving (h11's incomplete-event size), so headers that came in one piece are checked here.

        Raises:
            HeadersTooLarge: 431, more than max_header_count headers, or more than max_header_bytes
                as sent (`name: value` and its line end).
        """
        if len(headers) > self.max_header_count:
            raise HeadersTooLarge(f"request has {len(headers)} headers, more than {self.max_header_count}",
                                  headers={"connection": "close"})
        size = sum(len(k) + len(v) + 4 for k, v in headers)
        if size > self.max_header_bytes:
            raise HeadersTooLarge(f"request headers exceed {self.max_header_bytes} bytes ({size})",
                                  headers={"connection": "close"})


def replica_health(v: ReplicaView) -> dict[str, Any]:
    snap = v.snapshot
    return {"replica": v.name, "pid": v.pid, "status": "ok" if snap.alive else "dead", "mode": snap.mode,
            "running": snap.num_running, "waiting": snap.num_waiting, "in_flight": v.in_flight,
            "kv_blocks": asdict(snap.kv_blocks),
            "held_blocks": v.held_blocks, "reported_s_ago": round(max(0.0, time.time() - v.reported_at), 3)}
