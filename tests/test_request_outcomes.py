"""`stratum_request_count_total` says how every request ended, so an operator can alert on it: answered
("ok"), refused (4xx, 429), closed by its client (499, streamed or not: never a server error), and every
5xx with its status, an unhandled error in a route included (`STRATUM_FAULT_INJECT=route`)."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess

NAME = "stratum_request_count_total"
LONG = {"model": "tiny", "max_tokens": 2000, "ignore_eos": True, "messages": [{"role": "user", "content": "go"}]}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--tenant-budget-tokens", "100000").wait_ready()
    yield server
    server.stop()


def counts(url: str) -> dict[tuple[str, str], float]:
    """(endpoint, status) -> requests counted."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == NAME:
                out[s.labels["endpoint"], s.labels["status"]] = s.value
    return out


def grows(url: str, key: tuple[str, str], before: dict, by: int = 1, timeout_s: float = 30.0) -> dict:
    """Wait until the count of `key` has grown by `by` (a disconnect is noticed a moment later); the counts then."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = counts(url)
        if now.get(key, 0) >= before.get(key, 0) + by or time.monotonic() > deadline:
            assert now.get(key, 0) == before.get(key, 0) + by, (key, before, now)
            return now
        time.sleep(0.2)


def test_ok_and_refusals_are_counted_by_status(server):
    url = server.url
    client = anthropic.Anthropic(base_url=url, api_key="test", max_retries=0)
    oai = openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0)
    before = counts(url)
    client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    grows(url, ("/v1/messages", "ok"), before)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"top_k": 2**64})
    grows(url, ("/v1/messages", "400"), before)
    with pytest.raises(openai.RateLimitError):  # more than the whole budget: 429 before any work
        oai.chat.completions.create(model="tiny", max_tokens=200_000, messages=[{"role": "user", "content": "hi"}])
    grows(url, ("/v1/chat/completions", "429"), before)
    r = httpx.get(url + "/no/such/route/" + "x" * 40)
    assert r.status_code == 404
    after = grows(url, ("other", "404"), before)  # any path outside the API is one series, however many are sent
    assert not any(status.startswith("5") for _, status in after), after


def test_a_client_hanging_up_is_499_streamed_or_not(server):
    url = server.url
    before = counts(url)
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up before the answer
        httpx.post(url + "/v1/messages", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    after = grows(url, ("/v1/messages", "499"), before)
    with httpx.stream("POST", url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event, then the client leaves mid-stream
    after = grows(url, ("/v1/chat/completions", "499"), after)
    assert not any(status.startswith("5") for _, status in after), after
    health = httpx.get(url + "/health").json()  # the hang-ups freed their blocks
    deadline = time.monotonic() + 30
    while health["kv_blocks"]["in_use"] and time.monotonic() < deadline:
        time.sleep(0.2)
        health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["kv_blocks"]["in_use"] == 0, health


def test_an_unhandled_error_is_counted_as_500(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           env={"STRATUM_FAULT_INJECT": "route"}).wait_ready()
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "api_error"
        assert e.value.response.headers["request-id"].startswith("req_")
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            oai.chat.completions.create(model="tiny", max_tokens=2, stream=True,
                                        messages=[{"role": "user", "content": "hi"}])
        now = counts(server.url)
        assert now.get(("/v1/messages", "500")) == 1 and now.get(("/v1/chat/completions", "500")) == 1, now
    finally:
        server.stop()


COUNT_BUDGET = 300


@pytest.fixture(scope="module")
def count_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--tenant-budget-tokens", str(COUNT_BUDGET), "--budget-window-s", "3600",
                           "--pollution-policy", "off").wait_ready()
    yield server
    server.stop()


def test_token_counting_is_admitted_and_charged_per_tenant(count_server):
    """count_tokens is charged what it counted, after a charge by the body's size that must fit first:
    a body too large for what the tenant has left is refused before any tokenization."""
    url = count_server.url
    client = anthropic.Anthropic(base_url=url, api_key="test", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as e:  # ~100,000 tokens by size: refused at once
        client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "word " * 80_000}])
    assert e.value.body["error"]["stratum_reason"] == "cost_threshold_exceeded"
    other = anthropic.Anthropic(base_url=url, api_key="another-tenant", max_retries=0)  # a key is a tenant
    counted = []
    for _ in range(COUNT_BUDGET):
        try:
            counted.append(client.messages.count_tokens(
                model="tiny", messages=[{"role": "user", "content": "count me"}]).input_tokens)
        except anthropic.RateLimitError:
            break
    assert counted and sum(counted) <= COUNT_BUDGET < sum(counted) + 2 * counted[0], counted  # spent, then refused
    r = httpx.post(url + "/v1/responses/input_tokens", json={"model": "tiny", "input": "hi"}, timeout=30,
                   headers={"authorization": "Bearer test"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
    assert other.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
