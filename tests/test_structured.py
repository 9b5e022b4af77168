"""Guaranteed tool calls, structured outputs, logprobs, n and /v1/completions through the official SDKs.

The tiny random-weight model writes noise, so whatever it produces here is the grammar's doing: every
answer that must be a tool call or schema-valid JSON is checked with `jsonschema`.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

# Bounded schemas: a random model would otherwise fill an unbounded string until max_tokens.
NAME = {"type": "string", "maxLength": 12}
TOOLS = [
    {"name": "get_weather", "description": "Weather for a city",
     "input_schema": {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["c", "f"]}},
                      "required": ["city", "unit"], "additionalProperties": False}},
    {"name": "add", "description": "Add two integers",
     "input_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                       "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                      "required": ["a", "b"], "additionalProperties": False}},
    {"name": "tag", "description": "Tag a note", "strict": True,
     "input_schema": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                                "minItems": 1, "maxItems": 3}},
                      "required": ["tags"], "additionalProperties": False}},
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "kind", "items"], "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["a", "b", "c"]},
    "items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "ok"],
        "properties": {"name": NAME, "ok": {"type": "boolean"}}}},
}}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def check_call(block) -> None:
    assert block.type == "tool_use" and block.name in SCHEMAS
    jsonschema.validate(block.input, SCHEMAS[block.name])


# ---- tool calls --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_tool_choice_any_is_a_valid_call(client, seed):
    msg = client.messages.create(model="tiny", max_tokens=120, messages=[user("use a tool")], tools=TOOLS,
                                 tool_choice={"type": "any"}, extra_body={"seed": seed})
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["tool_use"]
    check_call(msg.content[0])


def test_named_tool_is_that_tool(client):
    msg = client.messages.create(model="tiny", max_tokens=120, messages=[user("add")], tools=TOOLS,
                                 tool_choice={"type": "tool", "name": "add"}, extra_body={"seed": 1})
    assert msg.content[0].name == "add"
    check_call(msg.content[0])


def test_streamed_tool_arguments_arrive_incrementally(client):
    with client.messages.stream(model="tiny", max_tokens=120, messages=[user("tag it")], tools=TOOLS,
                                tool_choice={"type": "tool", "name": "tag"}, extra_body={"seed": 2}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(deltas) > 1, deltas
    assert json.loads("".join(deltas)) == final.content[0].input
    assert not any(e.type == "content_block_delta" and e.delta.type == "text_delta" for e in events)
    check_call(final.content[0])


@pytest.mark.parametrize("seed", range(2))
def test_openai_required_tool_call_streams_argument_deltas(oai, seed):
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    stream = oai.chat.completions.create(model="tiny", messages=[user("call")], tools=tools, tool_choice="required",
                                         max_tokens=120, stream=True, seed=seed)
    name, args, pieces, finish = None, "", 0, None
    for chunk in stream:
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                name = call.function.name or name
                if call.function.arguments:
                    args += call.function.arguments
                    pieces += 1
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and pieces > 1
    jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_unsupported_schema_keyword_is_a_400(client, oai):
    bad = {"type": "object", "propertyNames": {"pattern": "^a"}}
    with pytest.raises(anthropic.BadRequestError, match="propertyNames"):
        client.messages.create(model="tiny", max_tokens=8, messages=[user("x")],
                               tools=[{"name": "t", "input_schema": bad, "strict": True}])
    with pytest.raises(openai.BadRequestError, match="propertyNames"):
        oai.chat.completions.create(model="tiny", messages=[user("x")], max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "t", "schema": bad, "strict": True}})


# ---- structured outputs ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_anthropic_output_format_matches_schema(client, seed):
    msg = client.messages.create(model="tiny", max_tokens=160, messages=[user("json")], extra_body={
        "seed": seed, "output_config": {"format": {"type": "json_schema", "schema": NESTED}}})
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), NESTED)


def test_beta_output_format_matches_schema(client):
    msg = client.messages.create(model="tiny", max_tokens=160, messages=[user("json")], extra_body={
        "seed": 5, "output_format": {"type": "json_schema", "schema": NESTED}},
        extra_headers={"anthropic-beta": "structured-outputs-2025-11-13"})
    jsonschema.validate(json.loads(msg.content[0].text), NESTED)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_response_format_json_schema(oai, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": NESTED, "strict": True}}
    if not stream:
        r = oai.chat.completions.create(model="tiny", messages=[user("json")], max_tokens=160, seed=3,
                                        response_format=fmt)
        text = r.choices[0].message.content
    else:
        text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
            model="tiny", messages=[user("json")], max_tokens=160, seed=3, response_format=fmt,
            stream=True) if c.choices)
    jsonschema.validate(json.loads(text), NESTED)


def test_openai_json_object(oai):
    r = oai.chat.completions.create(model="tiny", messages=[user("json")], max_tokens=200, seed=4,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


# ---- logprobs and n ----------------------------------------------------------------------------------
def test_chat_logprobs_are_sorted_and_consistent(oai):
    r = oai.chat.completions.create(model="tiny", messages=[user("hi")], max_tokens=8, temperature=0, logprobs=True,
                                    top_logprobs=5, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])  # greedy: the sampled token is the most likely
        assert entry.token == entry.top_logprobs[0].token
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == r.choices[0].message.content


def test_streamed_logprobs_cover_every_token(oai):
    chunks = list(oai.chat.completions.create(model="tiny", messages=[user("hi")], max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True,
                                              stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)


def test_n_samples_share_the_prompt(oai):
    r = oai.chat.completions.create(model="tiny", messages=[user("the capital of Japan is Tokyo. " * 6)],
                                    max_tokens=6, n=3, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    single = oai.chat.completions.create(model="tiny", messages=[user("the capital of Japan is Tokyo. " * 6)],
                                         max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert r.choices[0].message.content == single.choices[0].message.content  # choice 0 uses the seed itself
    assert len({c.message.content for c in r.choices}) > 1


def test_n_streamed(oai):
    chunks = list(oai.chat.completions.create(model="tiny", messages=[user("hi")], max_tokens=5, n=2, stream=True,
                                              seed=1, extra_body={"ignore_eos": True}))
    finishes = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert finishes == {0: "length", 1: "length"}


# ---- /v1/completions ---------------------------------------------------------------------------------
def test_completions_text_and_tokens(oai):
    r = oai.completions.create(model="tiny", prompt="The capital of Japan is", max_tokens=5, temperature=0,
                               logprobs=3, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "text_completion" and r.usage.completion_tokens == 5
    assert len(choice.logprobs.tokens) == 5 and "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    ids = oai.completions.create(model="tiny", prompt=[10, 20, 30, 40], max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3


def test_completions_echo_stop_n_stream(oai):
    prompt = "Once upon a time"
    r = oai.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, temperature=0, n=2, seed=0)
    assert all(c.text.startswith(prompt) for c in r.choices) and len(r.choices) == 2
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    full = oai.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert text == full.choices[0].text
    out = full.choices[0].text
    stop = next((out[i: i + 2] for i in range(1, len(out) - 1) if out[i: i + 2].isascii() and out[i: i + 2].isalpha()),
                None)
    if stop:
        cut = oai.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stop=[stop])
        assert cut.choices[0].text == out[: out.index(stop)]


def test_completions_score_an_echoed_prompt(oai):
    """echo + logprobs + max_tokens 0, as evaluation harnesses score a continuation: every prompt token but
    the first gets its logprob given the tokens before it, the same whatever follows it."""
    short = oai.completions.create(model="tiny", prompt="The capital of Japan", max_tokens=0, echo=True, logprobs=2)
    long = oai.completions.create(model="tiny", prompt="The capital of Japan is Tokyo", max_tokens=0, echo=True,
                                  logprobs=2)
    a, b = short.choices[0].logprobs, long.choices[0].logprobs
    assert short.choices[0].text == "The capital of Japan" and "".join(a.tokens) == short.choices[0].text
    assert a.token_logprobs[0] is None and a.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in a.token_logprobs[1:])
    assert a.text_offset == [sum(map(len, a.tokens[:k])) for k in range(len(a.tokens))]
    n = len(a.tokens)
    assert b.tokens[:n] == a.tokens
    assert b.token_logprobs[1:n] == pytest.approx(a.token_logprobs[1:], abs=1e-3)


def test_completions_several_prompts_and_samples(oai):
    prompts = ["Hello there", "Once upon a time there was"]
    r = oai.completions.create(model="tiny", prompt=prompts, max_tokens=3, n=2, seed=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    sizes = [oai.completions.create(model="tiny", prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    assert r.usage.prompt_tokens == sum(sizes) and r.usage.completion_tokens == 12
    echoed = oai.completions.create(model="tiny", prompt=prompts, max_tokens=2, echo=True, stream=True)
    texts: dict[int, str] = {}
    for chunk in echoed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts[0].startswith(prompts[0]) and texts[1].startswith(prompts[1])


# ---- content blocks, CORS ----------------------------------------------------------------------------
def test_thinking_blocks_are_accepted_and_left_out(client):
    history = [user("hi"), {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "secret reasoning", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "hello"}]}, user("again")]
    plain = [user("hi"), {"role": "assistant", "content": "hello"}, user("again")]
    assert client.messages.count_tokens(model="tiny", messages=history).input_tokens == \
        client.messages.count_tokens(model="tiny", messages=plain).input_tokens
    assert client.messages.create(model="tiny", max_tokens=2, messages=history).content is not None


@pytest.mark.parametrize("block", [{"type": "image",
                                    "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
                                   {"type": "document",
                                    "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="}},
                                   {"type": "hologram"}])
def test_media_blocks_name_the_block(client, block):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [block]}])
    named = block["source"]["type"] if block["type"] == "document" else block["type"]  # a text document is read
    assert f"'{named}'" in str(e.value) and "text-only" in str(e.value)


@pytest.fixture(scope="module")
def eager_server(tiny_model_dir):
    """Streams start at once, before prefill (--header-wait-s 0), and browsers from one origin may call."""
    from tests.conftest import ServerProcess

    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--header-wait-s", "0", "--cors-origin", "http://app.example").wait_ready()
    yield server
    server.stop()


def test_message_start_has_the_real_input_counts(eager_server):
    client = anthropic.Anthropic(base_url=eager_server.url, api_key="test", max_retries=0)
    messages = [user("the capital of Japan is Tokyo. " * 10)]
    client.messages.create(model="tiny", max_tokens=1, messages=messages)  # now cached
    with client.messages.stream(model="tiny", max_tokens=3, messages=messages) as stream:
        events = list(stream)
    start = events[0].message.usage
    final = stream.get_final_message().usage
    assert start.cache_read_input_tokens == final.cache_read_input_tokens > 0
    assert start.input_tokens == final.input_tokens
    assert start.input_tokens + start.cache_read_input_tokens == client.messages.count_tokens(
        model="tiny", messages=messages).input_tokens


def test_cors_allows_the_named_origin_only(eager_server):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "x-api-key,content-type"}
    ok = httpx.options(eager_server.url + "/v1/messages", headers={"origin": "http://app.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(eager_server.url + "/v1/messages", headers={"origin": "http://evil.example", **preflight})
    assert other.headers.get("access-control-allow-origin") is None
    r = httpx.post(eager_server.url + "/v1/chat/completions", headers={"origin": "http://app.example"}, json={
        "model": "tiny", "max_tokens": 2, "messages": [user("hi")]})
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    assert "x-stratum-cost" in r.headers["access-control-expose-headers"]


def test_cors_is_off_by_default(tiny_server):
    r = httpx.options(tiny_server.url + "/v1/messages", headers={
        "origin": "http://example.com", "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in r.headers
