"""Every request in the bad-input corpus gets its 4xx, in the error shape of its API (Anthropic's, or
OpenAI's on the OpenAI routes), with a request id; afterwards the servers are healthy and hold no KV
blocks."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from tests.bad_inputs import CORPUS, GUARDED_KEY, MAX_BODY_BYTES, BadRequest
from tests.conftest import ServerProcess


@pytest.fixture(scope="module")
def guarded_server(tiny_model_dir):
    """The tiny model behind an API key and a small body limit."""
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--api-key", GUARDED_KEY, "--max-body-bytes", str(MAX_BODY_BYTES)).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def servers(tiny_server, guarded_server):
    return {"tiny": tiny_server, "guarded": guarded_server}


def send(url: str, case: BadRequest) -> httpx.Response:
    content = case.content()
    if case.is_chunked and content is not None:
        body = content
        content = (body[i: i + 1024] for i in range(0, len(body), 1024))  # a generator: no Content-Length
    return httpx.request(case.method, url + case.path, content=content, headers=case.headers, timeout=60)


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 100


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_bad_request_gets_its_error(servers, case):
    r = send(servers[case.server].url, case)
    assert r.status_code == case.status, r.text[:500]
    request_id = r.headers.get("request-id")
    assert request_id and request_id.startswith("req_")
    body = r.json()
    # OpenAI's shape: no top-level type, param and code
    if case.path.startswith(("/v1/chat/completions", "/v1/completions", "/v1/responses")):
        assert "type" not in body and {"message", "type", "param", "code"} <= set(body["error"]), body
    else:
        assert body["type"] == "error"
    assert body["error"]["type"] == case.error_type, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["request_id"] == request_id
    for piece in case.message_has:
        assert piece in body["error"]["message"], body["error"]["message"]
    if case.status == 401:
        assert GUARDED_KEY not in r.text


# ---- the guarded server's open doors and SDK error classes -------------------------------------
def test_health_is_open_on_a_keyed_server(guarded_server):
    r = httpx.get(guarded_server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.headers.get("request-id")


@pytest.mark.parametrize("headers", [{"x-api-key": GUARDED_KEY}, {"authorization": f"Bearer {GUARDED_KEY}"},
                                     {"authorization": f"bearer {GUARDED_KEY}"}],
                         ids=["x-api-key", "bearer", "lowercase-bearer"])
def test_right_key_is_accepted(guarded_server, headers):
    r = httpx.post(guarded_server.url + "/v1/messages", headers=headers, timeout=60,
                   json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert httpx.get(guarded_server.url + "/v1/models", headers=headers).status_code == 200


def test_sdk_authentication_errors(guarded_server):
    wrong = anthropic.Anthropic(base_url=guarded_server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=guarded_server.url, auth_token="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bearer.models.list()
    right = anthropic.Anthropic(base_url=guarded_server.url, auth_token=GUARDED_KEY, max_retries=0)
    assert [m.id for m in right.models.list().data] == ["tiny"]
    oai = openai.OpenAI(base_url=guarded_server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        oai.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_sdk_request_too_large(guarded_server):
    client = anthropic.Anthropic(base_url=guarded_server.url, api_key=GUARDED_KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}])
    assert info.value.status_code == 413
    assert info.value.body["error"]["type"] == "request_too_large"


# ---- after the corpus ---------------------------------------------------------------------------
def test_servers_are_back_at_baseline(servers):
    """Nothing the corpus sent left a sequence holding KV blocks, and both servers still serve."""
    for name, server in servers.items():
        deadline = time.monotonic() + 15
        while True:
            r = httpx.get(server.url + "/health", timeout=10)
            assert r.status_code == 200, (name, r.text)
            health = r.json()
            if health["kv_blocks"]["in_use"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert health["status"] == "ok"
        assert health["kv_blocks"]["in_use"] == 0, (name, health)
        assert health["running"] == 0 and health["waiting"] == 0, (name, health)
        blocks = health["kv_blocks"]
        assert blocks["free"] + blocks["in_use"] <= blocks["total"]
        headers = {"x-api-key": GUARDED_KEY} if name == "guarded" else {}
        ok = httpx.post(server.url + "/v1/messages", headers=headers, timeout=60,
                        json={"model": "tiny", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "still there?"}]})
        assert ok.status_code == 200, ok.text


# ---- the official SDKs, where they can send it ----------------------------------------------------
def test_sdks_get_a_400_naming_an_unbounded_number(client, oai):
    """What the corpus sends raw, through the SDKs: a top_k past 64 bits was a 500 (msgpack overflowed
    on the way to the engine), streamed or not; OpenAI's stop past its 4."""
    hi = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="tiny", max_tokens=4, messages=hi, stream=stream, extra_body={"top_k": 2**64})
        assert "top_k" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="tiny", max_tokens=4, messages=hi, stream=stream,
                                        extra_body={"top_k": 2**64})
        assert e.value.param == "top_k"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", max_tokens=4, messages=hi, stop=["a", "b", "c", "d", "e"])
    assert e.value.param == "stop" and "at most 4" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="hi", max_tokens=4, seed=2**63)
    assert e.value.param == "seed"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", max_tokens=4, messages=hi, presence_penalty=2.5)
    assert e.value.param == "presence_penalty"
    assert oai.chat.completions.create(model="tiny", max_tokens=2, messages=hi, presence_penalty=-2.0,
                                       logit_bias={"5": -100}, stop=["a", "b", "c", "d"]).choices
