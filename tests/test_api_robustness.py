"""The server under abuse: schema fuzzing, many concurrent streams, clients that vanish mid-request,
a full waiting queue, and sampling parameters at the edge of their ranges."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.test_api_streaming import check_event_order, sse_events

LONG = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}


def tiny_args(*extra: str) -> tuple[str, ...]:
    return ("--served-model-name", "tiny", "--kv-cache-mb", "8", *extra)


def health(url: str) -> dict:
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(url: str, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(url)
        if predicate(h):
            return h
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout}s: {h}")
        time.sleep(0.1)


def is_idle(h: dict) -> bool:
    return h["kv_blocks"]["in_use"] == 0 and h["running"] == 0 and h["waiting"] == 0


def body(prompt: str = "hi", **extra) -> dict:
    return {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": prompt}], **extra}


# ---- schemathesis --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    """Its own server: a fuzzer may leave it in any state, and other tests should not inherit that."""
    server = ServerProcess(str(tiny_model_dir), *tiny_args()).wait_ready()
    yield server
    server.stop()


def _openapi_with_bodies(url: str) -> dict:
    """The server's /openapi.json, plus request bodies for the routes that read raw JSON.

    The POST handlers parse `Request` themselves, so FastAPI publishes no body schema for them and a
    fuzzer would only send empty bodies. The pydantic models the handlers validate against fill the
    gap. `model` is pinned to the served name and max_tokens kept small, so positive cases reach the
    engine instead of stopping at 404 or spending seconds decoding.
    """
    from stratum.server.protocol import (
        BatchCreateRequest, ChatCompletionRequest, CompletionRequest, CountTokensRequest, InputTokensRequest,
        MessagesRequest, ResponsesRequest,
    )
    from stratum.server.protocol.ollama import (OllamaChatRequest, OllamaEmbedRequest, OllamaGenerateRequest,
                                                OllamaShowRequest)

    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    small = {"type": "integer", "minimum": 0, "maximum": 32}
    for path, model in {"/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
                        "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                        "/v1/messages/batches": BatchCreateRequest, "/v1/responses": ResponsesRequest,
                        "/v1/responses/input_tokens": InputTokensRequest, "/api/chat": OllamaChatRequest,
                        "/api/generate": OllamaGenerateRequest, "/api/show": OllamaShowRequest,
                        "/api/embed": OllamaEmbedRequest, "/api/embeddings": OllamaEmbedRequest}.items():
        operation = spec["paths"][path]["post"]
        if "requestBody" in operation:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        schema["properties"]["model"] = {"type": "string", "enum": ["tiny"]}
        if "max_tokens" in schema["properties"]:
            schema["properties"]["max_tokens"] = small
            schema["required"] = sorted(set(schema.get("required", [])) | {"max_tokens"})
        if "options" in schema["properties"]:  # Ollama's num_predict, in its options
            schema["required"] = sorted(set(schema.get("required", [])) | {"options"})
        for field in ("max_completion_tokens", "max_output_tokens"):
            if field in schema["properties"]:
                schema["properties"][field] = {**small, "minimum": 1} if field == "max_output_tokens" else small
        components[model.__name__] = schema
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    options = components["OllamaOptions"]
    options["properties"]["num_predict"] = small
    options["required"] = ["num_predict"]
    return spec


# The default run fuzzes each operation with 15 cases; --slow with 50 (about 3x the time).
@pytest.mark.parametrize("max_examples", [15, pytest.param(50, marks=pytest.mark.slow)])
def test_schemathesis_finds_no_server_errors(fuzz_server, max_examples):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    spec = _openapi_with_bodies(fuzz_server.url)
    assert {"/v1/messages", "/v1/chat/completions", "/v1/messages/count_tokens", "/health"} <= set(spec["paths"])
    schema = schemathesis.openapi.from_dict(spec)
    failures: list[str] = []
    num_cases = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if is_ollama(operation.path):  # `test_schemathesis_finds_no_server_errors_on_ollamas_routes`
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode == GenerationMode.NEGATIVE and (operation.method.upper() != "POST" or "{" in operation.path):
                continue  # nothing in a GET, or in a free-string path parameter, can be made invalid

            # derandomize: the same cases every run; no shrinking, to bound the time
            @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal num_cases
                num_cases += 1
                response = case.call(base_url=fuzz_server.url, timeout=60)
                problem = None
                if response.status_code >= 500:
                    problem = "server error"
                elif not response.headers.get("request-id"):
                    problem = "no request-id header"
                elif response.status_code >= 400:
                    data = response.json()
                    error = data.get("error") if isinstance(data.get("error"), dict) else {}
                    if operation.path.startswith(("/v1/chat/completions", "/v1/completions", "/v1/responses",
                                                  "/v1/embeddings", "/v1/rerank", "/v2/rerank", "/rerank")):
                        if "type" in data or not error.get("type") or not {"message", "param", "code"} <= set(error):
                            problem = "error body not in OpenAI's shape"
                    elif data.get("type") != "error" or not error.get("type"):
                        problem = "error body not in Anthropic's shape"
                if problem:
                    sent = json.dumps(case.body, ensure_ascii=True, default=repr) if case.body is not None else None
                    failures.append(f"{problem}: {operation.label} [{mode.value}] -> {response.status_code} "
                                    f"{response.text[:300]!r}\n    body sent: {str(sent)[:3000]}")

            run()
    assert num_cases > 2 * max_examples
    assert not failures, (f"{len(failures)} bad responses of {num_cases}:\n" + "\n".join(failures[:10])
                          + "\n--- server log ---\n" + fuzz_server.output()[-3000:])
    assert health(fuzz_server.url)["status"] == "ok"


# Ollama's model management, which this server refuses with a 400 (it serves the model it started with)
MANAGEMENT = {"/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete", "/api/blobs/{digest}"}


def is_ollama(path: str) -> bool:
    return path == "/" or path.startswith("/api/")


def test_schemathesis_finds_no_server_errors_on_ollamas_routes(fuzz_server):
    """Ollama's routes: no 5xx, every error body `{"error": "..."}`."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(_openapi_with_bodies(fuzz_server.url))
    failures: list[str] = []
    num_cases = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if not is_ollama(operation.path):
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode == GenerationMode.NEGATIVE and (operation.method.upper() != "POST" or "{" in operation.path
                                                    or operation.path in MANAGEMENT):
                continue  # a GET, a free-string path parameter, a body never read: nothing can be made invalid

            @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal num_cases
                num_cases += 1
                response = case.call(base_url=fuzz_server.url, timeout=60)
                problem = None
                if response.status_code >= 500:
                    problem = "server error"
                elif response.status_code >= 400 and operation.method.upper() != "HEAD":  # (HEAD: no body)
                    data = response.json()
                    if set(data) != {"error"} or not isinstance(data["error"], str):
                        problem = "error body not in Ollama's shape"
                if problem:
                    failures.append(f"{problem}: {operation.label} [{mode.value}] -> {response.status_code} "
                                    f"{response.text[:300]!r}\n    body sent: {str(case.body)[:2000]}")

            run()
    assert num_cases > 30
    assert not failures, f"{len(failures)} bad responses of {num_cases}:\n" + "\n".join(failures[:10])
    assert health(fuzz_server.url)["status"] == "ok"


# ---- concurrency ---------------------------------------------------------------------------------
async def test_32_concurrent_streams_complete_in_order(tiny_server):
    async with anthropic.AsyncAnthropic(base_url=tiny_server.url, api_key="test", max_retries=0) as client:

        async def one(i: int):
            stream = await client.messages.create(
                model="tiny", max_tokens=24 + i % 8, stream=True,
                messages=[{"role": "user", "content": f"client {i}: 中文 🙂"}],
                extra_body={"ignore_eos": True, "temperature": 1.0, "seed": i})
            events = [(e.type, e.model_dump()) async for e in stream]
            return i, events

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=120)
    for i, events in results:
        check_event_order(events)
        delta = [d for n, d in events if n == "message_delta"][0]
        assert delta["delta"]["stop_reason"] == "max_tokens"
        assert delta["usage"]["output_tokens"] == 24 + i % 8
    wait_for(tiny_server.url, is_idle, 10, "idle after concurrent streams")


def test_32_concurrent_raw_streams_from_threads(tiny_server):
    """The same over raw SSE from 32 threads, half of them on the OpenAI route."""

    def one(i: int) -> None:
        if i % 2:
            b = body(f"thread {i} 🚀", max_tokens=20, stream=True, stream_options={"include_usage": True},
                     ignore_eos=True)
            with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", json=b, timeout=120) as r:
                assert r.status_code == 200
                chunks = [d for _, d in sse_events(r.iter_lines())]
            assert chunks[-1] == {"done": True} and chunks[-2]["usage"]["completion_tokens"] == 20
            return
        b = body(f"thread {i} 🚀", max_tokens=20, stream=True, ignore_eos=True)
        with httpx.stream("POST", tiny_server.url + "/v1/messages", json=b, timeout=120) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        check_event_order(events)
        assert [d for n, d in events if n == "message_delta"][0]["usage"]["output_tokens"] == 20

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(32)))
    wait_for(tiny_server.url, is_idle, 10, "idle after concurrent streams")


# ---- clients that go away ------------------------------------------------------------------------
@pytest.fixture
def vanish_server(tiny_model_dir):
    """A fresh server per test: if aborts fail, the orphaned requests must not slow down other tests."""
    server = ServerProcess(str(tiny_model_dir), *tiny_args()).wait_ready()
    yield server
    server.stop()


def _vanishing_client(url: str, rng: random.Random) -> str:
    """One client that leaves early, in one of several ways. Returns how it left."""
    kind = rng.choice(["events", "bytes", "stream-timeout", "blocking-timeout", "openai-events", "headers-only"])
    prompt = f"vanish {rng.random()} 日本"
    if kind == "blocking-timeout":
        try:
            httpx.post(url + "/v1/messages", json=body(prompt, **LONG), timeout=rng.uniform(0.05, 0.8))
        except httpx.TimeoutException:
            pass
        return kind
    path, payload = "/v1/messages", body(prompt, stream=True, **LONG)
    if kind == "openai-events":
        path = "/v1/chat/completions"
    timeout = httpx.Timeout(60, read=rng.uniform(0.01, 0.5)) if kind == "stream-timeout" else 60
    try:
        with httpx.Client(timeout=timeout) as client, client.stream("POST", url + path, json=payload) as r:
            if kind == "headers-only":
                return kind
            if kind == "bytes":
                limit, seen = rng.randint(1, 4000), 0
                for chunk in r.iter_raw(chunk_size=64):
                    seen += len(chunk)
                    if seen >= limit:
                        break
                return kind
            limit = rng.randint(0, 40)
            for n, _ in enumerate(r.iter_lines()):
                if n >= limit:
                    break
    except httpx.TimeoutException:
        pass
    return kind


def test_100_vanishing_clients_leave_no_blocks_in_use(vanish_server):
    rng = random.Random(20240611)
    seeds = [rng.random() for _ in range(100)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(20) as pool:
        kinds = list(pool.map(lambda s: _vanishing_client(vanish_server.url, random.Random(s)), seeds))
    assert len(set(kinds)) >= 5, kinds
    # Each request asked for 1900 tokens; run to the end they would take far longer than this wait.
    h = wait_for(vanish_server.url, is_idle, 20, "every aborted request freeing its blocks")
    assert h["status"] == "ok"
    r = httpx.post(vanish_server.url + "/v1/messages", json=body("still alive?", max_tokens=4), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 4
    assert time.monotonic() - t0 < 120


def test_non_streaming_disconnect_aborts_while_tokens_flow(vanish_server):
    """A blocking request whose client has gone is aborted mid-decode, not run to max_tokens.

    Eight 1900-token requests run to the end take several seconds on the tiny model; aborted, they
    are gone in about one disconnect-poll interval.
    """
    url = vanish_server.url

    def leave_early(i: int):
        try:
            httpx.post(url + "/v1/messages", json=body(f"leave early {i}", **LONG), timeout=0.3)
        except httpx.TimeoutException:
            return
        pytest.fail("the request finished before the client left")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(leave_early, range(8)))
    wait_for(url, is_idle, 3, "the abandoned blocking requests aborted")


# ---- a full waiting queue ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_slot_server(tiny_model_dir):
    """One running sequence at a time and a waiting queue of one: the third request is overloaded."""
    server = ServerProcess(str(tiny_model_dir), *tiny_args("--max-num-seqs", "1", "--max-waiting", "1")).wait_ready()
    yield server
    server.stop()


class _Occupant:
    """A streaming request held open in a thread until stopped."""

    def __init__(self, url: str):
        self.stop = threading.Event()
        self.status: int | None = None
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()

    def _run(self, url: str):
        with httpx.stream("POST", url + "/v1/messages", json=body("occupy", stream=True, **LONG), timeout=60) as r:
            self.status = r.status_code
            for _ in r.iter_lines():
                if self.stop.is_set():
                    return

    def close(self):
        self.stop.set()
        self.thread.join(timeout=30)


def test_overloaded_when_the_waiting_queue_is_full(one_slot_server):
    url = one_slot_server.url
    running = _Occupant(url)
    waiting = None
    try:
        wait_for(url, lambda h: h["running"] == 1, 20, "one running request")
        waiting = _Occupant(url)
        wait_for(url, lambda h: h["waiting"] == 1, 20, "one waiting request")
        r = httpx.post(url + "/v1/messages", json=body("one too many"), timeout=30)
        assert r.status_code == 529, r.text
        assert r.json()["error"]["type"] == "overloaded_error"
        assert r.json()["request_id"] == r.headers["request-id"]
        assert int(r.headers["retry-after"]) >= 0
        r = httpx.post(url + "/v1/chat/completions", json=body("one too many"), timeout=30)
        # OpenAI's word for it: 503 server_error (retryable to its SDK, ServiceUnavailableError to litellm)
        assert r.status_code == 503 and r.headers.get("retry-after")
        assert r.json()["error"]["type"] == "server_error"
        with pytest.raises(anthropic.APIStatusError) as info:
            anthropic.Anthropic(base_url=url, api_key="test", max_retries=0).messages.create(
                model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 529
        if hasattr(anthropic, "OverloadedError"):
            assert isinstance(info.value, anthropic.OverloadedError)
        assert isinstance(info.value, anthropic.InternalServerError)
        with pytest.raises(openai.APIStatusError) as oinfo:
            openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0).chat.completions.create(
                model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert oinfo.value.status_code == 503 and isinstance(oinfo.value, openai.InternalServerError)
        # counting tokens queues nothing, so it is still served
        assert httpx.post(url + "/v1/messages/count_tokens", timeout=30,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        assert health(url)["status"] == "ok"
    finally:
        running.close()
        if waiting is not None:
            waiting.close()
    assert running.status == 200 and waiting.status == 200
    wait_for(url, is_idle, 20, "idle after the occupants left")
    assert httpx.post(url + "/v1/messages", json=body("my turn"), timeout=30).status_code == 200


def test_529_under_a_concurrent_flood(one_slot_server):
    url = one_slot_server.url
    wait_for(url, is_idle, 20, "idle before the flood")
    barrier = threading.Barrier(12)

    def one(i: int) -> int:
        barrier.wait()
        return httpx.post(url + "/v1/messages", json=body(f"flood {i}", max_tokens=200, ignore_eos=True),
                          timeout=120).status_code

    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(one, range(12)))
    assert set(statuses) <= {200, 529}, statuses
    assert statuses.count(529) >= 1 and statuses.count(200) >= 1, statuses
    wait_for(url, is_idle, 20, "idle after the flood")


# ---- sampling parameters at the edge ---------------------------------------------------------------
class _FreshServer:
    """A server in normal mode on demand: one that a previous case degraded is replaced."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.server: ServerProcess | None = None

    def get(self) -> ServerProcess:
        if self.server is not None and health(self.server.url).get("mode", "normal") != "normal":
            self.server.stop()
            self.server = None
        if self.server is None:
            self.server = ServerProcess(str(self.model_dir), *tiny_args()).wait_ready()
        return self.server


@pytest.fixture(scope="module")
def edge_servers(tiny_model_dir):
    fresh = _FreshServer(tiny_model_dir)
    yield fresh
    if fresh.server is not None:
        fresh.server.stop()


@pytest.mark.parametrize("params", [
    {"temperature": 1e-300}, {"temperature": 5e-324}, {"temperature": 1e-6, "top_p": 1e-300}, {"top_k": 2**40},
    {"temperature": 1.0, "top_p": 5e-324}, {"top_k": 1, "temperature": 1.0},
], ids=["temperature-1e-300", "temperature-subnormal", "tiny-top_p", "huge-top_k", "subnormal-top_p", "top_k-1"])
def test_edge_sampling_params_are_served_without_harm(edge_servers, params):
    """In-range values must not fail the request, its neighbours in the batch, or the prefix cache."""
    url = edge_servers.get().url
    wait_for(url, is_idle, 20, "idle before the edge request")
    neighbour: dict = {}

    def run_neighbour():
        r = httpx.post(url + "/v1/messages", json=body("neighbour", max_tokens=600, ignore_eos=True, temperature=0),
                       timeout=120)
        neighbour["status"], neighbour["body"] = r.status_code, r.json()

    thread = threading.Thread(target=run_neighbour)
    thread.start()
    wait_for(url, lambda h: h["running"] >= 1, 20, "the neighbour running")
    r = httpx.post(url + "/v1/messages", json=body("edge", max_tokens=16, **params), timeout=60)
    thread.join(timeout=120)
    prompt = f"edge cache check {params} " + "Tokyo is in Japan. " * 8
    httpx.post(url + "/v1/messages", json=body(prompt, max_tokens=1), timeout=30)
    again = httpx.post(url + "/v1/messages", json=body(prompt, max_tokens=1), timeout=30).json()
    seen = {
        "edge status": r.status_code,
        "edge output tokens": r.json().get("usage", {}).get("output_tokens") if r.status_code == 200 else r.text[:200],
        "neighbour status": neighbour.get("status"),
        "neighbour output tokens": neighbour.get("body", {}).get("usage", {}).get("output_tokens"),
        "prefix cache still reads": again.get("usage", {}).get("cache_read_input_tokens", 0) > 0,
        "engine mode": health(url).get("mode", "normal"),
    }
    assert seen == {**seen, "edge status": 200, "neighbour status": 200, "neighbour output tokens": 600,
                    "prefix cache still reads": True, "engine mode": "normal"}, seen
    assert seen["edge output tokens"] >= 1
