"""Streaming over HTTP: Anthropic SSE event order and text that matches the non-streaming answer byte for byte.

Raw SSE is read with httpx, so what is checked is what goes over the wire, not what an SDK rebuilds.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from tests.sse import sse_events

# Prompts chosen to make the tiny model's random output and the real model's answers cross
# multi-byte UTF-8: CJK, emoji, accents, and byte-fallback pieces that only decode in pairs.
UNICODE_PROMPTS = [
    "日本の首都は東京です。",
    "Emoji: 🙂🚀 — naïve café, Straße",
    "中文, ελληνικά, 🙂",
    "Hello world!",
]
GREEDY = {"temperature": 0, "ignore_eos": True}


def check_event_order(events: list[tuple[str, dict]]) -> None:
    """Assert Anthropic's order: message_start, then per block start, delta*, stop, then message_delta, message_stop.

    Pings may appear anywhere after message_start; nothing else does (Stratum's own events come only
    when asked). Every event's name equals its data's `type`, and block indices count up from 0.
    """
    for name, data in events:
        assert data.get("type") == name, (name, data)
        assert name != "error", data
    assert events and events[0][0] == "message_start", [n for n, _ in events]
    seq = [(n, d) for n, d in events[1:] if n != "ping"]
    names = [n for n, _ in seq]
    i, index = 0, 0
    while i < len(seq) and names[i] == "content_block_start":
        assert seq[i][1]["index"] == index, seq[i]
        i += 1
        while i < len(seq) and names[i] == "content_block_delta":
            assert seq[i][1]["index"] == index, seq[i]
            i += 1
        assert i < len(seq) and names[i] == "content_block_stop", names
        assert seq[i][1]["index"] == index
        i += 1
        index += 1
    assert names[i:] == ["message_delta", "message_stop"], names


def stream_messages(url: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers.get("request-id")
        return sse_events(r.iter_lines())


def warm(url: str, body: dict, path: str = "/v1/messages") -> None:
    """Run the prompt once so both requests compared afterwards read the same cached prefix.

    A prefix-cache hit changes the arithmetic of prefill (bf16 especially), which can tip a greedy
    choice; these tests compare streaming with non-streaming, not cold with warm.
    """
    r = httpx.post(url + path, json={**body, "stream": False, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def streamed_text(events: list[tuple[str, dict]]) -> str:
    return "".join(d["delta"]["text"] for n, d in events
                   if n == "content_block_delta" and d["delta"]["type"] == "text_delta")


def message_text(message: dict) -> str:
    return "".join(b["text"] for b in message["content"] if b["type"] == "text")


def _body(prompt: str, max_tokens: int = 48, **extra) -> dict:
    return {"model": "tiny", "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}], **extra}


# ---- raw SSE ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", UNICODE_PROMPTS)
def test_raw_sse_order_and_text_equal_non_streaming(tiny_server, prompt):
    body = _body(prompt, **GREEDY)
    warm(tiny_server.url, body)
    events = stream_messages(tiny_server.url, body)
    check_event_order(events)
    full = httpx.post(tiny_server.url + "/v1/messages", json=body, timeout=60).json()
    assert streamed_text(events).encode("utf-8") == message_text(full).encode("utf-8")
    delta = [d for n, d in events if n == "message_delta"][0]
    assert delta["delta"]["stop_reason"] == full["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == full["usage"]["output_tokens"] == 48
    start = events[0][1]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] <= delta["usage"]["output_tokens"]


def test_tiny_model_output_really_crosses_byte_fallback(tiny_server):
    """The equality tests above are only worth something if the output has multi-byte and broken bytes."""
    texts = []
    for prompt in UNICODE_PROMPTS:
        full = httpx.post(tiny_server.url + "/v1/messages", json=_body(prompt, **GREEDY), timeout=60).json()
        texts.append(message_text(full))
    joined = "".join(texts)
    assert any(ord(c) > 0x7F for c in joined), texts
    assert "\ufffd" in joined or any(ord(c) > 0xFFFF for c in joined), texts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_sampling_streams_the_same_text(tiny_server, seed):
    body = _body("Emoji: 🙂🚀 中文", max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)
    warm(tiny_server.url, body)
    events = stream_messages(tiny_server.url, body)
    check_event_order(events)
    full = httpx.post(tiny_server.url + "/v1/messages", json=body, timeout=60).json()
    assert streamed_text(events) == message_text(full)


def test_stop_sequence_in_stream(tiny_server):
    body = _body("Hello world!", max_tokens=40, **GREEDY)
    warm(tiny_server.url, body)
    text = message_text(httpx.post(tiny_server.url + "/v1/messages", json=body, timeout=60).json())
    stop = _ascii_piece(text)
    events = stream_messages(tiny_server.url, {**body, "stop_sequences": [stop]})
    check_event_order(events)
    delta = [d for n, d in events if n == "message_delta"][0]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    assert streamed_text(events) == text[: text.index(stop)]


def _ascii_piece(text: str) -> str:
    """A 2-character ASCII letter run from past the first character, to use as a stop sequence."""
    for i in range(1, len(text) - 1):
        piece = text[i: i + 2]
        if piece.isascii() and piece.isalpha():
            return piece
    pytest.fail(f"no ASCII letters in {text!r}")


def test_zero_max_tokens_stream_has_no_blocks(tiny_server):
    events = stream_messages(tiny_server.url, _body("hi", max_tokens=0))
    check_event_order(events)
    assert not [n for n, _ in events if n.startswith("content_block")]


def test_request_id_differs_per_stream(tiny_server):
    ids = set()
    for _ in range(2):
        with httpx.stream("POST", tiny_server.url + "/v1/messages", json=_body("hi", max_tokens=2, stream=True)) as r:
            r.read()
            ids.add(r.headers["request-id"])
    assert len(ids) == 2


# ---- the SDK's view of the same stream ---------------------------------------------------------------
def test_sdk_stream_events_and_final_message(client):
    kwargs = dict(model="tiny", max_tokens=32, messages=[{"role": "user", "content": "中文 🙂"}], extra_body=GREEDY)
    client.messages.create(**{**kwargs, "max_tokens": 1})  # warm the prefix cache
    with client.messages.stream(**kwargs) as stream:
        events = [(e.type, e.model_dump()) for e in stream]
        final = stream.get_final_message()
    raw_order = [(n, d) for n, d in events if n in {"message_start", "content_block_start", "content_block_delta",
                                                     "content_block_stop", "message_delta", "message_stop", "ping"}]
    check_event_order(raw_order)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 32
    created = client.messages.create(**kwargs)
    assert final.content[0].text == created.content[0].text


def test_sdk_create_stream_true_yields_raw_events(client):
    stream = client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                    stream=True, extra_body=GREEDY)
    events = [(e.type, e.model_dump()) for e in stream]
    check_event_order(events)


# ---- OpenAI chunks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", UNICODE_PROMPTS[:2])
def test_openai_raw_stream_text_equals_non_streaming(tiny_server, prompt):
    body = {"model": "tiny", "max_tokens": 40, "messages": [{"role": "user", "content": prompt}], **GREEDY}
    warm(tiny_server.url, body, "/v1/chat/completions")
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=60) as r:
        assert r.status_code == 200
        chunks = [d for _, d in sse_events(r.iter_lines())]
    assert chunks[-1] == {"done": True}
    chunks = chunks[:-1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 40
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    full = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert text.encode("utf-8") == full["choices"][0]["message"]["content"].encode("utf-8")
    assert len({c["id"] for c in chunks}) == 1


# ---- the real model ----------------------------------------------------------------------------------
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.mark.integration
def test_real_model_streams_a_forced_tool_call(real_server):
    body = {"model": "smollm2-135m", "max_tokens": 80, "temperature": 0, "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": "What is the weather in Tokyo?"}]}
    warm(real_server.url, body)
    events = stream_messages(real_server.url, body)
    check_event_order(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    tool_blocks = [b for b in starts if b["type"] == "tool_use"]
    assert (len(tool_blocks) >= 1 and tool_blocks[0]["name"] == "get_weather"
            and tool_blocks[0]["id"].startswith("toolu_"))
    index = next(d["index"] for n, d in events
                 if n == "content_block_start" and d["content_block"]["type"] == "tool_use")
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["index"] == index)
    assert isinstance(json.loads(partial), dict)
    assert [d for n, d in events if n == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"
    full = httpx.post(real_server.url + "/v1/messages", json=body, timeout=120).json()
    assert [b["type"] for b in full["content"]] == [b["type"] for b in starts]


@pytest.mark.integration
def test_real_model_stream_text_equals_non_streaming(real_server):
    client = anthropic.Anthropic(base_url=real_server.url, api_key="test", max_retries=0)
    kwargs = dict(model="smollm2-135m", max_tokens=40, messages=[{"role": "user", "content": "Say hello in Japanese."}],
                  extra_body={"temperature": 0})
    client.messages.create(**{**kwargs, "max_tokens": 1})  # warm the prefix cache
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == client.messages.create(**kwargs).content[0].text


@pytest.mark.integration
def test_real_model_openai_stream_equals_non_streaming(real_server):
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="test", max_retries=0)
    kwargs = dict(model="smollm2-135m", max_tokens=40, temperature=0,
                  messages=[{"role": "user", "content": "What is the capital of Japan?"}])
    client.chat.completions.create(**{**kwargs, "max_tokens": 1})  # warm the prefix cache
    text = "".join(c.choices[0].delta.content or ""
                   for c in client.chat.completions.create(stream=True, **kwargs) if c.choices)
    assert text == client.chat.completions.create(**kwargs).choices[0].message.content
