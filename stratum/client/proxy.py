"""A streaming proxy router for FastAPI: forwards the Messages API to a Stratum server and back unchanged.

The response body is relayed chunk by chunk as it arrives (SSE included, byte for byte: pings, and the
`stratum_meta` and `stratum_cost` events a caller asked for reach it), and the `x-stratum-*`, `request-id`,
`retry-after` and `anthropic-ratelimit-*` headers pass through.
Mount it with `app.include_router(stratum_proxy_router(url))`.
"""

from __future__ import annotations

from typing import Iterable

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

# Request headers a caller may send on to Stratum (besides x-stratum-*).
FORWARD_REQUEST_HEADERS = ("content-type", "accept", "anthropic-version", "anthropic-beta", "x-api-key",
                           "authorization")
# Response headers passed back (besides x-stratum-* and anthropic-ratelimit-*); hop-by-hop ones never are.
FORWARD_RESPONSE_HEADERS = ("content-type", "content-encoding", "cache-control", "request-id", "retry-after")
ROUTES = (("POST", "/v1/messages"), ("OPTIONS", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
          ("GET", "/v1/models"), ("POST", "/v1/chat/completions"))


def _pick(headers: Iterable[tuple[str, str]], names: tuple[str, ...],
          prefixes: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() in names or k.lower().startswith(prefixes)]


def stratum_proxy_router(upstream: str, *, client: httpx.AsyncClient | None = None, api_key: str | None = None,
                         timeout: float = 600.0) -> APIRouter:
    """Args:
        upstream: the Stratum server's base URL.
        client: the httpx.AsyncClient to reach it with (one is made if None; the app owns its lifetime then
            through the router's shutdown).
        api_key: sent upstream as x-api-key instead of whatever key the caller sent (None: the caller's key
            is forwarded).
        timeout: per-request read timeout upstream.
    Returns:
        An APIRouter with POST /v1/messages (and count_tokens), OPTIONS /v1/messages (negotiation),
        GET /v1/models and POST /v1/chat/completions.
    """
    owned = client is None
    http = client if client is not None else httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))
    base = upstream.rstrip("/")

    async def forward(request: Request):
        headers = _pick(request.headers.items(), FORWARD_REQUEST_HEADERS, ("x-stratum-",))
        if api_key is not None:
            headers = [(k, v) for k, v in headers if k.lower() not in ("x-api-key", "authorization")]
            headers.append(("x-api-key", api_key))
        body = await request.body()
        upstream_request = http.build_request(request.method, base + request.url.path, params=request.query_params,
                                              headers=headers, content=body)
        try:
            response = await http.send(upstream_request, stream=True)
        except httpx.HTTPError as e:
            return JSONResponse({"type": "error", "error": {"type": "api_error",
                                 "message": f"upstream Stratum server unreachable: {type(e).__name__}: {e}"}},
                                status_code=502)
        passed = dict(_pick(response.headers.items(), FORWARD_RESPONSE_HEADERS, ("x-stratum-", "anthropic-ratelimit-")))

        async def relay():
            try:
                async for chunk in response.aiter_raw():  # raw: no decoding, no re-chunking of SSE
                    yield chunk
            finally:
                await response.aclose()

        # content-type travels in `passed`, as upstream wrote it (no media_type: Starlette would add a charset)
        return StreamingResponse(relay(), status_code=response.status_code, headers=passed)

    router = APIRouter(on_shutdown=[http.aclose] if owned else [])
    for method, path in ROUTES:
        router.add_api_route(path, forward, methods=[method], include_in_schema=False)
    return router
