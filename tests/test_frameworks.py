"""Agent frameworks unmodified: LangChain's ChatAnthropic and ChatOpenAI streaming tool calls with chunk
accumulation, and a LangGraph ReAct agent streaming one, on both APIs; and a default stream that is exactly
the API's, field for field, since these frameworks merge and validate what they receive.

The model is scripted (tests/scripted.py): a Qwen2.5-template model whose greedy answer is one tool call,
its arguments in several pieces, so they stream as several deltas."""

from __future__ import annotations

import functools
import operator
import warnings

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.scripted import QWEN3_ADDED, make_scripted_model, template
from tests.sse import META_ON, delta_metas, sse_events

CALL = ["\n", "<tool_call>", '\n{"name": "', "get_weather", '", "arguments": ', '{"city": "', "Paris", '"}', "}\n",
        "</tool_call>"]
MODEL = "qwen-tiny"
QUESTION = "What is the weather in Paris?"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# what the Anthropic stream may hold, per object: Anthropic's fields and nothing else
ANTHROPIC_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                    "message_delta", "message_stop", "ping"}
ANTHROPIC_DELTAS = {"text_delta": {"type", "text"}, "input_json_delta": {"type", "partial_json"},
                    "thinking_delta": {"type", "thinking"}, "signature_delta": {"type", "signature"}}
ANTHROPIC_BLOCKS = {"text": {"type", "text"}, "tool_use": {"type", "id", "name", "input"},
                    "thinking": {"type", "thinking", "signature"}}
ANTHROPIC_MESSAGE = {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
OPENAI_CHUNK = {"id", "object", "created", "model", "choices", "usage", "system_fingerprint", "service_tier"}


def get_weather(city: str) -> str:
    """Weather in a city."""
    return f"Sunny in {city}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_scripted_model(tmp_path_factory.mktemp("caller"), template("qwen2.5"), [CALL], added=QWEN3_ADDED)
    server = ServerProcess(str(path), "--served-model-name", MODEL, "--kv-cache-mb", "8").wait_ready()
    yield server
    server.stop()


def stream(url: str, path: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def test_an_anthropic_stream_is_exactly_anthropics(server):
    events = stream(server.url, "/v1/messages", {"model": MODEL, "max_tokens": 64, "tools": [WEATHER],
                                                 "messages": [{"role": "user", "content": QUESTION}]})
    assert {n for n, _ in events} <= ANTHROPIC_EVENTS
    for name, data in events:
        if name == "content_block_delta":
            assert set(data) == {"type", "index", "delta"} and set(data["delta"]) == ANTHROPIC_DELTAS[
                data["delta"]["type"]], data
        elif name == "content_block_start":
            assert set(data["content_block"]) == ANTHROPIC_BLOCKS[data["content_block"]["type"]], data
        elif name == "message_start":
            assert set(data["message"]) == ANTHROPIC_MESSAGE, data
        elif name == "message_delta":
            assert set(data) == {"type", "delta", "usage"} and set(data["delta"]) == {"stop_reason", "stop_sequence"}
    fragments = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert len(fragments) > 1 and "".join(fragments) == '{"city": "Paris"}'


def test_stratums_events_come_when_asked_in_events_of_their_own(server):
    body = {"model": MODEL, "max_tokens": 64, "tools": [WEATHER], "messages": [{"role": "user", "content": QUESTION}]}
    for headers in (META_ON, {"x-stratum-negotiate": "v1"}):
        events = stream(server.url, "/v1/messages", body, headers)
        pairs = delta_metas(events)  # a stratum_meta event after every delta, the delta itself untouched
        assert pairs and all(set(delta) == ANTHROPIC_DELTAS[delta["type"]] for delta, _ in pairs)
        assert {"stratum_state", "kv_cache_efficiency"} == set(pairs[0][1])
        assert [n for n, _ in events][-2:] == ["stratum_cost", "message_stop"]


def test_openai_and_responses_streams_carry_nothing_unasked(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}]
    chunks = stream(server.url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 64, "tools": tools,
                                                         "messages": [{"role": "user", "content": QUESTION}]})
    assert all(set(c) <= OPENAI_CHUNK for _, c in chunks if "done" not in c)
    events = stream(server.url, "/v1/responses", {"model": MODEL, "max_output_tokens": 64, "input": QUESTION})
    assert not [d for _, d in events if "stratum_cost" in d]
    asked = stream(server.url, "/v1/responses", {"model": MODEL, "max_output_tokens": 64, "input": QUESTION}, META_ON)
    assert [d for _, d in asked if "stratum_cost" in d]


def langchain_models(url: str):
    from langchain_anthropic import ChatAnthropic
    from langchain_openai import ChatOpenAI

    return {"anthropic": ChatAnthropic(model=MODEL, anthropic_api_url=url, api_key="test", max_tokens=64,
                                       temperature=0, max_retries=0),
            "openai": ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="test", max_tokens=64, temperature=0,
                                 max_retries=0)}


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_langchain_streams_tool_calls_and_merges_the_chunks(server, api):
    model = langchain_models(server.url)[api].bind_tools([get_weather])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chunks = list(model.stream(QUESTION))
    assert len([c for c in chunks if c.tool_call_chunks]) > 1  # the arguments streamed in pieces
    merged = functools.reduce(operator.add, chunks)  # LangChain's own merge of every chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_a_langgraph_react_agent_streams_a_tool_call(server, api):
    from langchain_core.messages import AIMessageChunk, ToolMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    # the tool's answer is the agent's (return_direct): the scripted model would call it again otherwise
    weather = tool(return_direct=True)(get_weather)
    agent = create_react_agent(langchain_models(server.url)[api], [weather])
    streamed, final = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode, item in agent.stream({"messages": [("user", QUESTION)]}, stream_mode=["messages", "values"]):
            if mode == "messages" and isinstance(item[0], AIMessageChunk):
                streamed.append(item[0])
            elif mode == "values":
                final = item
    merged = functools.reduce(operator.add, streamed)
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris"})]
    answer = final["messages"][-1]
    assert isinstance(answer, ToolMessage) and answer.content == "Sunny in Paris"
