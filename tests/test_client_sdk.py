"""stratum.client.Stratum against a real `stratum serve`: `.stratum` equals what went over the wire, hooks fire
with the `meta` states the server sent, negotiation is silent, and a non-Stratum server gets the plain SDK.

What the server sent is read by a recording transport under the SDK's own http client: real bytes, not a mock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time

import anthropic
import httpx2
import pytest

from stratum.client import AsyncStratum, Stratum, StratumCost, decode_trace, parse_stratum_cost
from stratum.client.cost import StratumMeta
from tests.sse import sse_events as parse_sse

PROMPT = [{"role": "user", "content": "Name three colours."}]


# ---- helpers shared with the other client tests --------------------------------------------------------
class RecordingTransport(httpx2.BaseTransport):
    """Passes every request to a real HTTPTransport and records the request and the response bytes as read."""

    def __init__(self):
        self.inner = httpx2.HTTPTransport()
        self.exchanges: list[tuple[httpx2.Request, httpx2.Response, bytearray]] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.inner.handle_request(request)
        body = bytearray()
        self.exchanges.append((request, response, body))
        inner_stream = response.stream

        class Recorded(httpx2.SyncByteStream):
            def __iter__(self):
                for chunk in inner_stream:
                    body.extend(chunk)
                    yield chunk

            def close(self):
                inner_stream.close()

        return httpx2.Response(response.status_code, headers=response.headers, stream=Recorded(),
                               extensions=response.extensions, request=request)

    def requests(self, method: str | None = None) -> list[httpx2.Request]:
        return [r for r, _, _ in self.exchanges if method is None or r.method == method]

    def close(self) -> None:
        self.inner.close()


class AsyncRecordingTransport(httpx2.AsyncBaseTransport):
    def __init__(self):
        self.inner = httpx2.AsyncHTTPTransport()
        self.exchanges: list[tuple[httpx2.Request, httpx2.Response, bytearray]] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        body = bytearray()
        self.exchanges.append((request, response, body))
        inner_stream = response.stream

        class Recorded(httpx2.AsyncByteStream):
            async def __aiter__(self):
                async for chunk in inner_stream:
                    body.extend(chunk)
                    yield chunk

            async def aclose(self):
                await inner_stream.aclose()

        return httpx2.Response(response.status_code, headers=response.headers, stream=Recorded(),
                               extensions=response.extensions, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    """(event, data) pairs of a captured SSE body."""
    return parse_sse(raw.decode().splitlines())


def make_client(url: str, **kwargs) -> tuple[Stratum, RecordingTransport]:
    tap = RecordingTransport()
    return Stratum(base_url=url, api_key=kwargs.pop("api_key", "test-key"), http_client=httpx2.Client(transport=tap),
                   **kwargs), tap


# ---- parsing -------------------------------------------------------------------------------------------
def test_import_does_not_load_torch_or_the_engine():
    code = ("import sys, stratum.client as c\n"
            "from stratum.client import Stratum, AsyncStratum, parse_stratum_cost, SemanticCache, RetryPolicy, "
            "standardize_fingerprint, warmup\n"
            "import stratum.client.prometheus, stratum.client.proxy\n"
            "bad = [m for m in ('torch', 'stratum.engine', 'sentence_transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_exported_name_resolves():
    import stratum.client as package

    for name in package.__all__:
        assert getattr(package, name) is not None, name
    assert callable(package.warmup) and package.warmup.__module__ == "stratum.client.warmup"


@pytest.mark.parametrize("header, expected", [
    ("cache_hit_ratio=0.82,prefill_latency_us=14200,kv_sparsity=0.33", StratumCost(0.82, 14200, 0.33)),
    ("cache_hit_ratio=0,prefill_latency_us=951", StratumCost(0.0, 951, None)),
    ("cache_hit_ratio=1,prefill_latency_us=3,kv_sparsity=0.0417", StratumCost(1.0, 3, 0.0417)),
    (" cache_hit_ratio=0.5 , prefill_latency_us=10 ", StratumCost(0.5, 10, None)),
    ("cache_hit_ratio=0.5,prefill_latency_us=10,kv_sparsity=0.2,new_field=7",
     StratumCost(0.5, 10, 0.2, extra=(("new_field", "7"),))),
    ("cache_hit_ratio=0,prefill_latency_us=9,kv_sparsity=0.5,spec_proposed_tokens=40,spec_accepted_tokens=31",
     StratumCost(0.0, 9, 0.5, 40, 31)),
])
def test_parse_stratum_cost(header, expected):
    cost = parse_stratum_cost(header)
    assert cost == expected
    assert parse_stratum_cost(cost.header()) == cost
    assert cost.is_cache_hit == (expected.cache_hit_ratio > 0)


@pytest.mark.parametrize("bad", ["", "cache_hit_ratio", "cache_hit_ratio=0.5", "prefill_latency_us=3",
                                 "cache_hit_ratio=x,prefill_latency_us=3",
                                 "cache_hit_ratio=0.1,prefill_latency_us=3,kv_sparsity="])
def test_parse_stratum_cost_rejects_malformed(bad):
    with pytest.raises(ValueError):
        parse_stratum_cost(bad)


def test_meta_step():
    assert StratumMeta("decode_step_12", 0.5).step == 12
    assert StratumMeta("prefill_chunk_0", 0.5).step == 0
    assert StratumMeta("prefill_complete", 0.5).step is None


# ---- against the server --------------------------------------------------------------------------------
def test_message_stratum_equals_the_headers(tiny_server):
    client, tap = make_client(tiny_server.url)
    msg = client.messages.create(model="tiny", max_tokens=4, messages=PROMPT, extra_headers={"X-Stratum-Debug": "true"})
    _, response, _ = tap.exchanges[-1]
    header = response.headers["x-stratum-cost"]
    assert isinstance(msg, anthropic.types.Message) and msg.content
    assert msg.stratum.header == header
    assert msg.stratum.cost == msg.stratum.header_cost == parse_stratum_cost(header)
    assert msg.stratum.mode == response.headers["x-stratum-mode"] == "normal"
    assert msg.stratum.request_id == response.headers["request-id"]
    trace = json.loads(__import__("base64").b64decode(response.headers["x-stratum-trace"]))
    assert msg.stratum.trace == trace == decode_trace(response.headers["x-stratum-trace"])
    assert msg.stratum.final_cost_estimate == trace["final_cost_estimate"]
    assert msg.stratum.usage["output_tokens"] == msg.usage.output_tokens
    assert "stratum" not in msg.model_dump()  # the SDK object serialises as before


def test_stream_hooks_fire_with_the_states_the_server_sent(tiny_server):
    client, tap = make_client(tiny_server.url)
    metas, costs = [], []
    stream = client.messages.create(model="tiny", max_tokens=12, messages=PROMPT, stream=True,
                                    extra_body={"ignore_eos": True},
                                    event_hooks={"stratum_meta": metas.append, "stratum_cost": costs.append})
    assert isinstance(stream, anthropic.Stream)
    assert stream.stratum.header_cost == parse_stratum_cost(tap.exchanges[-1][1].headers["x-stratum-cost"])
    assert not stream.stratum.is_final
    types = [event.type for event in stream]
    assert types[0] == "message_start" and types[-1] == "message_stop"  # the SDK's events, unchanged

    wire = sse_events(bytes(tap.exchanges[-1][2]))
    assert tap.exchanges[-1][0].headers["x-stratum-meta"] == "on"  # the client asks for Stratum's events
    sent = [StratumMeta.from_wire(d["meta"], d["index"]) for n, d in wire if n == "stratum_meta"]
    assert sent and metas == sent
    assert metas[0].stratum_state == "prefill_complete"
    assert all(m.stratum_state.startswith("decode_step_") for m in metas[1:])
    (final,) = [d for n, d in wire if n == "stratum_cost"]
    assert costs == [stream.stratum] and stream.stratum.is_final
    assert stream.stratum.final_cost == StratumCost.from_dict(final["cost"]) == parse_stratum_cost(final["header"])
    assert stream.stratum.final_cost_estimate == final["final_cost_estimate"]
    assert stream.stratum.metas == metas
    assert stream.stratum.usage["output_tokens"] == 12


def test_async_stream_hooks_and_message(tiny_server):
    async def run():
        tap = AsyncRecordingTransport()
        client = AsyncStratum(base_url=tiny_server.url, api_key="k", http_client=httpx2.AsyncClient(transport=tap))
        metas = []

        async def on_meta(m):  # coroutine hooks are awaited
            metas.append(m)

        stream = await client.messages.create(model="tiny", max_tokens=6, messages=PROMPT, stream=True,
                                              extra_body={"ignore_eos": True}, event_hooks={"stratum_meta": on_meta})
        async for _ in stream:
            pass
        wire = sse_events(bytes(tap.exchanges[-1][2]))
        assert metas and metas == [StratumMeta.from_wire(d["meta"], d["index"]) for n, d in wire
                                   if n == "stratum_meta"]
        assert stream.stratum.is_final and stream.stratum.final_cost is not None
        msg = await client.messages.create(model="tiny", max_tokens=3, messages=PROMPT)
        assert msg.stratum.header == tap.exchanges[-1][1].headers["x-stratum-cost"]
        assert [r.method for r, _, _ in tap.exchanges] == ["OPTIONS", "POST", "POST"]

    asyncio.run(run())


def test_with_raw_response_parses_to_the_stratum_object(tiny_server):
    client, _ = make_client(tiny_server.url)
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=3, messages=PROMPT)
    msg = raw.parse()
    assert msg.stratum.header == raw.headers["x-stratum-cost"]
    assert client.messages.count_tokens(model="tiny", messages=PROMPT).input_tokens > 0  # other SDK calls unchanged
    assert client.models.list().data[0].id == "tiny"


def test_negotiates_once_on_first_use(tiny_server, caplog):
    caplog.set_level(logging.DEBUG, logger="stratum")
    client, tap = make_client(tiny_server.url)
    assert tap.exchanges == []  # nothing before first use
    client.messages.create(model="tiny", max_tokens=1, messages=PROMPT)
    client.with_options(timeout=30).messages.create(model="tiny", max_tokens=1, messages=PROMPT)
    methods = [r.method for r in tap.requests()]
    assert methods == ["OPTIONS", "POST", "POST"]
    options = tap.requests("OPTIONS")[0]
    assert options.headers["x-stratum-negotiate"] == "v1" and options.url.path == "/v1/messages"
    assert client.is_stratum
    assert not [r for r in caplog.records if r.name.startswith("stratum")]


# ---- a server that is not Stratum ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_server():
    """An Anthropic-shaped server that knows nothing of Stratum: no OPTIONS route, no x-stratum-* headers.
    Its first POST answers 529 (with retry-after-ms), so the SDK's own retry shows."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[dict] = []

    async def messages(request):
        seen.append({"headers": dict(request.headers), "body": await request.json()})
        if len(seen) == 1:
            return JSONResponse({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}},
                                status_code=529, headers={"retry-after-ms": "10"})
        return JSONResponse({"id": "msg_plain", "type": "message", "role": "assistant", "model": "plain",
                             "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
                             "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}})

    app = Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(timeout=10)


def test_a_plain_server_gets_the_plain_sdk(plain_server, caplog):
    url, seen = plain_server
    caplog.set_level(logging.DEBUG)
    retries = []
    client, tap = make_client(url, event_hooks={"retry": retries.append})
    msg = client.messages.create(model="plain", max_tokens=5, messages=PROMPT, session_keys={"user": "1"})
    assert msg.content[0].text == "hello" and msg.stratum is None
    assert not client.is_stratum
    # the SDK's own retry handled the 529 (the Stratum policy is not involved): OPTIONS, POST 529, POST 200
    assert [(r.method, resp.status_code) for r, resp, _ in tap.exchanges] == [
        ("OPTIONS", 405), ("POST", 529), ("POST", 200)]
    assert retries == []
    for s in seen:
        assert not [h for h in s["headers"] if h.startswith("x-stratum")]
        assert "metadata" not in s["body"]
    assert not [r for r in caplog.records if r.name.startswith("stratum") or r.levelno >= logging.WARNING]
