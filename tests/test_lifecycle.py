"""Every way a request ends releases it exactly once (`server.lifecycle.RequestLifecycle`).

Answered, refused after admission, left by its client mid-stream or mid-wait, failed by the engine,
ended by a drain: afterwards the server holds nothing of it. No request in flight
(`stratum_num_requests_in_flight`), none queued, running or holding KV blocks (/health), and its
tenant's budget holds exactly what it measured: a request that ran to its end is charged its
measured cost, one that did not is charged nothing. Each tenant is charged one answered request
first, so a request released twice would refund that charge too and show.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess

BUDGET = 6000
KEYS = [f"sk-lifecycle-{i}" for i in range(24)]
LONG = {"max_tokens": 1900, "extra_body": {"ignore_eos": True}}  # far longer than any test waits
TOO_LONG = "the capital of Japan is Tokyo. " * 400  # more tokens than the tiny model's context


def budget_server(tiny_model_dir, *extra: str, env: dict | None = None) -> ServerProcess:
    return ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                         "--tenant-budget-tokens", str(BUDGET), "--budget-window-s", "3600",
                         *(a for k in KEYS for a in ("--api-key", k)), *extra, env=env).wait_ready()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = budget_server(tiny_model_dir)
    yield server
    server.stop()


_unused = iter(KEYS)


@pytest.fixture
def key() -> str:
    """A tenant of the test's own."""
    return next(_unused)


def in_flight(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "stratum_num_requests_in_flight")
    return family.samples[0].value


def at_rest(url: str, timeout: float = 20.0) -> None:
    """Wait until the server holds no request: none in flight, queued, waiting or running, no KV block in use."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health", timeout=10).json()
        held = {"in_flight": in_flight(url), "queued": health["queued"], "waiting": health["waiting"],
                "running": health["running"], "kv_in_use": health["kv_blocks"]["in_use"]}
        if not any(held.values()):
            return
        assert time.monotonic() < deadline, f"still held {timeout}s after the request ended: {held}"
        time.sleep(0.05)


def remaining(url: str, key: str) -> int:
    """The tenant's budget as it stands, read off a request refused after admission (its prompt is
    longer than the context), which reserves nothing."""
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long") as refused:
        client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": TOO_LONG}])
    return int(refused.value.response.headers["anthropic-ratelimit-tokens-remaining"])


def charge_one(url: str, key: str) -> int:
    """Answer one short request for the tenant; its measured cost: uncached prompt tokens + output."""
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    u = client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "first " + key}]).usage
    at_rest(url)
    assert remaining(url, key) == BUDGET - (u.input_tokens + u.cache_creation_input_tokens + u.output_tokens)
    return u.input_tokens + u.cache_creation_input_tokens + u.output_tokens


def openai_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def openai_cost(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> int:
    return prompt_tokens - cached_tokens + output_tokens


# ---- answered -----------------------------------------------------------------------------------
def answer(route: str, url: str, key: str) -> int:
    """Run one request of `route` to its end; its measured cost, from the usage it reports."""
    messages = [{"role": "user", "content": f"Say something about {route}."}]
    if route.startswith("messages"):
        client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        if route == "messages":
            u = client.messages.create(model="tiny", max_tokens=12, messages=messages).usage
        else:
            with client.messages.stream(model="tiny", max_tokens=12, messages=messages) as stream:
                u = stream.get_final_message().usage
        return u.input_tokens + u.cache_creation_input_tokens + u.output_tokens
    client = openai_client(url, key)
    if route == "chat":
        u = client.chat.completions.create(model="tiny", max_tokens=12, messages=messages).usage
    elif route == "chat-stream":
        chunks = list(client.chat.completions.create(model="tiny", max_tokens=12, messages=messages, stream=True,
                                                     stream_options={"include_usage": True}))
        u = chunks[-1].usage
    elif route == "completions-n2-stream":
        chunks = list(client.completions.create(model="tiny", max_tokens=12, prompt=["one", "two"], n=2, stream=True,
                                                stream_options={"include_usage": True}))
        u = chunks[-1].usage
    else:
        assert route == "responses-stream"
        events = list(client.responses.create(model="tiny", max_output_tokens=12, input=messages, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")  # max_output_tokens may end it
        r = events[-1].response.usage
        return openai_cost(r.input_tokens, r.input_tokens_details.cached_tokens, r.output_tokens)
    return openai_cost(u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens)


@pytest.mark.parametrize("route", ["messages", "messages-stream", "chat", "chat-stream", "completions-n2-stream",
                                   "responses-stream"])
def test_an_answered_request_is_charged_its_measured_cost_once(server, key, route):
    first = charge_one(server.url, key)
    cost = answer(route, server.url, key)
    at_rest(server.url)
    assert remaining(server.url, key) == BUDGET - first - cost


# ---- refused after admission --------------------------------------------------------------------
def test_requests_refused_after_admission_hold_nothing(server, key):
    first = charge_one(server.url, key)
    assert remaining(server.url, key) == BUDGET - first  # the probe itself: a 400 after admission
    client = openai_client(server.url, key)
    # admitted (1 + max_tokens fits), then 4 prompts x n 4 x 500 tokens cannot be reserved: 429
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model="tiny", max_tokens=500, prompt=["a", "b", "c", "d"], n=4)
    assert refused.value.response.headers["x-ratelimit-remaining-tokens"] == str(BUDGET - first)
    with pytest.raises(openai.BadRequestError):  # the context rule, after admission, before any reservation
        client.chat.completions.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": TOO_LONG}])
    at_rest(server.url)
    assert remaining(server.url, key) == BUDGET - first


# ---- left by the client -------------------------------------------------------------------------
def leave_mid_stream(route: str, url: str, key: str) -> None:
    """Open a long stream, read until text flows, and close the connection."""
    messages = [{"role": "user", "content": "Tell me a very long story."}]
    if route == "messages":
        client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        stream = client.messages.create(model="tiny", messages=messages, stream=True, **LONG)
        texts = (e for e in stream if e.type == "content_block_delta")
    else:
        client = openai_client(url, key)
        if route == "chat":
            stream = client.chat.completions.create(model="tiny", messages=messages, stream=True, **LONG)
            texts = (c for c in stream if c.choices and c.choices[0].delta.content)
        elif route == "completions":
            stream = client.completions.create(model="tiny", prompt="Once upon a time", n=2, stream=True, **LONG)
            texts = (c for c in stream if c.choices and c.choices[0].text)
        else:
            stream = client.responses.create(model="tiny", input=messages, stream=True,
                                             max_output_tokens=LONG["max_tokens"], extra_body=LONG["extra_body"])
            texts = (e for e in stream if e.type == "response.output_text.delta")
    for _ in itertools.islice(texts, 3):
        pass
    stream.close()


@pytest.mark.parametrize("route", ["messages", "chat", "completions", "responses"])
def test_a_client_that_leaves_mid_stream_is_released_and_not_charged(server, key, route):
    first = charge_one(server.url, key)
    leave_mid_stream(route, server.url, key)
    at_rest(server.url)  # the engine aborted it: its blocks are free
    assert remaining(server.url, key) == BUDGET - first


def test_a_client_that_leaves_a_non_streamed_request_is_released_and_not_charged(server, key):
    first = charge_one(server.url, key)
    body = {"model": "tiny", "max_tokens": 1900, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up, and its connection closes
        httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=0.3)
    at_rest(server.url)
    assert remaining(server.url, key) == BUDGET - first


# ---- ended by the engine or the server ----------------------------------------------------------
def test_requests_failed_by_the_engine_are_released(tiny_model_dir):
    """The engine dies under a streamed and a non-streamed request: both end with an error, and the
    server holds neither afterwards (the budget is not readable then: a dead engine refuses before
    admission)."""
    server = budget_server(tiny_model_dir, "--engine", "thread", env={"STRATUM_FAULT_INJECT": "engine_death:300"})
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key=KEYS[-1], max_retries=0)
        messages = [{"role": "user", "content": "Tell me a very long story."}]
        failures: list[BaseException] = []

        def blocking():
            try:
                client.messages.create(model="tiny", messages=messages, **LONG)
            except anthropic.APIStatusError as e:
                failures.append(e)

        thread = threading.Thread(target=blocking)
        thread.start()
        with pytest.raises(anthropic.APIStatusError, match="engine"):  # an error event, or a 503 if it died first
            with client.messages.create(model="tiny", messages=messages, stream=True, **LONG) as stream:
                for _ in stream:
                    pass
        thread.join(60)
        assert len(failures) == 1 and failures[0].status_code == 503, failures
        deadline = time.monotonic() + 20
        while (health := httpx.get(server.url + "/health", timeout=10).json())["queued"] or in_flight(server.url):
            assert time.monotonic() < deadline, f"still held after the engine died: {health}"
            time.sleep(0.05)
        assert health["status"] == "dead"
    finally:
        server.stop()


def test_a_drain_releases_every_request_it_ends(tiny_model_dir):
    """Cut by the drain's timeout, a stream and a non-streamed request end with errors, and the drain
    finds nothing still held after its grace."""
    server = budget_server(tiny_model_dir, "--drain-timeout-s", "1")
    try:
        url, headers = server.url, {"x-api-key": KEYS[-2]}
        body = {"model": "tiny", "max_tokens": 1900, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me a very long story."}]}
        answers: dict[str, httpx.Response] = {}
        blocking = threading.Thread(target=lambda: answers.update(
            blocking=httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=60)))
        blocking.start()
        with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, headers=headers,
                          timeout=60) as r:
            lines = r.iter_lines()
            while "text_delta" not in next(lines):
                pass
            deadline = time.monotonic() + 30
            while in_flight(url) < 2:  # the non-streamed one is admitted too
                assert time.monotonic() < deadline
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        blocking.join(60)
        assert any(line.startswith("event: error") for line in rest), rest[-5:]
        assert answers["blocking"].status_code == 503, answers
        assert server.proc.wait(30) == 0
        log = server.output()
        assert "ended 2 requests" in log and "still held" not in log, log
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_a_prompt_beyond_the_kv_pool_is_refused_naming_the_pool():
    """The Messages API's context rule where one sequence's KV pool holds fewer tokens than the context
    (a pool sized by memory): a prompt within the context but beyond the pool is refused in Anthropic's
    prompt-too-long words with the pool's maximum (Claude Code reads those counts), not as a context
    overflow; a prompt the pool holds has its max_tokens lowered to the room the pool leaves."""
    from types import SimpleNamespace

    from stratum.engine.sampling_params import SamplingParams
    from stratum.server.errors import InvalidRequest
    from stratum.server.sampling import fit_to_context

    config = SimpleNamespace(max_model_len=8192, num_kv_blocks=364, block_size=16)  # the pool: 5,824 tokens
    with pytest.raises(InvalidRequest) as refused:
        fit_to_context(SamplingParams(max_tokens=8192), config, 5889)
    assert str(refused.value).startswith("prompt is too long: 5889 tokens > 5823 maximum"), str(refused.value)
    assert "KV pool holds 5824 tokens" in str(refused.value) and "8192-token context" in str(refused.value)
    fitted, capped = fit_to_context(SamplingParams(max_tokens=8192), config, 400)
    assert capped and fitted.max_tokens == 5824 - 400
