"""Errors in each API's own words, read by litellm's exception mapping (aider's stack, and many proxies,
decide from it whether to compact a conversation, back off or give up): a context overflow, a rate limit,
an overloaded server and a bad key, on the Anthropic, OpenAI chat, completions and Responses routes.

OpenAI's context overflow is answered as OpenAI answers it: `invalid_request_error`, code
`context_length_exceeded`, `param` the field at fault under the name the request used, "This model's maximum
context length is N tokens. However, ..."."""

from __future__ import annotations

import warnings

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

MODEL = "tiny"
KEY = "sk-mapping"
CONTEXT = 512
LONG = "word " * 700  # over the context
SHORT = [{"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", MODEL, "--kv-cache-mb", "8",
                           "--max-model-len", str(CONTEXT), "--api-key", KEY).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def budget_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", MODEL, "--kv-cache-mb", "8",
                           "--max-model-len", str(CONTEXT), "--tenant-budget-tokens", "300",
                           "--pollution-policy", "off").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def full_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", MODEL, "--kv-cache-mb", "8",
                           "--max-waiting", "0").wait_ready()
    yield server
    server.stop()


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def context_error(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


def test_openai_context_overflow_is_openais_error(server):
    c = oai(server)
    long = [{"role": "user", "content": LONG}]
    # no output limit sent: the messages alone overflow, and only they are named
    body = context_error(lambda: c.chat.completions.create(model=MODEL, messages=long))
    assert body["code"] == "context_length_exceeded" and body["type"] == "invalid_request_error"
    assert body["param"] == "messages"
    assert body["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. However, your "
                                      "messages resulted in ")
    assert "max_tokens" not in body["message"]
    # a limit the messages leave no room for is named as it was sent
    for field in ("max_tokens", "max_completion_tokens"):
        body = context_error(lambda: c.chat.completions.create(model=MODEL, messages=SHORT, **{field: CONTEXT}))
        assert body["code"] == "context_length_exceeded" and body["param"] == field
        assert f"in the messages, {CONTEXT} in the completion" in body["message"]
    body = context_error(lambda: c.completions.create(model=MODEL, prompt=LONG, max_tokens=4))
    assert body["code"] == "context_length_exceeded" and body["param"] == "prompt"
    body = context_error(lambda: c.responses.create(model=MODEL, input="Hi", max_output_tokens=CONTEXT))
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_output_tokens"
    body = context_error(lambda: c.responses.create(model=MODEL, input=LONG))
    assert body["param"] == "input" and body["message"].startswith("This model's maximum context length is")


def litellm_error(call) -> type:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the class litellm chose is what is tested
            return type(e)
    raise AssertionError("no error")


def routes(litellm, url: str, key: str):
    """One call per route through litellm (no retries), each taking the prompt's text and the output limit."""
    common = dict(api_key=key, max_retries=0)
    oai = dict(model=f"openai/{MODEL}", api_base=url + "/v1", **common)
    return {
        "anthropic": lambda text, n: litellm.completion(model=f"anthropic/{MODEL}", api_base=url, max_tokens=n,
                                                        messages=[{"role": "user", "content": text}], **common),
        "chat": lambda text, n: litellm.completion(messages=[{"role": "user", "content": text}], max_tokens=n, **oai),
        "completions": lambda text, n: litellm.text_completion(prompt=text, max_tokens=n, **oai),
        "responses": lambda text, n: litellm.responses(input=text, max_output_tokens=n, **oai),
    }


@pytest.mark.parametrize("route", ["anthropic", "chat", "completions", "responses"])
def test_litellm_reads_each_error_as_the_class_it_is(server, budget_server, full_server, route, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled prices: no network at import
    import litellm

    litellm.num_retries = 0
    call = routes(litellm, server.url, KEY)[route]
    assert litellm_error(lambda: call(LONG, 4)) is litellm.ContextWindowExceededError
    # a request whose bound is over the tenant's budget (300 tokens) but inside the context
    assert litellm_error(lambda: routes(litellm, budget_server.url, KEY)[route]("Hello", 400)) \
        is litellm.RateLimitError
    assert litellm_error(lambda: routes(litellm, server.url, "sk-wrong")[route]("Hello", 4)) \
        is litellm.AuthenticationError
    overloaded = litellm_error(lambda: routes(litellm, full_server.url, KEY)[route]("Hello", 4))
    assert overloaded is (litellm.InternalServerError if route == "anthropic" else litellm.ServiceUnavailableError)


def test_openai_routes_answer_an_overloaded_server_with_503(full_server):
    r = httpx.post(full_server.url + "/v1/chat/completions", json={"model": MODEL, "messages": SHORT}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error" and int(r.headers["retry-after"]) >= 1
    r = httpx.post(full_server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": SHORT},
                   timeout=30)
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
