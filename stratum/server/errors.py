"""API errors, and the one module that shapes them: every error body and every SSE error event.

Anthropic routes answer in Anthropic's shape,
    {"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}
and OpenAI routes (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`) in OpenAI's,
    {"error": {"message": ..., "type": ..., "param": null, "code": ...}, "request_id": ...}
(a Responses stream that fails after its 200 ends with the Responses API's own `error` event),
both with the request id, which every response also carries as the `request-id` header. Ollama's
routes (`/`, `/api/...`) answer in Ollama's, `{"error": ...}`, and a full queue there is Ollama's 503.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.responses import JSONResponse  # what fastapi.responses re-exports, without importing FastAPI

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/rerank",
                "/v2/rerank", "/rerank")
RESPONSES_PATH = "/v1/responses"
OLLAMA_PREFIX = "/api/"
# OpenAI names server-side failures "server_error"; the other types read the same in both APIs.
_OPENAI_TYPES = {"api_error": "server_error", "overloaded_error": "server_error"}


class APIError(Exception):
    status = 500
    type = "api_error"

    def __init__(self, message: str, headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.extra = extra or {}
        self.param = param  # the request field at fault (OpenAI's `param`), where one is
        self.code = code  # OpenAI's machine-readable `code` (e.g. context_length_exceeded), where one is

    def status_on(self, path: str) -> int:
        """The HTTP status on a route: the same on every API but where an API words it otherwise."""
        return self.status


class InvalidRequest(APIError):
    status, type = 400, "invalid_request_error"


class AuthenticationFailed(APIError):
    status, type = 401, "authentication_error"


class NotFound(APIError):
    status, type = 404, "not_found_error"


class MethodNotAllowed(APIError):
    status, type = 405, "invalid_request_error"


class BodyTimeout(APIError):
    status, type = 408, "timeout_error"


class ClientDisconnected(APIError):
    """The client left before its answer (while sending its body, or while a non-streamed answer ran):
    499, nginx's "client closed request", so the metrics never count a hang-up as a server error. The
    answer is for the log and metrics, not for the client."""

    status, type = 499, "invalid_request_error"


class RequestTooLarge(APIError):
    status, type = 413, "request_too_large"


class HeadersTooLarge(APIError):
    status, type = 431, "request_too_large"


class CachePollution(APIError):
    """418: the session keeps defeating the prefix cache (see docs/telemetry.md)."""

    status, type = 418, "invalid_request_error"


class RateLimited(APIError):
    status, type = 429, "rate_limit_error"


class Overloaded(APIError):
    """Anthropic's 529; OpenAI answers an overloaded server with 503 and `server_error`, which its SDK and
    litellm (ServiceUnavailableError) read as retryable, where 529 is an unclassified status to them; Ollama
    answers 503 too."""

    status, type = 529, "overloaded_error"

    def status_on(self, path: str) -> int:
        return 503 if is_openai(path) or is_ollama(path) else self.status  # Ollama's "server busy" too


class EngineUnavailable(APIError):
    status, type = 503, "api_error"


def as_api_error(e: BaseException) -> APIError:
    """An engine-side failure as the API error it answers with."""
    from stratum.engine.outputs import EngineDeadError
    from stratum.engine.sampling_params import InvalidRequestError

    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return InvalidRequest(str(e))
    if isinstance(e, EngineDeadError):
        return EngineUnavailable(str(e))
    return APIError(str(e) or type(e).__name__)


def new_request_id() -> str:
    """The id of one request, on its response's `request-id` header and in its error bodies."""
    return "req_" + uuid.uuid4().hex[:24]


def is_openai(path: str) -> bool:
    return path.startswith(OPENAI_PATHS)


def is_ollama(path: str) -> bool:
    return path == "/" or path == "/api" or path.startswith(OLLAMA_PREFIX)


def error_object(e: APIError) -> dict[str, Any]:
    """Anthropic's error object: what an error body holds under `error`, and a Message Batches errored
    result's `error`."""
    return {"type": e.type, "message": e.message, **e.extra}


def error_body(e: APIError, request_id: str, path: str) -> dict[str, Any]:
    if is_ollama(path):
        return {"error": e.message}
    if is_openai(path):
        code = e.code or e.extra.get("stratum_reason")
        error = {"message": e.message, "type": _OPENAI_TYPES.get(e.type, e.type), "param": e.param, "code": code,
                 **e.extra}
        return {"error": error, "request_id": request_id}
    return {"type": "error", "error": error_object(e), "request_id": request_id}


def error_response(e: APIError, request_id: str, path: str) -> JSONResponse:
    return JSONResponse(error_body(e, request_id, path), status_code=e.status_on(path),
                        headers={**e.headers, "request-id": request_id})


def sse_error(e: APIError, request_id: str, path: str, sequence_number: int = 0) -> bytes:
    """The one event that ends a stream that fails after its 200: Anthropic's `event: error`, an
    OpenAI `data:` chunk holding the error object, or the Responses API's `error` event."""
    if path.startswith(RESPONSES_PATH):
        error = error_body(e, request_id, path)["error"]
        body = json.dumps({"type": "error", "code": error["code"] or error["type"], "message": e.message,
                           "param": e.param, "sequence_number": sequence_number}, ensure_ascii=False)
        return f"event: error\ndata: {body}\n\n".encode()
    body = json.dumps(error_body(e, request_id, path), ensure_ascii=False)
    return f"data: {body}\n\n".encode() if is_openai(path) else f"event: error\ndata: {body}\n\n".encode()
