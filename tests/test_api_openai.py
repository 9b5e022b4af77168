"""The same server through the official `openai` SDK: chat completions, streaming, usage, tool calls."""

from __future__ import annotations

import json
import uuid

import openai
import pytest

GREEDY = {"ignore_eos": True}  # vLLM's extension, through extra_body
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="test", max_retries=0)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_non_streaming_completion(client):
    r = client.chat.completions.create(model="tiny", messages=[user("Hello 🙂")], max_tokens=12, temperature=0,
                                       extra_body=GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny"
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_max_completion_tokens_is_honoured(client):
    r = client.chat.completions.create(model="tiny", messages=[user("Hi")], max_completion_tokens=5, temperature=0,
                                       extra_body=GREEDY)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_streaming_with_usage_matches_non_streaming(client):
    kwargs = dict(model="tiny", messages=[user("日本の首都は東京です 🚀")], max_tokens=32, temperature=0,
                  extra_body=GREEDY)
    client.chat.completions.create(**{**kwargs, "max_tokens": 1})  # both runs below then read the same cached prefix
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    full = client.chat.completions.create(**kwargs)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 32 and last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streaming_without_usage_sends_none(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=[user("hi")], max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in {"length", "stop"}


def test_cached_tokens_on_a_repeated_prompt(client):
    messages = [{"role": "system", "content": "You are terse."},
                user(f"cache me {uuid.uuid4().hex} " + "Berlin is the capital of Germany. " * 10)]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.prompt_tokens
    assert cached > first.usage.prompt_tokens_details.cached_tokens


def test_stop_gives_finish_reason_stop(client):
    kwargs = dict(model="tiny", messages=[user("Hello world!")], max_tokens=40, temperature=0, extra_body=GREEDY)
    client.chat.completions.create(**{**kwargs, "max_tokens": 1})  # both runs below then read the same cached prefix
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = next((text[i: i + 2] for i in range(1, len(text) - 1)
                 if text[i: i + 2].isascii() and text[i: i + 2].isalpha()), None)
    assert stop, f"no ASCII letters in {text!r}"
    r = client.chat.completions.create(stop=stop, **kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]


def test_system_and_developer_roles(client):
    for role in ("system", "developer"):
        r = client.chat.completions.create(model="tiny", max_tokens=2,
                                           messages=[{"role": role, "content": "Be brief."}, user("Hi")])
        assert r.choices[0].message.role == "assistant"
    a = client.chat.completions.create(model="tiny", max_tokens=1,
                                       messages=[{"role": "system", "content": "Be brief."}, user("Hi")])
    b = client.chat.completions.create(model="tiny", max_tokens=1,
                                       messages=[{"role": "developer", "content": "Be brief."}, user("Hi")])
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_tool_choice_none_leaves_tools_out(client):
    plain = client.chat.completions.create(model="tiny", max_tokens=1, messages=[user("Weather?")])
    none = client.chat.completions.create(model="tiny", max_tokens=1, messages=[user("Weather?")], tools=[WEATHER_TOOL],
                                          tool_choice="none")
    auto = client.chat.completions.create(model="tiny", max_tokens=1, messages=[user("Weather?")], tools=[WEATHER_TOOL])
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens


def test_tool_messages_go_back_in(client):
    r = client.chat.completions.create(model="tiny", max_tokens=4, tools=[WEATHER_TOOL], messages=[
        user("Weather in Tokyo?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22°C and sunny"},
    ])
    assert r.choices[0].message.role == "assistant"


def test_models_list(client):
    assert "tiny" in [m.id for m in client.models.list()]


def test_error_classes(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-nonexistent", messages=[user("hi")], max_tokens=1)
    assert info.value.response.headers.get("request-id")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[user("hi")], max_tokens=1, temperature=2.5)
    assert info.value.response.headers.get("request-id")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[user("hi")], max_tokens=4000)
    assert "2048" in info.value.response.json()["error"]["message"]


# ---- the real model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="test", max_retries=0)


@pytest.mark.integration
def test_real_model_tool_calls(real_client):
    kwargs = dict(model="smollm2-135m", max_tokens=80, temperature=0, tools=[WEATHER_TOOL],
                  messages=[user("What is the weather in Tokyo?")])
    r = real_client.chat.completions.create(tool_choice="required", **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments), dict)
    named = real_client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kwargs)
    assert named.choices[0].finish_reason == "tool_calls"
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.integration
def test_real_model_streamed_tool_calls(real_client):
    chunks = list(real_client.chat.completions.create(
        model="smollm2-135m", max_tokens=80, temperature=0, tools=[WEATHER_TOOL], tool_choice="required", stream=True,
        stream_options={"include_usage": True}, messages=[user("What is the weather in Tokyo?")]))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads("".join(tc.function.arguments or "" for tc in calls if tc.index == 0)), dict)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0


@pytest.mark.integration
def test_real_model_answers_tokyo(real_client):
    r = real_client.chat.completions.create(model="smollm2-135m", max_tokens=30, temperature=0,
                                            messages=[user("What is the capital of Japan? Answer in one word.")])
    assert "Tokyo" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
