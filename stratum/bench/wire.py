"""The benchmarks' HTTP client: one streamed request to an Anthropic- or OpenAI-compatible server, its
server-sent events read as they arrive, and what it measured (`RequestResult`: TTFT, the arrival of
every content chunk, end-to-end time, the usage the server reported).
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

API_PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}
ANTHROPIC_VERSION = "2023-06-01"


class BenchError(Exception):
    """Bad input to a benchmark (a refused URL, an unreachable server): reported, exit status 2."""


class StreamError(Exception):
    """A request that failed on the wire: an HTTP error status, an error event, or a truncated stream."""


@dataclass(slots=True)
class RequestResult:
    """One request's timings and usage. Times are seconds since the request was sent."""

    conversation: int
    turn: int
    kind: str
    start_s: float = 0.0  # when it was sent, since the level started
    is_ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of every event that carried content
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    has_usage: bool = False  # False: the server reported no usage, so output tokens are counted as chunks
    text: str = ""

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Target:
    """A server and what every request to it asks for."""

    url: str  # base URL, without /v1
    api: str  # "anthropic" or "openai"
    model: str
    max_tokens: int = 64
    temperature: float = 0.0
    is_ignore_eos: bool = False
    api_key: str | None = None


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: not resolved, so not known to be loopback
        return False


def check_url(url: str, allow_remote: bool) -> None:
    """Raises BenchError for a URL that is not http(s), or not loopback without allow_remote."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"{url!r} is not an http(s) URL")
    if not allow_remote and not is_loopback(url):
        raise BenchError(f"{url} is not a loopback address (127.0.0.0/8, localhost, ::1); pass --allow-remote "
                         "to load another host")


def auth_headers(api: str, api_key: str | None) -> dict[str, str]:
    if api == "anthropic":
        return {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": api_key} if api_key else {})}
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def discover_model(url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The first model id of GET /v1/models (Stratum, llama-server and vLLM all list one).

    Raises:
        BenchError: the server is unreachable or lists no model.
    """
    try:
        resp = httpx.get(base_url(url) + "/v1/models", headers=auth_headers("openai", api_key)
                         | auth_headers("anthropic", api_key), timeout=timeout_s, trust_env=False)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"cannot list models at {url}/v1/models ({e}); pass --model") from None


def request_body(target: Target, system: str | None, messages: list[dict[str, str]]) -> dict[str, Any]:
    """A streaming request in the target's API; ignore_eos is vLLM's extension (Stratum and llama-server take it)."""
    if target.api == "anthropic":
        body: dict[str, Any] = {"model": target.model, "max_tokens": target.max_tokens, "messages": messages,
                                "stream": True, "temperature": target.temperature}
        if system:
            body["system"] = system
    else:
        body = {"model": target.model, "max_tokens": target.max_tokens, "stream": True,
                "messages": ([{"role": "system", "content": system}] if system else []) + messages,
                "stream_options": {"include_usage": True}, "temperature": target.temperature}
    if target.is_ignore_eos:
        body["ignore_eos"] = True
    return body


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) per server-sent event; comments are skipped, an unnamed event is "message"."""
    name, data = "message", []
    async for line in lines:
        if line == "":
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].removeprefix(" "))
    if data:
        yield name, "\n".join(data)


def _record_content(r: RequestResult, now_s: float, text: str) -> None:
    if r.ttft_s is None:
        r.ttft_s = now_s
    r.chunk_times_s.append(now_s)
    r.text += text


def anthropic_event(r: RequestResult, name: str, data: str, usage: dict[str, Any], now_s: float) -> bool:
    """Apply one Messages API event; True at message_stop."""
    obj = json.loads(data)
    kind = obj.get("type", name) if isinstance(obj, dict) else name
    if kind == "error":
        err = obj.get("error") or {}
        raise StreamError(f"error event: {err.get('type', '')}: {err.get('message', data)}")
    if kind == "message_start":
        usage.update((obj.get("message") or {}).get("usage") or {})
    elif kind == "content_block_delta":
        delta = obj.get("delta") or {}
        if delta.get("type") == "text_delta" and delta.get("text"):
            _record_content(r, now_s, delta["text"])
        elif delta.get("type") == "thinking_delta" and delta.get("thinking"):
            _record_content(r, now_s, "")  # a generated token too, but not part of the reply
    elif kind == "message_delta":
        if obj.get("usage"):
            usage.update(obj["usage"])
            r.has_usage = "output_tokens" in obj["usage"]
    return kind == "message_stop"


def openai_event(r: RequestResult, data: str, usage: dict[str, Any], now_s: float) -> bool:
    """Apply one chat.completion.chunk; True at [DONE]."""
    if data.strip() == "[DONE]":
        return True
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise StreamError(f"unexpected chunk: {data[:200]}")
    if obj.get("error"):
        err = obj["error"]
        raise StreamError(f"error chunk: {err.get('message', err) if isinstance(err, dict) else err}")
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            _record_content(r, now_s, delta["content"])
        elif delta.get("reasoning_content"):  # llama-server's thinking tokens
            _record_content(r, now_s, "")
    if obj.get("usage"):
        usage.update(obj["usage"])
        r.has_usage = "completion_tokens" in obj["usage"]
    return False


def apply_usage(r: RequestResult, api: str, usage: dict[str, Any]) -> None:
    """Token counts from the usage the server reported; chunks stand in for output tokens without it."""
    if api == "anthropic":
        # Anthropic's input_tokens excludes cache reads and cache writes; the prompt is all three.
        r.num_cached_tokens = int(usage.get("cache_read_input_tokens") or 0)
        r.num_prompt_tokens = (int(usage.get("input_tokens") or 0) + r.num_cached_tokens
                               + int(usage.get("cache_creation_input_tokens") or 0))
        out = usage.get("output_tokens")
    else:
        r.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
        r.num_cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        out = usage.get("completion_tokens")
    r.num_output_tokens = int(out) if r.has_usage and out is not None else len(r.chunk_times_s)


async def send_request(client: httpx.AsyncClient, target: Target, system: str | None,
                       messages: list[dict[str, str]], r: RequestResult) -> None:
    """Stream one request and fill r; failures are recorded in r.error, never raised (cancellation is)."""
    headers = auth_headers(target.api, target.api_key)
    body = request_body(target, system, messages)
    usage: dict[str, Any] = {}
    is_done = False
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", target.url + API_PATHS[target.api], json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                raise StreamError(f"HTTP {resp.status_code}: {detail}")
            async for name, data in sse_events(resp.aiter_lines()):
                now_s = time.perf_counter() - t0
                if target.api == "anthropic":
                    is_done = anthropic_event(r, name, data, usage, now_s)
                else:
                    is_done = openai_event(r, data, usage, now_s)
                if is_done:
                    break
        r.e2e_s = time.perf_counter() - t0
        if not is_done:
            raise StreamError("stream ended before its final event")
        if r.ttft_s is None:
            raise StreamError("empty reply: no content delta")
        apply_usage(r, target.api, usage)
        r.is_ok = True
    except (httpx.HTTPError, StreamError, ValueError) as e:  # ValueError: a malformed JSON event
        r.error = f"{type(e).__name__}: {e}" if not isinstance(e, StreamError) else str(e)
