"""Degraded basic mode: a fault in the scheduler or the prefix-cache logic does not stop serving.

STRATUM_FAULT_INJECT=scheduler|cache makes the first engine step raise; the engine switches to
basic mode (FIFO, one sequence at a time, no prefix cache) and keeps every request. The scheduler
fault runs on the real model, so that "still serving" means a right answer, not just a 200; the cache
fault runs on the tiny model (its answers are random, so only their shape is checked) to keep the
suite fast.
"""

from __future__ import annotations

import concurrent.futures

import anthropic
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess
from tests.test_telemetry_cost import parse_cost, sse_events

QUESTION = "What is the capital of France?"
MODEL = "m"  # the served model name of both servers


@pytest.fixture(scope="module", params=[
    pytest.param("scheduler", marks=pytest.mark.integration),
    "cache",
])
def faulty(request):
    """(fault, server, /health before any request, is_real_model)."""
    fault = request.param
    is_real = fault == "scheduler"
    model = (str(request.getfixturevalue("real_model_path")) if is_real
             else str(request.getfixturevalue("tiny_model_dir")))
    server = ServerProcess(model, "--served-model-name", MODEL, env={"STRATUM_FAULT_INJECT": fault}).wait_ready()
    health = httpx.get(server.url + "/health", timeout=10).json()
    yield fault, server, health, is_real
    server.stop()


def ask(url: str, question: str = QUESTION, **extra) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": question}], **extra}
    return httpx.post(url + "/v1/messages", json=body, timeout=120)


def check_answer(text: str, expected: str, is_real: bool) -> None:
    if is_real:
        assert expected in text, text
    else:
        assert isinstance(text, str) and text


def engine_mode_gauge(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "stratum_engine_mode")
    return {s.labels["mode"]: s.value for s in family.samples}


def test_requests_still_succeed_in_basic_mode(faulty):
    fault, server, health_before, is_real = faulty
    assert health_before["mode"] == "normal"  # the fault is latent until the first step
    r = ask(server.url)
    assert r.status_code == 200, r.text
    assert r.headers["x-stratum-mode"] == "basic"
    msg = r.json()
    assert msg["type"] == "message" and msg["stop_reason"] in ("end_turn", "max_tokens")
    assert msg["usage"]["output_tokens"] >= 1
    check_answer(msg["content"][0]["text"], "Paris", is_real)
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["mode"] == "basic"
    assert fault in health["degraded_reason"]
    assert engine_mode_gauge(server.url) == {"normal": 0.0, "basic": 1.0}


def test_basic_mode_has_no_prefix_cache(faulty):
    _, server, _, is_real = faulty
    for _ in range(2):
        r = ask(server.url, "Name a primary colour.")
        assert r.status_code == 200
        assert parse_cost(r.headers["x-stratum-cost"])["cache_hit_ratio"] == 0
        assert r.json()["usage"]["cache_read_input_tokens"] == 0
        assert r.json()["usage"]["cache_creation_input_tokens"] == 0
    kv = httpx.get(server.url + "/health", timeout=10).json()["kv_blocks"]
    assert kv["cached"] == 0 and kv["in_use"] == 0 and kv["free"] == kv["total"]


def test_concurrent_requests_are_all_served(faulty):
    _, server, _, is_real = faulty
    questions = [QUESTION, "What is the capital of Japan?", "What is 2 + 2?"]
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        responses = list(pool.map(lambda q: ask(server.url, q, max_tokens=12), questions))
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert all(r.headers["x-stratum-mode"] == "basic" for r in responses)
    check_answer(responses[0].json()["content"][0]["text"], "Paris", is_real)
    check_answer(responses[1].json()["content"][0]["text"], "Tokyo", is_real)


def test_streams_and_the_sdk_in_basic_mode(faulty):
    _, server, _, is_real = faulty
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": QUESTION}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-stratum-meta": "on"},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["x-stratum-mode"] == "basic"
        events = sse_events(r.iter_lines())
    assert [d for n, d in events if n == "stratum_cost"][0]["mode"] == "basic"
    client = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                                                   messages=[{"role": "user", "content": QUESTION}])
    assert raw.headers["x-stratum-mode"] == "basic"
    check_answer(raw.parse().content[0].text, "Paris", is_real)
    oa = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]})
    assert oa.status_code == 200 and oa.headers["x-stratum-mode"] == "basic"
    check_answer(oa.json()["choices"][0]["message"]["content"], "Paris", is_real)
