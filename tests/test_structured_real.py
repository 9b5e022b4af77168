"""On the real model: 20 of 20 forced tool calls and structured outputs are valid, streamed and not."""

from __future__ import annotations

import asyncio
import json

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

TOOLS = [
    {"name": "get_weather", "description": "Get the current weather in a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"]}},
    {"name": "search_web", "description": "Search the web",
     "input_schema": {"type": "object", "properties": {"query": {"type": "string"},
                                                       "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                      "required": ["query"]}},
    {"name": "send_email", "description": "Send an email",
     "input_schema": {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                                       "cc": {"type": "array", "items": {"type": "string"}}},
                      "required": ["to", "subject"]}},
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
QUESTIONS = ["What's the weather in Paris?", "Find recent news about solar power.",
             "Email bob@example.com about lunch.", "Is it raining in Tokyo?", "Look up the population of Peru.",
             "Tell Alice the meeting moved to 3pm."]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "skills"],
          "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"type": "string", "enum": ["engineer", "designer", "manager"]},
    "skills": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "additionalProperties": False, "required": ["skill", "level"],
        "properties": {"skill": {"type": "string"}, "level": {"type": "string", "enum": ["junior", "senior"]}}}},
}}
N = 20


async def _tool_call(claude, i: int, stream: bool):
    kwargs = dict(model="smollm2-135m", max_tokens=200, tools=TOOLS, tool_choice={"type": "any"},
                  messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                  extra_body={"seed": i, "temperature": 0.8})
    if not stream:
        return await claude.messages.create(**kwargs)
    async with claude.messages.stream(**kwargs) as s:
        async for _ in s:
            pass
        return await s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_is_valid_20_of_20(real_server, stream):
    async def run():
        claude = anthropic.AsyncAnthropic(base_url=real_server.url, api_key="test", max_retries=0, timeout=300)
        return await asyncio.gather(*(_tool_call(claude, i, stream) for i in range(N)))

    messages = asyncio.run(run())
    invalid = []
    for msg in messages:
        calls = [b for b in msg.content if b.type == "tool_use"]
        if msg.stop_reason == "tool_use" and len(calls) == 1 and len(msg.content) == 1:
            jsonschema.validate(calls[0].input, SCHEMAS[calls[0].name])
        else:
            invalid.append((msg.stop_reason, [b.model_dump() for b in msg.content]))
    assert not invalid, f"{N - len(invalid)} of {N} valid; " + json.dumps(invalid)[:3000]


async def _openai_json(client, i: int, stream: bool) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kwargs = dict(model="smollm2-135m", max_tokens=300, seed=i, temperature=0.8, response_format=fmt,
                  messages=[{"role": "user", "content": f"Describe team member number {i} as JSON."}])
    if not stream:
        return (await client.chat.completions.create(**kwargs)).choices[0].message.content
    text = ""
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        text += "".join(c.delta.content or "" for c in chunk.choices)
    return text


async def _anthropic_json(client, i: int, stream: bool) -> str:
    kwargs = dict(model="smollm2-135m", max_tokens=300, extra_body={
        "seed": i, "temperature": 0.8, "output_config": {"format": {"type": "json_schema", "schema": PERSON}}},
        messages=[{"role": "user", "content": f"Describe team member number {i} as JSON."}])
    if not stream:
        return (await client.messages.create(**kwargs)).content[0].text
    async with client.messages.stream(**kwargs) as s:
        async for _ in s:
            pass
        return (await s.get_final_message()).content[0].text


@pytest.mark.parametrize("api", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_is_valid_20_of_20(real_server, api, stream):
    async def run():
        if api == "openai":
            client = openai.AsyncOpenAI(base_url=real_server.url + "/v1", api_key="test", max_retries=0, timeout=300)
            return await asyncio.gather(*(_openai_json(client, i, stream) for i in range(N)))
        client = anthropic.AsyncAnthropic(base_url=real_server.url, api_key="test", max_retries=0, timeout=300)
        return await asyncio.gather(*(_anthropic_json(client, i, stream) for i in range(N)))

    for text in asyncio.run(run()):
        jsonschema.validate(json.loads(text), PERSON)


def test_auto_tool_choice_calls_are_valid_and_markup_never_leaks(real_server):
    async def run():
        claude = anthropic.AsyncAnthropic(base_url=real_server.url, api_key="test", max_retries=0, timeout=300)
        return await asyncio.gather(*(claude.messages.create(
            model="smollm2-135m", max_tokens=200, tools=TOOLS, tool_choice={"type": "auto"},
            messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            extra_body={"seed": i, "temperature": 0.8}) for i in range(10)))

    calls = 0
    for msg in asyncio.run(run()):
        for block in msg.content:
            if block.type == "text":
                assert "<tool_call>" not in block.text and "</tool_call>" not in block.text
            else:
                calls += 1
                jsonschema.validate(block.input, SCHEMAS[block.name])
        if msg.stop_reason == "tool_use":
            assert msg.content[-1].type == "tool_use"
    assert calls > 0  # the model does choose tools for these questions
