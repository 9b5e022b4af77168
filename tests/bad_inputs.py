"""A corpus of bad HTTP requests, each with the 4xx status and error type it must get.

`server` picks the server a case goes to: "tiny" (no key, default body limit) or "guarded"
(GUARDED_KEY required and a MAX_BODY_BYTES body limit). Guarded cases that are not about the key
send the right key, so only the thing under test is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

GUARDED_KEY = "sk-stratum-test-key"
MAX_BODY_BYTES = 4096
CONTEXT_LENGTH = 2048  # the tiny model's max_position_embeddings

INVALID = "invalid_request_error"
NOT_FOUND = "not_found_error"
AUTH = "authentication_error"
TOO_LARGE = "request_too_large"


@dataclass(frozen=True)
class BadRequest:
    """Args:
        body: sent as JSON (json.dumps, so lone surrogates go out as \\ud800 escapes) unless `raw` is set.
        raw: exact body bytes.
        is_chunked: send the body with Transfer-Encoding: chunked, so there is no Content-Length.
        message_has: substrings the error message must contain.
    """

    name: str
    path: str
    body: Any = None
    raw: bytes | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 400
    error_type: str = INVALID
    server: str = "tiny"
    is_chunked: bool = False
    message_has: tuple[str, ...] = ()

    def content(self) -> bytes | None:
        if self.raw is not None:
            return self.raw
        if self.body is None:
            return None
        return json.dumps(self.body).encode()


MESSAGE = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
CHAT = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
COUNT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {}}}
OAI_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
JSON_HEADERS = {"content-type": "application/json"}
KEYED = {"x-api-key": GUARDED_KEY, **JSON_HEADERS}


def _with(base: dict, **changes) -> dict:
    return {**base, **changes}


def _without(base: dict, key: str) -> dict:
    return {k: v for k, v in base.items() if k != key}


def _content(content) -> dict:
    return _with(MESSAGE, messages=[{"role": "user", "content": content}])


def _message(**fields) -> dict:
    return _with(MESSAGE, messages=[fields])


def _messages_cases() -> list[BadRequest]:
    p = "/v1/messages"
    raw = {
        "malformed json": b"{not json",
        "truncated json": b'{"model": "tiny", "max_tokens": 8,',
        "empty body": b"",
        "not utf-8": b"\xff\xfe\xfa",
        "trailing garbage": json.dumps(MESSAGE).encode() + b" garbage",
        "json null": b"null",
        "json array": b"[]",
        "json string": b'"hello"',
        "json number": b"42",
        "json true": b"true",
        "deeply nested json": b"[" * 100_000 + b"]" * 100_000,
        "temperature NaN":
            b'{"model": "tiny", "max_tokens": 8, "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}',
        "temperature Infinity": b'{"model": "tiny", "max_tokens": 8, "temperature": Infinity, '
                                b'"messages": [{"role": "user", "content": "hi"}]}',
        "max_tokens 1e400": b'{"model": "tiny", "max_tokens": 1e400, "messages": [{"role": "user", "content": "hi"}]}',
        "max_tokens 5000 digits":
            b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b', "messages": [{"role": "user", "content": "hi"}]}',
    }
    cases = [BadRequest(f"messages: {name}", p, raw=body, headers=JSON_HEADERS) for name, body in raw.items()]
    bodies = {
        # lone surrogates anywhere a string goes
        "surrogate in content": _content("\ud800"),
        "low surrogate in content": _content("abc\udfffdef"),
        "surrogate in text block": _content([{"type": "text", "text": "\ud800"}]),
        "surrogate in system": _with(MESSAGE, system="\ud83d"),
        "surrogate in model": _with(MESSAGE, model="tiny\ud800"),
        "surrogate in stop_sequences": _with(MESSAGE, stop_sequences=["\udc00"]),
        "surrogate in tool description": _with(MESSAGE, tools=[_with(TOOL, description="\ud800")]),
        "surrogate in tool_use input": _with(MESSAGE, messages=[{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "\ud800"}}]}]),
        # model
        "model is a number": _with(MESSAGE, model=123),
        "model is null": _with(MESSAGE, model=None),
        "model is empty": _with(MESSAGE, model=""),
        "model missing": _without(MESSAGE, "model"),
        # max_tokens
        "max_tokens missing": _without(MESSAGE, "max_tokens"),
        "max_tokens is a string": _with(MESSAGE, max_tokens="8"),
        "max_tokens is a fraction": _with(MESSAGE, max_tokens=8.5),
        "max_tokens is null": _with(MESSAGE, max_tokens=None),
        "max_tokens is a bool": _with(MESSAGE, max_tokens=True),
        "max_tokens is a list": _with(MESSAGE, max_tokens=[8]),
        "max_tokens negative": _with(MESSAGE, max_tokens=-1),
        # messages
        "messages missing": _without(MESSAGE, "messages"),
        "messages is a string": _with(MESSAGE, messages="hi"),
        "messages is an object": _with(MESSAGE, messages={"role": "user", "content": "hi"}),
        "messages empty": _with(MESSAGE, messages=[]),
        "message is a string": _with(MESSAGE, messages=["hi"]),
        "message is null": _with(MESSAGE, messages=[None]),
        "message without role": _with(MESSAGE, messages=[{"content": "hi"}]),
        "message without content": _message(role="user"),
        "role system": _message(role="system", content="hi"),
        "role tool": _message(role="tool", content="hi"),
        "role capitalised": _message(role="User", content="hi"),
        "role is a number": _message(role=1, content="hi"),
        "message with unknown field": _message(role="user", content="hi", name="bob"),
        "empty user content": _content(""),
        "empty content list": _content([]),
        # content blocks
        "content is a number": _content(5),
        "content is null": _content(None),
        "content is one object": _content({"type": "text", "text": "hi"}),
        "content list of strings": _content(["hi"]),
        "unknown block type": _content([{"type": "bogus", "text": "hi"}]),
        "image block": _content([{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                              "data": "iVBORw0KGgo="}}]),
        "PDF document block": _content([{"type": "document", "source": {"type": "base64",
                                                                         "media_type": "application/pdf",
                                                                         "data": "JVBERi0="}}]),
        "image in a tool_result": _content([{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
        "document text source without data": _content([{"type": "document",
                                                        "source": {"type": "text", "media_type": "text/plain"}}]),
        "search_result without title": _content([{"type": "search_result", "source": "s",
                                                  "content": [{"type": "text", "text": "x"}]}]),
        # system messages inside messages: Anthropic's placement rules
        "system message after an assistant turn": _with(MESSAGE, messages=[{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": "hello"}, {"role": "system", "content": "be brief"}]),
        "system message before a user turn": _with(MESSAGE, messages=[{"role": "user", "content": "hi"}, {
            "role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]),
        "two system messages in a row": _with(MESSAGE, messages=[{"role": "user", "content": "hi"}, {
            "role": "system", "content": "be brief"}, {"role": "system", "content": "be kind"}]),
        "system message with a tool_use block": _with(MESSAGE, messages=[{"role": "user", "content": "hi"}, {
            "role": "system", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}]),
        "thinking of an unknown type": _with(MESSAGE, thinking={"type": "always"}),
        "effort of an unknown level": _with(MESSAGE, output_config={"effort": "extreme"}),
        "block without type": _content([{"text": "hi"}]),
        "text block without text": _content([{"type": "text"}]),
        "text block text is a number": _content([{"type": "text", "text": 5}]),
        "text block with unknown field": _content([{"type": "text", "text": "hi", "colour": "red"}]),
        "bad cache_control type": _content([{"type": "text", "text": "hi", "cache_control": {"type": "forever"}}]),
        "tool_use block without id": _with(MESSAGE, messages=[{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": [{"type": "tool_use", "name": "get_weather", "input": {}}]}]),
        "tool_use input is a string": _with(MESSAGE, messages=[{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": "{}"}]}]),
        "tool_result without tool_use_id": _content([{"type": "tool_result", "content": "22C"}]),
        "tool_result content is a number": _content([{"type": "tool_result", "tool_use_id": "t1", "content": 22}]),
        # system
        "system is a number": _with(MESSAGE, system=5),
        "system is one object": _with(MESSAGE, system={"type": "text", "text": "x"}),
        "system list of strings": _with(MESSAGE, system=["x"]),
        "system image block": _with(MESSAGE, system=[{"type": "image", "source": {}}]),
        "output_config format of another type": _with(MESSAGE,
                                                      output_config={"format": {"type": "regex", "schema": {}}}),
        "output_config schema not enforceable": _with(MESSAGE, output_config={"format": {
            "type": "json_schema", "schema": {"type": "object", "propertyNames": {"pattern": "a"}}}}),
        "strict tool schema not enforceable": _with(MESSAGE, tools=[_with(TOOL, strict=True, input_schema={
            "type": "object", "propertyNames": {"pattern": "a"}})]),
        "thinking block without its text": _content([{"type": "thinking", "signature": "s"}]),
        # sampling
        "temperature 1.5": _with(MESSAGE, temperature=1.5),
        "temperature negative": _with(MESSAGE, temperature=-0.1),
        "temperature is a word": _with(MESSAGE, temperature="hot"),
        "top_p 0": _with(MESSAGE, top_p=0),
        "top_p above 1": _with(MESSAGE, top_p=1.5),
        "top_p negative": _with(MESSAGE, top_p=-0.5),
        "top_k -1": _with(MESSAGE, top_k=-1),
        "top_k fraction": _with(MESSAGE, top_k=1.5),
        "top_k is a word": _with(MESSAGE, top_k="ten"),
        "stop_sequences is a string": _with(MESSAGE, stop_sequences="STOP"),
        "stop_sequences has a number": _with(MESSAGE, stop_sequences=[1]),
        "stop_sequences has empty string": _with(MESSAGE, stop_sequences=[""]),
        "stream is a word": _with(MESSAGE, stream="yes"),
        "stream is 2": _with(MESSAGE, stream=2),
        "seed is a word": _with(MESSAGE, seed="lucky"),
        "seed is a fraction": _with(MESSAGE, seed=1.5),
        "seed beyond 64 bits": _with(MESSAGE, seed=2**70),
        "seed below -2**63": _with(MESSAGE, seed=-(2**70)),
        "ignore_eos is a word": _with(MESSAGE, ignore_eos="maybe"),
        # metadata and unknown fields
        "metadata is a string": _with(MESSAGE, metadata="x"),
        "metadata user_id is a number": _with(MESSAGE, metadata={"user_id": 5}),
        "metadata unknown field": _with(MESSAGE, metadata={"session": "x"}),
        "metadata user_id too long": _with(MESSAGE, metadata={"user_id": "u" * 300}),
        "unknown top-level field": _with(MESSAGE, frequency_penalty=0.5),
        # tools
        "tools is a string": _with(MESSAGE, tools="get_weather"),
        "tools is an object": _with(MESSAGE, tools=TOOL),
        "tool without input_schema": _with(MESSAGE, tools=[_without(TOOL, "input_schema")]),
        "tool without name": _with(MESSAGE, tools=[_without(TOOL, "name")]),
        "tool name with a space": _with(MESSAGE, tools=[_with(TOOL, name="get weather")]),
        "tool name empty": _with(MESSAGE, tools=[_with(TOOL, name="")]),
        "tool name too long": _with(MESSAGE, tools=[_with(TOOL, name="t" * 129)]),
        "tool schema type string": _with(MESSAGE, tools=[_with(TOOL, input_schema={"type": "string"})]),
        "tool schema without type": _with(MESSAGE, tools=[_with(TOOL, input_schema={"properties": {}})]),
        "tool schema is a string": _with(MESSAGE, tools=[_with(TOOL, input_schema="object")]),
        "tool description is a number": _with(MESSAGE, tools=[_with(TOOL, description=5)]),
        "duplicate tool names": _with(MESSAGE, tools=[TOOL, TOOL]),
        "tool_choice names an unknown tool": _with(MESSAGE, tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}),
        "tool_choice tool without name": _with(MESSAGE, tools=[TOOL], tool_choice={"type": "tool"}),
        "tool_choice any without tools": _with(MESSAGE, tool_choice={"type": "any"}),
        "tool_choice tool without tools": _with(MESSAGE, tool_choice={"type": "tool", "name": "get_weather"}),
        "tool_choice unknown type": _with(MESSAGE, tools=[TOOL], tool_choice={"type": "sometimes"}),
        "tool_choice is a string": _with(MESSAGE, tools=[TOOL], tool_choice="auto"),
        "disable_parallel_tool_use is a word": _with(MESSAGE, tools=[TOOL], tool_choice={
            "type": "auto", "disable_parallel_tool_use": "no"}),
    }
    cases += [BadRequest(f"messages: {name}", p, body=body) for name, body in bodies.items()]
    cases += [
        # any claude-* name is served by the loaded model (docs/api.md: "Model names"); other names are not found
        BadRequest("messages: unknown model", p, _with(MESSAGE, model="gpt-9"), status=404, error_type=NOT_FOUND,
                   message_has=("gpt-9",)),
        # max_tokens above the context is a 400 naming both numbers, in Anthropic's words; one within it but
        # beyond what the prompt leaves is lowered to fit (stop_reason model_context_window_exceeded,
        # tests/test_agent_clients.py); a prompt beyond the context is a 400 in Anthropic's words
        BadRequest("messages: max_tokens over the model's output limit", p, _with(MESSAGE, max_tokens=10**12),
                   message_has=(f"max_tokens: {10**12} > {CONTEXT_LENGTH}, which is the maximum allowed number of "
                                "output tokens for tiny",)),
        BadRequest("messages: tool_use with a field of no block", p, _with(MESSAGE, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": {}, "colour": "red"}]}]),
                   message_has=("messages.1.content.0.tool_use.colour: Extra inputs are not permitted",)),
        BadRequest("messages: prompt over the context", p, _content("the capital of Japan is Tokyo. " * 400),
                   message_has=("prompt is too long", f"> {CONTEXT_LENGTH} maximum")),
        BadRequest("messages: stream with a prompt over the context", p, _with(
            _content("the capital of Japan is Tokyo. " * 400), stream=True), message_has=("prompt is too long",)),
    ]
    return cases


def _count_tokens_cases() -> list[BadRequest]:
    p = "/v1/messages/count_tokens"
    return [
        BadRequest("count_tokens: malformed json", p, raw=b"{", headers=JSON_HEADERS),
        BadRequest("count_tokens: unknown model", p, _with(COUNT, model="nope"), status=404, error_type=NOT_FOUND),
        BadRequest("count_tokens: messages missing", p, _without(COUNT, "messages")),
        BadRequest("count_tokens: messages empty", p, _with(COUNT, messages=[])),
        BadRequest("count_tokens: max_tokens is not a field", p, _with(COUNT, max_tokens=8)),
        BadRequest("count_tokens: lone surrogate", p, _with(COUNT, messages=[{"role": "user", "content": "\ud800"}])),
        BadRequest("count_tokens: bad role", p, _with(COUNT, messages=[{"role": "robot", "content": "hi"}])),
        BadRequest("count_tokens: unknown tool in tool_choice", p,
                   _with(COUNT, tools=[TOOL], tool_choice={"type": "tool", "name": "nope"})),
        BadRequest("count_tokens: bad tool schema", p,
                   _with(COUNT, tools=[_with(TOOL, input_schema={"type": "array"})])),
    ]


def _chat_cases() -> list[BadRequest]:
    p = "/v1/chat/completions"
    bodies = {
        "messages missing": _without(CHAT, "messages"),
        "messages empty": _with(CHAT, messages=[]),
        "bad role": _with(CHAT, messages=[{"role": "robot", "content": "hi"}]),
        "content is a number": _with(CHAT, messages=[{"role": "user", "content": 5}]),
        "image_url part": _with(CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
        "lone surrogate": _with(CHAT, messages=[{"role": "user", "content": "\udbff"}]),
        "model is a number": _with(CHAT, model=7),
        "temperature 2.5": _with(CHAT, temperature=2.5),
        "top_p 0": _with(CHAT, top_p=0),
        "top_k -1": _with(CHAT, top_k=-1),
        "n is 0": _with(CHAT, n=0),
        "n over the limit": _with(CHAT, n=17),
        "top_logprobs 21": _with(CHAT, logprobs=True, top_logprobs=21),
        "top_logprobs without logprobs": _with(CHAT, top_logprobs=2),
        "response_format unknown type": _with(CHAT, response_format={"type": "yaml"}),
        "response_format json_schema without a schema": _with(CHAT, response_format={"type": "json_schema"}),
        "response_format schema not enforceable": _with(CHAT, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object", "propertyNames": {"pattern": "a"}}}}),
        "response_format not strict, schema still not enforceable": _with(CHAT, response_format={
            "type": "json_schema", "json_schema": {
                "name": "x", "strict": False, "schema": {"type": "object", "propertyNames": {"pattern": "a"}}}}),
        "response_format unsatisfiable schema": _with(CHAT, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}),
        "max_tokens negative": _with(CHAT, max_tokens=-1),
        "max_completion_tokens negative": _with(CHAT, max_completion_tokens=-5),
        "stop is a number": _with(CHAT, stop=5),
        "stop has empty string": _with(CHAT, stop=[""]),
        "stream_options is a number": _with(CHAT, stream_options=5),
        "tools is an object": _with(CHAT, tools=OAI_TOOL),
        "tool type not function": _with(CHAT, tools=[_with(OAI_TOOL, type="retrieval")]),
        "tool name with a space": _with(CHAT, tools=[{"type": "function", "function": {"name": "get weather"}}]),
        "tool parameters type string": _with(CHAT, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "string"}}}]),
        "tool_choice unknown word": _with(CHAT, tools=[OAI_TOOL], tool_choice="sometimes"),
        "tool_choice names an unknown function": _with(CHAT, tools=[OAI_TOOL], tool_choice={
            "type": "function", "function": {"name": "nope"}}),
        "tool_choice required without tools": _with(CHAT, tool_choice="required"),
        "tool_choice function is a string": _with(CHAT, tools=[OAI_TOOL],
                                                  tool_choice={"type": "function", "function": "get_weather"}),
        "tool_choice function without name": _with(CHAT, tools=[OAI_TOOL],
                                                   tool_choice={"type": "function", "function": {}}),
        "tool_choice object of another type": _with(CHAT, tools=[OAI_TOOL],
                                                    tool_choice={"type": "tool", "name": "get_weather"}),
        "seed beyond 64 bits": _with(CHAT, seed=2**70),
    }
    cases = [BadRequest(f"chat: {name}", p, body=body) for name, body in bodies.items()]
    cases += [
        BadRequest("chat: malformed json", p, raw=b"{'single': 'quotes'}", headers=JSON_HEADERS),
        BadRequest("chat: json array", p, raw=b"[{}]", headers=JSON_HEADERS),
        BadRequest("chat: unknown model", p, _with(CHAT, model="gpt-9"), status=404, error_type=NOT_FOUND),
        BadRequest("chat: max_tokens over the context", p, _with(CHAT, max_tokens=4000),
                   message_has=("4000", str(CONTEXT_LENGTH))),
    ]
    return cases


def _completions_cases() -> list[BadRequest]:
    p = "/v1/completions"
    base = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    bodies = {
        "prompt missing": _without(base, "prompt"),
        "prompt empty list": _with(base, prompt=[]),
        "prompt is a number": _with(base, prompt=5),
        "too many choices": _with(base, prompt=["a"] * 33, n=2),
        "token id out of range": _with(base, prompt=[10**6]),
        "logprobs 6": _with(base, logprobs=6),
        "prompt list with an empty prompt": _with(base, prompt=["a", ""]),
        "suffix": _with(base, suffix="end"),
        "best_of above n": _with(base, best_of=3),
        "max_tokens negative": _with(base, max_tokens=-1),
    }
    return [BadRequest(f"completions: {name}", p, body=body) for name, body in bodies.items()] + [
        BadRequest("completions: unknown model", p, _with(base, model="davinci"), status=404, error_type=NOT_FOUND)]


def _responses_cases() -> list[BadRequest]:
    p = "/v1/responses"
    base = {"model": "tiny", "input": "hi", "max_output_tokens": 4}
    bodies = {
        "input missing": _without(base, "input"),
        "input empty list": _with(base, input=[]),
        "input is a number": _with(base, input=5),
        "message without role": _with(base, input=[{"type": "message", "content": "hi"}]),
        "role tool": _with(base, input=[{"role": "tool", "content": "hi"}]),
        "input_image": _with(base, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
        "function_call without call_id": _with(base, input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
        "conversation": _with(base, conversation="conv_1"),
        "prompt template": _with(base, prompt={"id": "pmpt_1"}),
        "custom tool with a grammar that does not compile": _with(base, tools=[{
            "type": "custom", "name": "f", "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}]),
        "tool_choice forces a hosted tool": _with(base, tools=[{"type": "web_search"}],
                                                  tool_choice={"type": "web_search_preview"}),
        "function_call_output with an unknown part": _with(base, input=[{"type": "function_call_output", "call_id": "c",
                                                                          "output": [{"type": "nope"}]}]),
        "namespace without tools": _with(base, tools=[{"type": "namespace", "name": "ns", "description": "",
                                                       "tools": []}]),
        "repeated tool names": _with(base, tools=[{"type": "function", "name": "f"}, {"type": "custom", "name": "f"}]),
        "background": _with(base, background=True),
        "max_output_tokens 0": _with(base, max_output_tokens=0),
        "max_output_tokens over the context": _with(base, max_output_tokens=5000),
        "temperature 2.5": _with(base, temperature=2.5),
        "tool without name": _with(base, tools=[{"type": "function", "parameters": {"type": "object"}}]),
        "tool_choice names an unknown tool": _with(base, tools=[{"type": "function", "name": "f"}],
                                                   tool_choice={"type": "function", "name": "g"}),
        "json_schema format without schema": _with(base, text={"format": {"type": "json_schema", "name": "x"}}),
        "json_schema not enforceable": _with(base, text={"format": {"type": "json_schema", "name": "x", "schema": {
            "type": "object", "propertyNames": {"pattern": "a"}}}}),
    }
    return [BadRequest(f"responses: {name}", p, body=body) for name, body in bodies.items()] + [
        BadRequest("responses: unknown model", p, _with(base, model="gpt-9"), status=404, error_type=NOT_FOUND),
        BadRequest("responses: unknown previous_response_id", p, _with(base, previous_response_id="resp_1"), status=404,
                   error_type=NOT_FOUND, message_has=("resp_1",)),
        BadRequest("responses: item_reference to no stored item", p, _with(base, input=[{"type": "item_reference",
                                                                                         "id": "msg_1"}]),
                   status=404, error_type=NOT_FOUND, message_has=("msg_1",)),
        BadRequest("responses: retrieve an unknown response", p + "/resp_nope", method="GET", status=404,
                   error_type=NOT_FOUND),
        BadRequest("responses: delete an unknown response", p + "/resp_nope", method="DELETE", status=404,
                   error_type=NOT_FOUND),
        BadRequest("responses: malformed json", p, raw=b"{", headers=JSON_HEADERS)]


def _batch_cases() -> list[BadRequest]:
    p = "/v1/messages/batches"
    one = {"custom_id": "a", "params": MESSAGE}
    bodies = {
        "requests missing": {},
        "requests empty": {"requests": []},
        "requests is an object": {"requests": one},
        "custom_id missing": {"requests": [{"params": MESSAGE}]},
        "custom_id too long": {"requests": [{"custom_id": "x" * 65, "params": MESSAGE}]},
        "custom_id with a slash": {"requests": [{"custom_id": "a/b", "params": MESSAGE}]},
        "custom_id repeated": {"requests": [one, one]},
        "params is a string": {"requests": [{"custom_id": "a", "params": "hi"}]},
        "unknown field": {"requests": [one], "priority": 1},
    }
    return [BadRequest(f"batches: {name}", p, body=body) for name, body in bodies.items()] + [
        BadRequest("batches: unknown batch", p + "/msgbatch_nope", method="GET", status=404, error_type=NOT_FOUND),
        BadRequest("batches: cancel an unknown batch", p + "/msgbatch_nope/cancel", body={}, status=404,
                   error_type=NOT_FOUND),
        BadRequest("batches: list limit 0", p + "?limit=0", method="GET"),
        BadRequest("batches: a forged internal header", "/v1/messages", MESSAGE, status=401, error_type=AUTH,
                   server="guarded", headers={"x-stratum-internal": "guess", "x-stratum-batch-tenant": "key:x"}),
    ]


def _route_cases() -> list[BadRequest]:
    return [
        BadRequest("route: unknown GET", "/v2/everything", method="GET", status=404, error_type=NOT_FOUND),
        BadRequest("route: unknown POST", "/v1/complete", body={"prompt": "hi"}, status=404, error_type=NOT_FOUND),
        BadRequest("route: unknown model id", "/v1/models/nope", method="GET", status=404, error_type=NOT_FOUND),
        BadRequest("route: GET on messages", "/v1/messages", method="GET", status=405),
        BadRequest("route: DELETE on models", "/v1/models", method="DELETE", status=405),
    ]


def _guarded_cases() -> list[BadRequest]:
    p = "/v1/messages"
    big = _content("x" * (MAX_BODY_BYTES + 100))
    auth = [
        BadRequest("auth: no key", p, MESSAGE),
        BadRequest("auth: wrong x-api-key", p, MESSAGE, headers={"x-api-key": "sk-wrong"}),
        BadRequest("auth: key in the wrong case", p, MESSAGE, headers={"x-api-key": GUARDED_KEY.upper()}),
        BadRequest("auth: empty x-api-key", p, MESSAGE, headers={"x-api-key": ""}),
        BadRequest("auth: wrong bearer", p, MESSAGE, headers={"authorization": "Bearer sk-wrong"}),
        BadRequest("auth: bearer without a key", p, MESSAGE, headers={"authorization": "Bearer"}),
        BadRequest("auth: basic scheme", p, MESSAGE, headers={"authorization": "Basic " + GUARDED_KEY}),
        BadRequest("auth: key with a suffix", p, MESSAGE, headers={"x-api-key": GUARDED_KEY + "x"}),
        BadRequest("auth: no key on chat", "/v1/chat/completions", CHAT),
        BadRequest("auth: wrong bearer on chat", "/v1/chat/completions", CHAT,
                   headers={"authorization": "Bearer sk-wrong"}),
        BadRequest("auth: no key on count_tokens", "/v1/messages/count_tokens", COUNT),
        BadRequest("auth: no key on models", "/v1/models", method="GET"),
        BadRequest("auth: no key on a model", "/v1/models/tiny", method="GET"),
        BadRequest("auth: no key, bad json", p, raw=b"{oops", headers=JSON_HEADERS),
    ]
    auth = [replace(c, status=401, error_type=AUTH, server="guarded") for c in auth]
    size = [
        BadRequest("size: body over the limit", p, big, headers=KEYED),
        BadRequest("size: chunked body over the limit", p, big, headers=KEYED, is_chunked=True),
        BadRequest("size: chat body over the limit", "/v1/chat/completions",
                   _with(CHAT, messages=[{"role": "user", "content": "y" * (MAX_BODY_BYTES + 1)}]), headers=KEYED),
        BadRequest("size: chunked count_tokens over the limit", "/v1/messages/count_tokens",
                   _with(COUNT, messages=[{"role": "user", "content": "z" * MAX_BODY_BYTES}]), headers=KEYED,
                   is_chunked=True),
        BadRequest("size: junk over the limit", p, raw=b"\x00" * (MAX_BODY_BYTES * 4), headers=KEYED),
    ]
    size = [replace(c, status=413, error_type=TOO_LARGE, server="guarded") for c in size]
    keyed_but_bad = [
        BadRequest("guarded: right key, bad temperature", p, _with(MESSAGE, temperature=3), headers=KEYED,
                   server="guarded"),
        BadRequest("guarded: right bearer, unknown model", p, _with(MESSAGE, model="nope"),
                   headers={"authorization": "Bearer " + GUARDED_KEY}, status=404, error_type=NOT_FOUND,
                   server="guarded"),
    ]
    return auth + size + keyed_but_bad


# Every route that reads text from a JSON body, with a body that is valid for it.
TEXT_ROUTES = {"/v1/messages": MESSAGE, "/v1/messages/count_tokens": COUNT, "/v1/chat/completions": CHAT,
               "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4},
               "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 4},
               "/v1/responses/input_tokens": {"model": "tiny", "input": "hi"},
               "/v1/messages/batches": {"requests": [{"custom_id": "a", "params": MESSAGE}]}}
HUGE = 2**64  # past msgpack's integers, the engine process's frames


def _bounds_cases() -> list[BadRequest]:
    """Every number a request carries is bounded where it is parsed (400 naming the field), and a body
    that is not strict UTF-8 (an encoded surrogate, an overlong form) is a 400 on every text route."""
    completion = TEXT_ROUTES["/v1/completions"]
    response = TEXT_ROUTES["/v1/responses"]
    fields = {
        "/v1/messages": [("top_k", MESSAGE, HUGE), ("max_tokens", MESSAGE, HUGE), ("seed", MESSAGE, 2**63),
                         ("budget_tokens", _with(MESSAGE, max_tokens=2048), None)],
        "/v1/chat/completions": [("top_k", CHAT, HUGE), ("max_tokens", CHAT, HUGE),
                                 ("max_completion_tokens", CHAT, HUGE), ("seed", CHAT, 2**63), ("n", CHAT, HUGE),
                                 ("frequency_penalty", CHAT, 2.5),
                                 ("presence_penalty", CHAT, -2.5), ("top_logprobs", _with(CHAT, logprobs=True), HUGE),
                                 ("temperature", CHAT, 1e308)],
        "/v1/completions": [("top_k", completion, HUGE), ("max_tokens", completion, HUGE),
                            ("seed", completion, -(2**63) - 1), ("n", completion, 0), ("logprobs", completion, HUGE),
                            ("best_of", completion, HUGE), ("frequency_penalty", completion, 3)],
        "/v1/responses": [("max_output_tokens", response, HUGE), ("seed", response, HUGE)],
    }
    cases = []
    for path, items in fields.items():
        for name, base, value in items:
            body = (_with(base, thinking={"type": "enabled", "budget_tokens": HUGE}) if name == "budget_tokens"
                    else _with(base, **{name: value}))
            cases.append(BadRequest(f"bounds: {path} {name} {value if value is not None else HUGE}", path, body=body,
                                    message_has=(name,)))
    cases += [
        BadRequest("bounds: messages streamed top_k 2**64", "/v1/messages", _with(MESSAGE, stream=True, top_k=HUGE),
                   message_has=("top_k",)),
        BadRequest("bounds: chat stop of five", "/v1/chat/completions", _with(CHAT, stop=["a", "b", "c", "d", "e"]),
                   message_has=("stop", "4")),
        BadRequest("bounds: completions stop of 100000", "/v1/completions",
                   _with(completion, stop=[str(i) for i in range(100_000)]), message_has=("stop",)),
        BadRequest("bounds: chat logit_bias value 101", "/v1/chat/completions", _with(CHAT, logit_bias={"5": 101}),
                   message_has=("logit_bias",)),
        BadRequest("bounds: chat logit_bias key a word", "/v1/chat/completions", _with(CHAT, logit_bias={"hi": 1}),
                   message_has=("logit_bias",)),
        BadRequest("bounds: messages temperature Infinity", "/v1/messages", headers=JSON_HEADERS,
                   raw=b'{"model": "tiny", "max_tokens": 8, "temperature": Infinity, '
                       b'"messages": [{"role": "user", "content": "hi"}]}', message_has=("Infinity",)),
    ]
    for path, body in TEXT_ROUTES.items():
        text = json.dumps(body).encode()
        for what, bad in (("encoded surrogate", b"\xed\xa0\x80"), ("overlong slash", b"\xc0\xaf")):
            raw = text.replace(b'"hi"', b'"h' + bad.decode("unicode_escape").encode("latin-1") + b'i"', 1)
            assert raw != text
            cases.append(BadRequest(f"utf-8: {path} {what}", path, raw=raw, headers=JSON_HEADERS,
                                    message_has=("UTF-8",)))
    return cases


CORPUS: list[BadRequest] = (_messages_cases() + _count_tokens_cases() + _chat_cases() + _completions_cases()
                             + _responses_cases() + _batch_cases() + _route_cases() + _guarded_cases()
                             + _bounds_cases())
assert len({c.name for c in CORPUS}) == len(CORPUS), "case names must be unique"
