"""Property-based requests: nothing a client can send gets a 5xx or hangs. Schemathesis generates bodies
from the served OpenAPI document (every route, each body from its request model, `server/openapi.py`);
hypothesis strategies cover what the document cannot say: streamed answers (the SSE stream ends with its
API's last event or an error event) and Message Batches (every batch ends, every result succeeded or
errored). Bounded here (a few hundred requests on the tiny model, a short context); `stratum bench fuzz`
is the long run."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ServerProcess

CONTEXT = 256  # short, so that no generated max_tokens decodes for long
JSON = {"content-type": "application/json"}  # bodies sent as json.dumps writes them: a lone surrogate as its escape
FUZZ = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--max-model-len", str(CONTEXT)).wait_ready()
    yield server
    server.stop()


def test_the_document_describes_every_body(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions", "/v1/completions",
                 "/v1/responses", "/v1/responses/input_tokens", "/v1/messages/batches"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"], path


def test_no_schema_request_gets_a_5xx(fuzz_server):
    """Every operation of the served document, FUZZ's examples each (schemathesis's pytest plugin is not
    used: it reaches into pytest internals that this pytest no longer has)."""
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15

    for operation in operations:
        @FUZZ
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(timeout=60)
            where = f"{case.method} {case.formatted_path}"
            assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
            if response.status_code >= 400 and case.path.startswith("/v1/"):  # the API's error shape, with its id
                body = response.json()
                assert body["request_id"].startswith("req_") and body["error"]["message"], (where, body)

        check()


# ---- what the document cannot say ---------------------------------------------------------------------
def _anything() -> st.SearchStrategy:
    """Any JSON value, hostile numbers and strings included."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
                        st.sampled_from([2**64, -(2**63) - 1, 2**31, 1e308, -1, 0, "", "\ud800"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=8), inner, max_size=3), max_leaves=6)


def _maybe(value: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value, sometimes anything."""
    return st.one_of(value, value, value, _anything())


def _count() -> st.SearchStrategy:
    return _maybe(st.integers(0, 12)) | st.sampled_from([CONTEXT, CONTEXT + 1, 2**31, 2**63, 2**64])


_TURN = st.fixed_dictionaries({"role": _maybe(st.sampled_from(["user", "assistant"])),
                               "content": _maybe(st.text(min_size=1, max_size=40))})
_SAMPLING = {"temperature": _maybe(st.floats(0, 1)), "top_p": _maybe(st.floats(0.01, 1)), "top_k": _count(),
             "seed": _maybe(st.integers(-(2**63), 2**63 - 1))}


def _messages_body() -> st.SearchStrategy:
    return st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": _count(),
                                  "messages": st.lists(_TURN, min_size=1, max_size=3)},
                                 optional={**_SAMPLING, "stop_sequences": _maybe(st.lists(st.text(max_size=5))),
                                           "system": _maybe(st.text(max_size=40)), "ignore_eos": st.booleans()})


def _chat_body() -> st.SearchStrategy:
    return st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.lists(_TURN, min_size=1, max_size=3)},
                                 optional={**_SAMPLING, "max_tokens": _count(), "n": _maybe(st.integers(1, 3)),
                                           "stop": _maybe(st.lists(st.text(max_size=5), max_size=6)),
                                           "logprobs": st.booleans(), "top_logprobs": _count(),
                                           "presence_penalty": _maybe(st.floats(-2, 2)),
                                           "stream_options": _maybe(st.just({"include_usage": True}))})


def _read_stream(url: str, path: str, body: dict) -> None:
    """POST a streamed request: a 4xx, or a 200 whose stream ends with its API's last event or an error
    event; never a 5xx, never a stream that does not end."""
    with httpx.stream("POST", url + path, content=json.dumps(body), headers=JSON, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            assert r.status_code < 500, f"{path} {json.dumps(body)[:300]}: {r.status_code} {r.text[:300]}"
            return
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data, body
    last = data[-1]
    if path == "/v1/messages":
        assert json.loads(last)["type"] in ("message_stop", "error") or json.loads(data[-2])["type"] == "message_stop"
    else:
        assert last == "[DONE]" or "error" in json.loads(last), last


@FUZZ
@given(body=_messages_body())
def test_streamed_messages_end(fuzz_server, body):
    _read_stream(fuzz_server.url, "/v1/messages", {**body, "stream": True})


@FUZZ
@given(body=_chat_body())
def test_streamed_chat_completions_end(fuzz_server, body):
    _read_stream(fuzz_server.url, "/v1/chat/completions", {**body, "stream": True})


@settings(FUZZ, max_examples=6)
@given(params=st.lists(_maybe(_messages_body()), min_size=1, max_size=3))
def test_every_batch_ends(fuzz_server, params):
    url = fuzz_server.url
    requests = [{"custom_id": f"r{i}", "params": p} for i, p in enumerate(params)]
    r = httpx.post(url + "/v1/messages/batches", content=json.dumps({"requests": requests}), headers=JSON,
                   timeout=30)
    if r.status_code != 200:  # a params that is not an object, a lone surrogate: the batch is refused whole
        assert r.status_code == 400, r.text
        return
    batch_id = r.json()["id"]
    deadline = time.monotonic() + 60
    while (batch := httpx.get(f"{url}/v1/messages/batches/{batch_id}").json())["processing_status"] != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    lines = httpx.get(f"{url}/v1/messages/batches/{batch_id}/results").text.splitlines()
    results = [json.loads(line)["result"] for line in lines]
    assert len(results) == len(params) and {res["type"] for res in results} <= {"succeeded", "errored"}, results
