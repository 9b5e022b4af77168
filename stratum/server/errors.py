"""API errors, mapped to Anthropic's error body in one place.

Body: {"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    status = 500
    type = "api_error"

    def __init__(self, message: str, headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self, request_id: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message, **self.extra}, "request_id": request_id}


class InvalidRequest(APIError):
    status, type = 400, "invalid_request_error"


class AuthenticationFailed(APIError):
    status, type = 401, "authentication_error"


class PermissionDenied(APIError):
    status, type = 403, "permission_error"


class NotFound(APIError):
    status, type = 404, "not_found_error"


class RequestTooLarge(APIError):
    status, type = 413, "request_too_large"


class RateLimited(APIError):
    status, type = 429, "rate_limit_error"


class Overloaded(APIError):
    status, type = 529, "overloaded_error"


class EngineUnavailable(APIError):
    status, type = 503, "api_error"
