"""Integrations against a real `stratum serve`: warm-up, LangChain, the FastAPI streaming proxy, client-side
Prometheus counters, and the Grafana dashboard's queries checked against the server's real /metrics."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from stratum.client import Stratum, awarmup, parse_stratum_cost, warmup
from tests.sse import META_ON
from tests.test_client_sdk import make_client, sse_events

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "stratum.json"
STATE = re.compile(r"^(queued|prefill_chunk_\d+|prefill_complete|decode_step_\d+|tool_use_prepared|finished)$")


# ---- warm-up -------------------------------------------------------------------------------------------
def test_warmup_reports_cache_creation_and_the_next_request_hits(tiny_server):
    client = Stratum(base_url=tiny_server.url, api_key="warm")
    doc = (f"[{uuid.uuid4()}] Handbook: returns within 30 days; shipping takes 3-5 business days; "
           "support is open 9-5. ") * 3
    prompt = {"system": doc, "messages": [{"role": "user", "content": "Summarise the handbook."}]}
    report = warmup(client, [prompt, {"model": "no-such-model", **prompt}], model="tiny")
    assert report.num_prompts == 2 and report.num_failed == 1 and report.results[1].status == 404
    assert report.cache_creation_input_tokens > 0
    assert report.results[0].usage["output_tokens"] == 0 and report.results[0].cost.kv_sparsity is None
    msg = client.messages.create(model="tiny", max_tokens=2, **prompt)
    assert msg.usage.cache_read_input_tokens >= report.cache_creation_input_tokens
    assert msg.stratum.cost.cache_hit_ratio > 0.5
    cold = client.messages.create(model="tiny", max_tokens=2, system=doc.replace("Handbook", "Manual"),
                                  messages=prompt["messages"])
    assert cold.stratum.cost.cache_hit_ratio < msg.stratum.cost.cache_hit_ratio

    async def run():
        from stratum.client import AsyncStratum
        return await awarmup(AsyncStratum(base_url=tiny_server.url, api_key="warm"), [f"{uuid.uuid4()} warm me"],
                             model="tiny")
    assert asyncio.run(run()).cache_creation_input_tokens > 0


# ---- LangChain -----------------------------------------------------------------------------------------
def test_langchain_gets_meta_and_cost(tiny_server):
    from langchain_anthropic import ChatAnthropic

    from stratum.client.langchain import ChatStratum, StratumCallbackHandler

    seen_meta, seen_cost = [], []
    handler = StratumCallbackHandler(on_meta=seen_meta.append, on_cost=seen_cost.append)
    llm = ChatStratum(model="tiny", base_url=tiny_server.url, api_key="lc", max_tokens=8, callbacks=[handler])
    chunks = list(llm.stream("Name a colour."))
    assert seen_meta and all(STATE.match(m["stratum_state"]) for m in seen_meta)
    assert seen_meta[0]["stratum_state"] == "prefill_complete" and 0 < seen_meta[0]["kv_cache_efficiency"] <= 1
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.response_metadata["stratum_meta"] == seen_meta
    assert seen_cost == [merged.response_metadata["stratum"]]
    assert parse_stratum_cost(seen_cost[0]["header"]).as_dict() == {**seen_cost[0]["cost"]}
    assert seen_cost[0]["final_cost_estimate"] > 0

    answer = llm.invoke("Name a fruit.")  # non-streaming: the cost from the headers
    assert parse_stratum_cost(answer.response_metadata["stratum"]["header"]) is not None
    assert handler.last_cost == answer.response_metadata["stratum"] and len(seen_cost) == 2

    async def run():
        metas = []
        h = StratumCallbackHandler(on_meta=metas.append)
        async for _ in llm.astream("Name a city.", config={"callbacks": [h]}):
            pass
        return metas, h.costs
    metas, costs = asyncio.run(run())
    assert metas and len(costs) == 1

    # what the stock integration delivers: the chunks arrive, the meta does not
    plain_handler = StratumCallbackHandler()
    list(ChatAnthropic(model="tiny", base_url=tiny_server.url, api_key="lc", max_tokens=8,
                       callbacks=[plain_handler]).stream("Name a colour."))
    assert plain_handler.metas == []


# ---- FastAPI streaming proxy ---------------------------------------------------------------------------
class RecordingAsyncTransport(httpx.AsyncBaseTransport):
    """The proxy's real upstream transport, recording each response body as the proxy reads it."""

    def __init__(self):
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[tuple[httpx.Request, httpx.Response, bytearray]] = []

    async def handle_async_request(self, request):
        response = await self.inner.handle_async_request(request)
        body = bytearray()
        self.bodies.append((request, response, body))
        inner_stream = response.stream

        class Recorded(httpx.AsyncByteStream):
            async def __aiter__(self):
                async for chunk in inner_stream:
                    body.extend(chunk)
                    yield chunk

            async def aclose(self):
                await inner_stream.aclose()

        return httpx.Response(response.status_code, headers=response.headers, stream=Recorded(),
                              extensions=response.extensions, request=request)


@pytest.fixture(scope="module")
def proxy(tiny_server):
    import uvicorn
    from fastapi import FastAPI

    from stratum.client.proxy import stratum_proxy_router

    tap = RecordingAsyncTransport()
    app = FastAPI()
    app.include_router(stratum_proxy_router(tiny_server.url, client=httpx.AsyncClient(transport=tap, timeout=60)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", tap
    server.should_exit = True
    thread.join(timeout=10)


def test_proxy_forwards_the_event_stream_byte_for_byte(proxy):
    url, tap = proxy
    body = {"model": "tiny", "max_tokens": 12, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Stream through the proxy."}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, headers={"X-Stratum-Debug": "true", **META_ON},
                      timeout=60) as r:
        received = b"".join(r.iter_raw())
        headers = r.headers
    request, upstream, upstream_body = tap.bodies[-1]
    assert request.headers["x-stratum-debug"] == "true"
    assert received == bytes(upstream_body) and received  # every byte, in order
    names = [n for n, _ in sse_events(received)]
    assert names[0] == "message_start" and "stratum_cost" in names and names[-1] == "message_stop"
    assert "stratum_meta" in names
    stratum_headers = {k: v for k, v in upstream.headers.items() if k.startswith("x-stratum-")}
    assert {"x-stratum-cost", "x-stratum-mode", "x-stratum-cache-mode"} <= set(stratum_headers)
    assert {k: headers[k] for k in stratum_headers} == stratum_headers
    assert headers["request-id"] == upstream.headers["request-id"]
    assert headers["content-type"] == upstream.headers["content-type"]


def test_proxy_passes_json_errors_and_negotiation(proxy):
    url, tap = proxy
    r = httpx.post(url + "/v1/messages",
                   json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.content == bytes(tap.bodies[-1][2])
    assert r.headers["x-stratum-cost"] == tap.bodies[-1][1].headers["x-stratum-cost"]
    missing = httpx.post(url + "/v1/messages",
                         json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert missing.headers["request-id"] == missing.json()["request_id"]
    # the SDK client through the proxy: negotiation is forwarded, so `.stratum` works
    client, _ = make_client(url)
    msg = client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "via proxy"}])
    assert client.is_stratum and msg.stratum.header == tap.bodies[-1][1].headers["x-stratum-cost"]


# ---- client-side Prometheus ----------------------------------------------------------------------------
def test_client_prometheus_counters_follow_the_reported_cost(tiny_server):
    from stratum.client.prometheus import ClientMetrics

    registry = CollectorRegistry()
    client = Stratum(base_url=tiny_server.url, api_key="prom", metrics=ClientMetrics(registry))
    stream = client.messages.create(model="tiny", max_tokens=6, stream=True,
                                    messages=[{"role": "user", "content": "hi"}])
    for _ in stream:
        pass
    msg = client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi again"}],
                                 extra_headers={"X-Stratum-Debug": "true"})

    def value(name, **labels):
        return registry.get_sample_value(name, labels) or 0.0

    usd = {}
    for info in (stream.stratum, msg.stratum):
        key = "true" if info.cost.is_cache_hit else "false"
        usd[key] = usd.get(key, 0.0) + info.final_cost_estimate
    for key, total in usd.items():
        assert value("stratum_client_cost_dollars_total", model="tiny", cache_hit=key) == pytest.approx(total)
    assert value("stratum_client_requests_total", model="tiny", mode="normal") == 2
    assert value("stratum_client_tokens_total", model="tiny", kind="output") == 6 + msg.usage.output_tokens
    assert value("stratum_client_cache_hit_ratio_count", model="tiny") == 2
    assert value("stratum_client_prefill_latency_seconds_sum", model="tiny") == pytest.approx(
        stream.stratum.cost.prefill_latency_s + msg.stratum.cost.prefill_latency_s)


# ---- Grafana -------------------------------------------------------------------------------------------
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless"}


def metric_names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords, label names
    in by/without/on/ignoring, label matchers, durations or template variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = m.group()
        if word in PROMQL_WORDS or expr[m.end():].lstrip().startswith("("):
            continue
        if re.fullmatch(r"\d*e\d*|inf|nan", word, re.IGNORECASE):
            continue
        names.add(word)
    return names


def exposed_series(text: str) -> set[str]:
    """Every series name /metrics can expose: the samples present, plus each family's names by its type
    (counters as _total, histograms as _bucket/_sum/_count), so a labelled family with no child yet counts."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {"counter": {family.name + "_total"},
                  "histogram": {family.name + s for s in ("_bucket", "_sum", "_count")},
                  "gauge": {family.name}}.get(family.type, {family.name})
    return names


def test_grafana_queries_reference_only_real_metrics(tiny_server):
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for wanted in ("cost per second", "cache hit ratio", "kv sparsity distribution", "time to first token",
                   "inter-token latency", "queue depth", "admission rejections by reason", "engine mode"):
        assert wanted in titles, wanted
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [re.sub(r"^label_values\((\w+).*", r"\1", v["query"]["query"]) for v in dashboard["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    assert len(exprs) >= 15

    client = Stratum(base_url=tiny_server.url, api_key="grafana")
    list(client.messages.create(model="tiny", max_tokens=4, stream=True, messages=[{"role": "user", "content": "hi"}]))
    exposed = exposed_series(httpx.get(tiny_server.url + "/metrics", timeout=10).text)

    referenced = set()
    for expr in exprs:
        names = metric_names_in(expr)
        assert names, expr
        assert names <= exposed, (expr, names - exposed)
        referenced |= names
    assert {"stratum_cost_dollars_total", "stratum_kv_sparsity_bucket", "stratum_time_to_first_token_seconds_bucket",
            "stratum_inter_token_latency_seconds_bucket", "stratum_num_requests_waiting",
            "stratum_admission_rejections_total", "stratum_engine_mode"} <= referenced


def test_promql_name_extraction():
    assert metric_names_in(
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{x=~"$i"}[$__rate_interval])))') == {"a_bucket"}
    assert metric_names_in("sum(rate(a_total[5m])) / clamp_min(sum(rate(b_total[5m])), 1e-9)") == {"a_total", "b_total"}
    assert metric_names_in('max by (mode) (c{instance=~"$instance"}) == bool 1') == {"c"}


def test_proxy_answers_502_when_stratum_is_unreachable():
    import socket

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from stratum.client.proxy import stratum_proxy_router

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = FastAPI()
    app.include_router(stratum_proxy_router(f"http://127.0.0.1:{port}"))
    with TestClient(app) as http:
        r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 1, "messages": []})
    assert r.status_code == 502 and r.json()["error"]["type"] == "api_error"


# ---- the real default model ----------------------------------------------------------------------------
WEATHER_TOOL = {"name": "get_weather", "description": "The current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.integration
def test_real_model_meta_states_and_a_semantically_cached_answer(real_server):
    from stratum.client import SemanticCache

    client = Stratum(base_url=real_server.url, api_key="real")
    metas = []
    stream = client.messages.create(model="smollm2-135m", max_tokens=60, tools=[WEATHER_TOOL],
                                    tool_choice={"type": "any"}, stream=True, extra_body={"temperature": 0},
                                    event_hooks={"stratum_meta": metas.append},
                                    messages=[{"role": "user", "content": "What is the weather in Tokyo?"}])
    blocks = [e.content_block.type for e in stream if e.type == "content_block_start"]
    assert blocks == ["tool_use"]
    states = [m.stratum_state for m in metas]  # one per argument fragment, streamed as generated
    assert states[0] == "tool_use_prepared" and len(states) > 1  # the runtime saw the call begin
    assert stream.stratum.is_final and stream.stratum.final_cost_estimate > 0

    def ask(question: str) -> str:
        m = client.messages.create(model="smollm2-135m", max_tokens=20, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": question + " Answer in one word."}])
        return m.content[0].text

    cache = SemanticCache(threshold=0.75)
    first = cache.get_or_compute("What is the capital of Japan?", ask, scope="smollm2-135m")
    second = cache.get_or_compute("Which city is the capital of Japan?", ask, scope="smollm2-135m")
    assert not first.is_hit and "Tokyo" in first.answer
    assert second.is_hit and second.answer == first.answer and second.similarity >= 0.75
