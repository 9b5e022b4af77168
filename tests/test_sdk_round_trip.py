"""What the official SDKs give back is accepted when sent back: every content block and output item type
their own response types define, built with a value in every field and dumped with `model_dump()`, is
accepted in a later request (issue 31).

The types are not listed here: they are found by walking the SDKs' unions (`anthropic.types.ContentBlock`,
its beta twin, `openai.types.responses.ResponseOutputItem` and `ResponseInputItem`, and chat completions'
message), so a block or item an SDK release adds is tested by this file unchanged, and fails it until the
server takes it.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import anthropic
import openai
import pytest
from pydantic import BaseModel

SCHEMA = {"type": "object", "properties": {}}
_SCHEMA_FIELDS = ("parameters", "input_schema", "schema", "output_schema")  # a JSON schema, not any object


def members(union: Any) -> list[type]:
    """The classes of a (possibly annotated, possibly nested) union."""
    origin = get_origin(union)
    if origin is typing.Annotated:
        return members(get_args(union)[0])
    if origin in (Union, types.UnionType):
        return [m for arg in get_args(union) for m in members(arg)]
    return [union]


def sample(tp: Any, depth: int = 0, field: str = "") -> Any:
    """A value of type `tp`: every optional field filled, the first member of a union, one list entry."""
    origin, args = get_origin(tp), get_args(tp)
    if field in _SCHEMA_FIELDS:
        return dict(SCHEMA)
    if origin is typing.Annotated:
        return sample(args[0], depth, field)
    if origin is Literal:
        return args[0]
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return sample(options[0], depth, field) if options else None
    if origin in (list, typing.List, tuple, set) or tp in (list,):
        return [sample(args[0], depth + 1, field)] if args and depth < 6 else []
    if origin in (dict, typing.Dict) or tp in (dict, object, Any):
        return {"key": "value"}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return built(tp, depth + 1)
    return {str: "text", int: 1, float: 1.0, bool: True, type(None): None}.get(tp, "text")


def built(cls: type[BaseModel], depth: int = 0) -> BaseModel:
    """An instance of an SDK model with every field set, validated as the SDK validates a response."""
    data = {(info.alias or name): sample(info.annotation, depth, name) for name, info in cls.model_fields.items()}
    return cls.model_validate(data)


def dumps(union: Any) -> list[tuple[str, dict[str, Any]]]:
    """(type tag, model_dump()) of one instance of every member of `union`, and of its exclude_none dump."""
    out = []
    for cls in members(union):
        block = built(cls)
        out += [(f"{cls.__name__}", block.model_dump()), (f"{cls.__name__}-exclude_none", block.model_dump(exclude_none=True))]
    return out


ANTHROPIC_BLOCKS = dumps(anthropic.types.ContentBlock) + dumps(anthropic.types.beta.BetaContentBlock)
OPENAI_ITEMS = dumps(openai.types.responses.ResponseOutputItem) + dumps(openai.types.responses.ResponseInputItem)


@pytest.fixture(scope="module")
def client(tiny_server):
    return anthropic.Anthropic(base_url=tiny_server.url, api_key="test", max_retries=0)


@pytest.fixture(scope="module")
def oai(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="test", max_retries=0)


def test_the_sdks_define_what_is_walked():
    """The walk finds the SDKs' types (a change in how they declare their unions would find none)."""
    assert len({name for name, _ in ANTHROPIC_BLOCKS}) >= 2 * 16
    assert len({name for name, _ in OPENAI_ITEMS}) >= 2 * 25
    assert {"tool_use", "thinking", "server_tool_use"} <= {dump["type"] for _, dump in ANTHROPIC_BLOCKS}
    assert {"function_call", "custom_tool_call", "reasoning", "message"} <= {dump["type"] for _, dump in OPENAI_ITEMS}


@pytest.mark.parametrize("block", [b for _, b in ANTHROPIC_BLOCKS], ids=[n for n, _ in ANTHROPIC_BLOCKS])
def test_anthropic_block_is_accepted_back(client, block):
    """An assistant turn holding the block, as `[b.model_dump() for b in message.content]` sends it (in
    a conversation that declares the tool its sample values name, as the one it came from did)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [block]},
                {"role": "user", "content": "Go on"}]
    tools = [{"name": "text", "description": "A tool.", "input_schema": SCHEMA}]
    assert client.beta.messages.count_tokens(model="tiny", messages=messages, tools=tools).input_tokens > 0


def test_a_message_is_sent_back_whole(client):
    """An answer's content, dumped block by block, is the next turn's assistant content."""
    msg = client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    content = [b.model_dump() for b in msg.content] or [{"type": "text", "text": "-"}]
    again = client.messages.create(model="tiny", max_tokens=1, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}, {"role": "user", "content": "Go on"}])
    assert prompt_of(again.usage) > prompt_of(msg.usage)


def prompt_of(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


@pytest.fixture(scope="module")
def stored_item(oai) -> str:
    """The id of an item of a stored response, for item references."""
    return oai.responses.create(model="tiny", input="Hi", max_output_tokens=1).output[0].id


@pytest.mark.parametrize("item", [i for _, i in OPENAI_ITEMS], ids=[n for n, _ in OPENAI_ITEMS])
def test_openai_item_is_accepted_back(oai, stored_item, item):
    """The item as input after a user message (an item reference names a stored item, as it must)."""
    if item.get("type") == "item_reference" or (item.get("type") is None and set(item) <= {"id", "type"}):
        item = {**item, "id": stored_item}
    r = oai.responses.create(model="tiny", input=[{"role": "user", "content": "Hi"}, item], max_output_tokens=1, store=False)
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 0


def test_a_response_is_sent_back_whole(oai):
    """A response's output, item by item as `model_dump()` writes it, is the next request's input."""
    r = oai.responses.create(model="tiny", input="Hi", max_output_tokens=3, store=False)
    follow = [{"role": "user", "content": "Hi"}, *(o.model_dump() for o in r.output), {"role": "user", "content": "Go on"}]
    again = oai.responses.create(model="tiny", input=follow, max_output_tokens=1, store=False)
    assert again.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize("name, tool_call", [(n, c) for n, c in dumps(
    openai.types.chat.ChatCompletionMessageToolCallUnion)])
def test_chat_completion_message_is_accepted_back(oai, name, tool_call):
    """An assistant message as the SDK's `ChatCompletionMessage.model_dump()` writes it (every field set,
    its tool call of each type), then the tool's result."""
    message = built(openai.types.chat.ChatCompletionMessage).model_dump()
    message["tool_calls"] = [tool_call]
    r = oai.chat.completions.create(model="tiny", max_tokens=1, messages=[
        {"role": "user", "content": "Hi"}, message, {"role": "tool", "tool_call_id": tool_call["id"], "content": "ok"}])
    assert r.usage.prompt_tokens > 0
