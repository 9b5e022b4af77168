"""Prometheus /metrics agrees with what the responses said.

A fresh server gets a known mix of requests (both APIs, streaming and not, cache hits, a warm-up, a
bypass, two errors); every counter and histogram count is then recomputed from the responses'
own usage, cost headers and traces.
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess
from tests.test_telemetry_cost import decode, long_text, parse_cost, prompt_tokens, sse_events

MODEL = "tiny"
DEBUG = {"x-stratum-debug": "true", "x-stratum-meta": "on"}


@pytest.fixture(scope="module")
def fresh_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", MODEL, "--kv-cache-mb", "8").wait_ready()
    yield server
    server.stop()


def scrape(url: str) -> dict[str, list]:
    """Family name -> samples, parsed with the reference parser (which fails on malformed text)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def total(families, name: str, sample: str | None = None, **labels) -> float:
    _, samples = families[name]
    sample = sample or name
    return sum(s.value for s in samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def workload(fresh_server):
    """Send the requests; return one record per successful request and the scrape after them."""
    url = fresh_server.url
    records = []  # (endpoint, trace document, round-trip seconds)

    def anthropic_call(body, headers=None):
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/messages", json={"model": MODEL, **body}, headers={**DEBUG, **(headers or {})},
                       timeout=60)
        assert r.status_code == 200, r.text
        doc = decode(r.headers["x-stratum-trace"])
        assert doc["usage"] == r.json()["usage"]
        assert doc["cost"] == parse_cost(r.headers["x-stratum-cost"])
        records.append(("/v1/messages", doc, time.perf_counter() - t0))

    shared = {"system": "Metrics check.", "messages": [{"role": "user", "content": long_text(40)}]}
    anthropic_call({"max_tokens": 8, **shared})
    anthropic_call({"max_tokens": 12, "temperature": 0, "ignore_eos": True, **shared})  # a cache hit
    anthropic_call({"max_tokens": 5, "messages": [{"role": "user", "content": "a different prompt"}]})
    anthropic_call({"max_tokens": 0, "system": "Warm-up.", "messages": [{"role": "user", "content": long_text(20)}]})
    anthropic_call({"max_tokens": 4, **shared}, headers={"x-stratum-mode": "bypass"})

    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/messages", headers=DEBUG, timeout=60, json={
            "model": MODEL, "max_tokens": 20, "stream": True, "temperature": 0, "ignore_eos": True, **shared}) as r:
        events = sse_events(r.iter_lines())
    cost = [d for n, d in events if n == "stratum_cost"][0]
    assert decode(cost["trace"])["usage"] == [d for n, d in events if n == "message_delta"][0]["usage"]
    records.append(("/v1/messages", decode(cost["trace"]), time.perf_counter() - t0))

    chat = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": long_text(15)}]}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=chat, headers=DEBUG, timeout=60)
    assert r.status_code == 200
    doc = decode(r.headers["x-stratum-trace"])
    u = r.json()["usage"]
    assert u["prompt_tokens"] == prompt_tokens(doc["usage"])
    assert u["completion_tokens"] == doc["usage"]["output_tokens"]
    records.append(("/v1/chat/completions", doc, time.perf_counter() - t0))
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", headers=DEBUG, timeout=60,
                      json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [d for _, d in sse_events(r.iter_lines())]
    cost = [c["stratum_cost"] for c in chunks if "stratum_cost" in c][0]
    records.append(("/v1/chat/completions", decode(cost["trace"]), time.perf_counter() - t0))

    # errors are counted under their status, never as answered requests
    assert httpx.post(url + "/v1/messages", json={**chat, "model": "nope"}).status_code == 404
    assert httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": -1, "messages": []}).status_code == 400
    return records, scrape(url)


def test_metrics_parse_with_the_documented_types(workload):
    _, families = workload
    expected = {
        "stratum_request_count": "counter", "stratum_cache_hit_count": "counter",
        "stratum_cache_query_count": "counter",
        "stratum_kv_sparsity": "histogram", "stratum_cost_dollars": "counter", "stratum_prompt_tokens": "counter",
        "stratum_generation_tokens": "counter", "stratum_time_to_first_token_seconds": "histogram",
        "stratum_inter_token_latency_seconds": "histogram", "stratum_e2e_request_latency_seconds": "histogram",
        "stratum_queue_time_seconds": "histogram", "stratum_prefill_time_seconds": "histogram",
        "stratum_num_requests_running": "gauge", "stratum_num_requests_waiting": "gauge",
        "stratum_kv_cache_usage_ratio": "gauge", "stratum_kv_cache_cached_blocks": "gauge",
        "stratum_num_preemptions": "gauge", "stratum_engine_steps": "gauge", "stratum_runtime_overhead_ratio": "gauge",
        "stratum_admission_rejections": "counter", "stratum_pollution_advice": "counter",
        "stratum_engine_mode": "gauge",
    }
    for name, kind in expected.items():
        assert families[name][0] == kind, name


def test_request_and_token_counters_agree_with_responses(workload):
    records, m = workload
    usages = [doc["usage"] for _, doc, _ in records]
    assert total(m, "stratum_request_count", "stratum_request_count_total", status="ok") == len(records)
    for endpoint in ("/v1/messages", "/v1/chat/completions"):
        n = sum(1 for e, _, _ in records if e == endpoint)
        assert total(m, "stratum_request_count", "stratum_request_count_total", endpoint=endpoint, status="ok") == n
    assert total(m, "stratum_request_count", "stratum_request_count_total", status="404") == 1
    assert total(m, "stratum_request_count", "stratum_request_count_total", status="400") == 1
    prompt = sum(prompt_tokens(u) for u in usages)
    cached = sum(u["cache_read_input_tokens"] for u in usages)
    assert cached > 0
    assert total(m, "stratum_cache_hit_count", "stratum_cache_hit_count_total") == cached
    assert total(m, "stratum_cache_query_count", "stratum_cache_query_count_total") == prompt
    assert total(m, "stratum_prompt_tokens", "stratum_prompt_tokens_total") == prompt
    assert (total(m, "stratum_generation_tokens", "stratum_generation_tokens_total")
            == sum(u["output_tokens"] for u in usages))


def test_cost_counter_is_the_sum_of_final_estimates(workload):
    records, m = workload
    docs = [doc for _, doc, _ in records]
    assert total(m, "stratum_cost_dollars", "stratum_cost_dollars_total") == pytest.approx(
        sum(d["final_cost_estimate"] for d in docs), abs=1e-9)
    for label, is_hit in (("true", True), ("false", False)):
        part = sum(d["final_cost_estimate"] for d in docs if (d["usage"]["cache_read_input_tokens"] > 0) is is_hit)
        assert total(m, "stratum_cost_dollars", "stratum_cost_dollars_total", model=MODEL,
                     cache_hit=label) == pytest.approx(part, abs=1e-9)


def test_histograms_agree_with_traces(workload):
    records, m = workload
    docs = [doc for _, doc, _ in records]
    sampled = [d for d in docs if d["usage"]["output_tokens"] > 0]
    sparsities = [d["cost"]["kv_sparsity"] for d in docs if d["cost"]["kv_sparsity"] is not None]
    assert len(sparsities) == len(sampled)
    assert total(m, "stratum_kv_sparsity", "stratum_kv_sparsity_count") == len(sparsities)
    assert total(m, "stratum_kv_sparsity", "stratum_kv_sparsity_sum") == pytest.approx(sum(sparsities), abs=1e-9)
    assert total(m, "stratum_e2e_request_latency_seconds", "stratum_e2e_request_latency_seconds_count") == len(docs)
    assert total(m, "stratum_queue_time_seconds", "stratum_queue_time_seconds_count") == len(docs)
    assert total(m, "stratum_time_to_first_token_seconds", "stratum_time_to_first_token_seconds_count") == len(sampled)
    # every request prefilled, warm-ups (max_tokens 0) included
    assert total(m, "stratum_prefill_time_seconds", "stratum_prefill_time_seconds_count") == len(docs)
    itl = sum(d["usage"]["output_tokens"] - 1 for d in sampled)
    assert total(m, "stratum_inter_token_latency_seconds", "stratum_inter_token_latency_seconds_count") == itl
    gaps = [d["steps"][2]["inter_token"] for d in docs]
    assert sum(g["gaps"] for g in gaps) == itl
    assert total(m, "stratum_inter_token_latency_seconds", "stratum_inter_token_latency_seconds_sum") == pytest.approx(
        sum(g["mean_ms"] * g["gaps"] for g in gaps if g["gaps"]) / 1e3, abs=1e-6 * max(1, itl))
    assert all(g["max_ms"] >= g["p99_ms"] >= 0 for g in gaps if g["gaps"])
    # the sums are the traces' own durations (which are rounded to the microsecond)
    prefill_s = sum(d["steps"][1]["duration_us"] for d in docs) / 1e6
    assert total(m, "stratum_prefill_time_seconds", "stratum_prefill_time_seconds_sum") == pytest.approx(
        prefill_s, abs=1e-6 * len(docs))
    queue_s = sum(d["steps"][0]["duration_us"] for d in docs) / 1e6
    assert total(m, "stratum_queue_time_seconds", "stratum_queue_time_seconds_sum") == pytest.approx(
        queue_s, abs=1e-6 * len(docs))
    # each latency lies within the round trip the test observed
    assert (total(m, "stratum_e2e_request_latency_seconds", "stratum_e2e_request_latency_seconds_sum")
            <= sum(t for _, _, t in records))
    ttft = total(m, "stratum_time_to_first_token_seconds", "stratum_time_to_first_token_seconds_sum")
    assert 0 < ttft <= sum(t for _, d, t in records if d["usage"]["output_tokens"] > 0)


def test_gauges_describe_the_idle_engine(fresh_server, workload):
    _, m = workload
    kv = httpx.get(fresh_server.url + "/health", timeout=10).json()["kv_blocks"]
    now = scrape(fresh_server.url)
    assert total(now, "stratum_num_requests_running") == 0
    assert total(now, "stratum_num_requests_waiting") == 0
    assert total(now, "stratum_kv_cache_usage_ratio") == 0
    assert total(now, "stratum_kv_cache_cached_blocks") == kv["cached"] > 0
    assert total(now, "stratum_num_preemptions") == 0
    assert total(now, "stratum_engine_steps") > 0
    assert 0 < total(now, "stratum_runtime_overhead_ratio") < 1
    assert (total(now, "stratum_engine_mode", mode="normal") == 1
            and total(now, "stratum_engine_mode", mode="basic") == 0)
    assert total(now, "stratum_admission_rejections", "stratum_admission_rejections_total") == 0
    assert total(now, "stratum_pollution_advice", "stratum_pollution_advice_total") == 0
