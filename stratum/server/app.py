"""The ASGI application: routes, authentication, size limits and the one place errors are shaped."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from stratum.engine import AsyncEngine, EngineDeadError, RequestOutput
from stratum.sampling_params import InvalidRequestError, SamplingParams
from stratum.server import tools as tool_fmt
from stratum.server.chat import Prompt, anthropic_messages, build_prompt, openai_messages
from stratum.server.errors import (
    APIError, AuthenticationFailed, EngineUnavailable, InvalidRequest, NotFound, Overloaded, RequestTooLarge,
)
from stratum.server.protocol import ChatCompletionRequest, CountTokensRequest, MessagesRequest
from stratum.server.streams import EngineStream

log = logging.getLogger("stratum.server")

OPEN_PATHS = ("/health", "/metrics", "/docs", "/openapi.json")


@dataclass(frozen=True)
class ServerSettings:
    """Args:
        model_name: the id clients send in `model`; aliases are accepted too.
        api_keys: accepted keys; empty means no authentication. Only their SHA-256 digests are kept.
        max_body_bytes: request bodies above this get 413 before any parsing.
        header_wait_s: a stream waits this long for prefill before sending headers without it.
    """

    model_name: str
    aliases: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    max_waiting: int = 256
    ping_interval_s: float = 5.0
    header_wait_s: float = 2.0
    default_temperature: float = 1.0  # Anthropic's default when a request omits it
    default_top_p: float = 1.0
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))

    @property
    def key_digests(self) -> tuple[bytes, ...]:
        return tuple(hashlib.sha256(k.encode()).digest() for k in self.api_keys)


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="Stratum", version="0.1.0", docs_url="/docs", redoc_url=None)
    app.state.engine = engine
    app.state.settings = settings
    digests = settings.key_digests

    @app.middleware("http")
    async def envelope(request: Request, call_next):
        request_id = "req_" + uuid.uuid4().hex[:24]
        request.state.request_id = request_id
        try:
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
                raise RequestTooLarge(f"request body exceeds {settings.max_body_bytes} bytes")
            if digests and not request.url.path.startswith(OPEN_PATHS) and request.method != "OPTIONS":
                _authenticate(request, digests)
            response = await call_next(request)
        except APIError as e:
            response = _error_response(e, request_id)
        response.headers["request-id"] = request_id
        return response

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return _error_response(e, request.state.request_id)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        err = NotFound(f"no route {request.method} {request.url.path}") if e.status_code == 404 else InvalidRequest(str(e.detail))
        if e.status_code == 405:
            err.status = 405
        return _error_response(err, request.state.request_id)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        log.exception("unhandled error")
        return _error_response(APIError("internal server error"), request.state.request_id)

    @app.get("/health")
    async def health():
        ok = engine.is_alive
        body: dict[str, Any] = {"status": "ok" if ok else "dead", "model": settings.model_name, "mode": "normal",
                                "running": engine.num_running, "waiting": engine.num_waiting}
        if ok:
            body["kv_blocks"] = await asyncio.wrap_future(engine.call(_kv_snapshot))
        return JSONResponse(body, status_code=200 if ok else 503)

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
        req = _parse(CountTokensRequest, await _read_json(request, settings))
        _check_model(settings, req.model)
        messages, tools, choice = anthropic_messages(req)
        prompt = build_prompt(engine.engine.chat_template, messages, tools)
        return {"input_tokens": len(prompt.token_ids)}

    @app.post("/v1/messages")
    async def messages(request: Request):
        req = _parse(MessagesRequest, await _read_json(request, settings))
        _check_model(settings, req.model)
        _check_capacity(engine, settings)
        messages, tools, choice = anthropic_messages(req)
        forced: Any = False
        if choice is not None and choice.type == "any":
            forced = True
        elif choice is not None and choice.type == "tool":
            forced = choice.name
        prompt = build_prompt(engine.engine.chat_template, messages, tools, forced)
        sampling = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=settings.default_temperature if req.temperature is None else req.temperature,
            top_p=req.top_p or settings.default_top_p,
            top_k=req.top_k or 0,
            stop=list(req.stop_sequences or []),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )
        _check_request(engine, prompt, sampling)
        stream = EngineStream(engine.generate(prompt.token_ids, sampling, request_id=request.state.request_id))
        msg_id = "msg_" + uuid.uuid4().hex[:24]
        if req.stream:
            return await _anthropic_stream(request, stream, prompt, msg_id, req.model, settings)
        out = await _collect(request, stream)
        return JSONResponse(_anthropic_message(msg_id, req.model, prompt, out))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _parse(ChatCompletionRequest, await _read_json(request, settings))
        _check_model(settings, req.model)
        _check_capacity(engine, settings)
        messages, tools, choice = openai_messages(req)
        forced: Any = False
        if choice == "required":
            forced = True
        elif isinstance(choice, dict):
            forced = (choice.get("function") or {}).get("name") or True
        prompt = build_prompt(engine.engine.chat_template, messages, tools, forced)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(1024, engine.engine.max_model_len - len(prompt.token_ids)))
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=settings.default_temperature if req.temperature is None else req.temperature,
            top_p=req.top_p or settings.default_top_p, top_k=req.top_k or 0, stop=stop, seed=req.seed, ignore_eos=req.ignore_eos,
        )
        _check_request(engine, prompt, sampling)
        stream = EngineStream(engine.generate(prompt.token_ids, sampling, request_id=request.state.request_id))
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _openai_stream(request, stream, prompt, cid, req.model, include_usage, settings)
        out = await _collect(request, stream)
        return JSONResponse(_openai_completion(cid, req.model, prompt, out))

    return app


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


async def _read_json(request: Request, settings: ServerSettings) -> dict[str, Any]:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > settings.max_body_bytes:
            raise RequestTooLarge(f"request body exceeds {settings.max_body_bytes} bytes")
    try:
        data = json.loads(bytes(body))
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8") from None
    except ValueError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
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
        raise InvalidRequest(f"{loc}: {first['msg']}" if loc else first["msg"]) from None


def _check_model(settings: ServerSettings, name: str) -> None:
    if name != settings.model_name and name not in settings.aliases:
        raise NotFound(f"model {name!r} not found; this server serves {settings.model_name!r}")


def _check_capacity(engine: AsyncEngine, settings: ServerSettings) -> None:
    """Before any tokenization: a full waiting queue rejects the request outright."""
    if not engine.is_alive:
        raise EngineUnavailable("the engine is not running")
    if engine.num_waiting >= settings.max_waiting:
        raise Overloaded(f"the waiting queue is full ({settings.max_waiting} requests)", headers={"retry-after": "1"})


def _check_request(engine: AsyncEngine, prompt: Prompt, sampling: SamplingParams) -> None:
    """Validate against the context length; a prompt with tools also stops at the end of a tool call."""
    if prompt.tool_names and tool_fmt.CLOSE not in sampling.stop:
        sampling.stop.append(tool_fmt.CLOSE)
    try:
        engine.engine.check_request(len(prompt.token_ids), sampling)
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None


def _error_response(e: APIError, request_id: str) -> JSONResponse:
    return JSONResponse(e.body(request_id), status_code=e.status, headers={**e.headers, "request-id": request_id})


def _kv_snapshot(engine) -> dict[str, int]:
    bm = engine.block_manager
    return {"total": bm.num_blocks, "free": bm.num_free_blocks, "cached": bm.num_cached_blocks, "in_use": bm.num_used_blocks}


def _model_card(settings: ServerSettings) -> dict[str, Any]:
    return {"type": "model", "id": settings.model_name, "display_name": settings.model_name, "created_at": settings.created_at}


# ---- running a request ---------------------------------------------------------------------------
async def _next_or_error(stream: EngineStream, timeout: float | None = None):
    try:
        return await stream.next(timeout)
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None
    except EngineDeadError as e:
        raise EngineUnavailable(str(e)) from None


async def _collect(request: Request, stream: EngineStream) -> RequestOutput:
    """Run a non-streaming request to the end; a client disconnect aborts it."""
    try:
        while True:
            out = await _next_or_error(stream, timeout=0.5)
            if out is None:
                if await request.is_disconnected():
                    raise EngineUnavailable("client disconnected")
                continue
            if out.finished:
                if out.finish_reason == "error":
                    raise APIError(out.error or "generation failed")
                return out
    except StopAsyncIteration:
        raise APIError("the request ended without a result") from None
    finally:
        await stream.close()


def _split_output(prompt: Prompt, text: str) -> tuple[str, list[tuple[str, dict]]]:
    full = (prompt.prefill if prompt.is_forced_tool else "") + text
    if not prompt.tool_names:
        return full, []
    return tool_fmt.parse_tool_calls(full, prompt.tool_names)


def _stop_reason(out: RequestOutput, has_calls: bool) -> tuple[str, str | None]:
    if has_calls:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str) and out.stop_reason != tool_fmt.CLOSE:
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _usage(out: RequestOutput) -> dict[str, int]:
    s = out.stats
    return {
        "input_tokens": s.num_prompt_tokens - s.num_cached_tokens,
        "output_tokens": s.num_output_tokens,
        "cache_read_input_tokens": s.num_cached_tokens,
        "cache_creation_input_tokens": s.num_cache_written_tokens,
    }


def _anthropic_message(msg_id: str, model: str, prompt: Prompt, out: RequestOutput) -> dict[str, Any]:
    text, calls = _split_output(prompt, out.text)
    content: list[dict[str, Any]] = []
    if text:
        content.append({"type": "text", "text": text})
    for name, args in calls:
        content.append({"type": "tool_use", "id": tool_fmt.new_tool_id(), "name": name, "input": args})
    stop_reason, stop_sequence = _stop_reason(out, bool(calls))
    return {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(out),
    }


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _first_output(stream: EngineStream, settings: ServerSettings):
    """Wait up to header_wait_s for prefill, so headers can carry its figures. Errors surface as 4xx here."""
    try:
        return await _next_or_error(stream, settings.header_wait_s)
    except StopAsyncIteration:
        return None
    except BaseException:
        await stream.close()
        raise


async def _anthropic_stream(request: Request, stream: EngineStream, prompt: Prompt, msg_id: str, model: str,
                            settings: ServerSettings) -> StreamingResponse:
    first = await _first_output(stream, settings)

    async def events():
        out = first
        index = 0
        text_open = False
        emitted = ""
        held = ""  # text that may be the start of a tool call, not yet released
        in_call = prompt.is_forced_tool
        try:
            usage0 = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
            if out is not None and out.stats is not None:
                usage0 = _usage(out)
                usage0["output_tokens"] = 0
            yield _sse("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage0}})
            last_ping = time.monotonic()
            while True:
                if out is None:
                    try:
                        out = await _next_or_error(stream, timeout=settings.ping_interval_s)
                    except StopAsyncIteration:
                        break
                    if out is None:
                        yield _sse("ping", {"type": "ping"})
                        last_ping = time.monotonic()
                        continue
                if out.delta_text and not in_call:
                    held += out.delta_text
                    cut = held.find(tool_fmt.OPEN) if prompt.tool_names else -1
                    if cut >= 0:
                        release, held, in_call = held[:cut], "", True
                    else:
                        keep = _partial_suffix(held, tool_fmt.OPEN) if prompt.tool_names else 0
                        release, held = held[: len(held) - keep], held[len(held) - keep:]
                    if release:
                        if not text_open:
                            yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                                               "content_block": {"type": "text", "text": ""}})
                            text_open = True
                        emitted += release
                        yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                           "delta": {"type": "text_delta", "text": release}})
                if time.monotonic() - last_ping > settings.ping_interval_s:
                    yield _sse("ping", {"type": "ping"})
                    last_ping = time.monotonic()
                if out.finished:
                    break
                out = None
            final = out
            text, calls = _split_output(prompt, final.text)
            if not calls and len(text) > len(emitted):  # held-back text that turned out not to be a call
                rest = text[len(emitted):]
                if not text_open:
                    yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": {"type": "text", "text": ""}})
                    text_open = True
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "text_delta", "text": rest}})
            if text_open:
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
            for name, args in calls:
                yield _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                    "type": "tool_use", "id": tool_fmt.new_tool_id(), "name": name, "input": {}}})
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(args, ensure_ascii=False)}})
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
            stop_reason, stop_sequence = _stop_reason(final, bool(calls))
            yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                         "usage": _usage(final)})
            yield _sse("message_stop", {"type": "message_stop"})
        except APIError as e:
            yield _sse("error", {"type": "error", "error": {"type": e.type, "message": e.message}})
        except Exception as e:  # after the 200 a failure becomes one error event, then the stream ends
            log.exception("stream failed")
            yield _sse("error", {"type": "error", "error": {"type": "api_error", "message": str(e) or "stream failed"}})
        finally:
            await stream.close()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of token."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


# ---- OpenAI shapes --------------------------------------------------------------------------------
def _openai_finish(out: RequestOutput, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if out.finish_reason == "length" else "stop"


def _openai_usage(out: RequestOutput) -> dict[str, Any]:
    s = out.stats
    return {"prompt_tokens": s.num_prompt_tokens, "completion_tokens": s.num_output_tokens,
            "total_tokens": s.num_prompt_tokens + s.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": s.num_cached_tokens}}


def _openai_tool_calls(calls) -> list[dict[str, Any]]:
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}} for n, a in calls]


def _openai_completion(cid: str, model: str, prompt: Prompt, out: RequestOutput) -> dict[str, Any]:
    text, calls = _split_output(prompt, out.text)
    message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        message["tool_calls"] = _openai_tool_calls(calls)
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": _openai_finish(out, bool(calls)), "logprobs": None}],
            "usage": _openai_usage(out)}


async def _openai_stream(request: Request, stream: EngineStream, prompt: Prompt, cid: str, model: str,
                         include_usage: bool, settings: ServerSettings) -> StreamingResponse:
    first = await _first_output(stream, settings)
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, usage=None, choices=True) -> bytes:
        body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if choices else []}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    async def events():
        out = first
        buffer_all = bool(prompt.tool_names)
        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                if out is None:
                    try:
                        out = await _next_or_error(stream, timeout=settings.ping_interval_s)
                    except StopAsyncIteration:
                        break
                    if out is None:
                        yield b": ping\n\n"
                        continue
                if out.delta_text and not buffer_all:
                    yield chunk({"content": out.delta_text})
                if out.finished:
                    break
                out = None
            text, calls = _split_output(prompt, out.text)
            if buffer_all and text:
                yield chunk({"content": text})
            if calls:
                yield chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(_openai_tool_calls(calls))]})
            yield chunk({}, finish=_openai_finish(out, bool(calls)))
            if include_usage:
                yield chunk({}, usage=_openai_usage(out), choices=False)
            yield b"data: [DONE]\n\n"
        except Exception as e:
            log.exception("stream failed")
            yield f"data: {json.dumps({'error': {'type': 'api_error', 'message': str(e)}})}\n\n".encode()
        finally:
            await stream.close()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
