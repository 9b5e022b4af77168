"""What the official SDKs give back is accepted when sent back: every content block and output item type
their own response types define, built with a value in every field and dumped with `model_dump()`, is
accepted in a later request.

The types are not listed here: they are found by walking the SDKs' unions (`anthropic.types.ContentBlock`,
its beta twin, `openai.types.responses.ResponseOutputItem` and `ResponseInputItem`, and chat completions'
message), so a block or item an SDK release adds is tested by this file unchanged, and fails it until the
server takes it. Each type is built as often as its nested unions need for every member of each to be in
one instance (a message's content parts, a call output's str or parts, a compaction's tool changes); the
one refusal is by design: image and file parts (this model reads text only).
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
CONTEXT = 2048  # the tiny model's
_SCHEMA_FIELDS = ("parameters", "input_schema", "schema", "output_schema")  # a JSON schema, not any object


def members(union: Any) -> list[type]:
    """The classes of a (possibly annotated, possibly nested) union."""
    origin = get_origin(union)
    if origin is typing.Annotated:
        return members(get_args(union)[0])
    if origin in (Union, types.UnionType):
        return [m for arg in get_args(union) for m in members(arg)]
    return [union]


class Walk:
    """One walk of an SDK type's tree. Each union of objects or lists it meets takes its next member not
    yet taken, and a list gets entries until the unions met inside them have had every member, so walking
    a type again until `exhausted` puts every member of every such union it reaches in some instance."""

    def __init__(self, taken: dict[Any, int], width: dict[Any, int]):
        self.taken = taken  # per union met by any walk of the type: how many of its members were taken
        self.width = width  # and how many it has
        self.met: list[Any] = []  # the unions this walk met, in order
        self.names = 0  # names given: unique, as a list of tools needs them

    def pick(self, key: Any, options: tuple, counted: bool = True) -> Any:
        if counted:
            self.width[key] = len(options)
            self.met.append(key)
        index = self.taken.get(key, 0)
        self.taken[key] = index + 1
        return options[index % len(options)]

    @property
    def exhausted(self) -> bool:
        return all(self.taken.get(key, 0) >= width for key, width in self.width.items())

    def sample(self, tp: Any, depth: int = 0, field: str = "") -> Any:
        """A value of type `tp`: every optional field filled, one list entry."""
        origin, args = get_origin(tp), get_args(tp)
        if field in _SCHEMA_FIELDS:
            return dict(SCHEMA)
        if field == "definition" and tp is str:  # a custom tool's grammar (Lark, or a regex): one that compiles
            return 'start: "text"'
        if origin is typing.Annotated:
            return self.sample(args[0], depth, field)
        if origin is Literal:  # a kind's names (`type`, `role`) taken in turn; other enumerations by their first
            return self.pick((field, tp), args, counted=False) if field in ("type", "role") else args[0]
        if origin in (Union, types.UnionType):
            options = tuple(a for a in args if a is not type(None))
            if len(options) > 1 and not any(_structured(a) for a in options):
                return self.sample(options[0], depth, field)  # scalars alone (str | Literal[...]): one will do
            return self.sample(self.pick(tp, options), depth, field) if options else None
        if origin in (list, typing.List, tuple, set) or tp in (list,):
            return self.entries(args[0], depth, field) if args and depth < 6 else []
        if origin in (dict, typing.Dict) and len(args) == 2:
            return {"key": self.sample(args[1], depth + 1, field)}
        if origin in (dict, typing.Dict) or tp in (dict, object, Any):
            return {"key": "value"}
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return self.built(tp, depth + 1)
        if tp is str and field == "name":
            self.names += 1
            return "text" if self.names == 1 else f"text_{self.names}"
        return {str: "text", int: 1, float: 1.0, bool: True, type(None): None}.get(tp, "text")

    def entries(self, tp: Any, depth: int, field: str, most: int = 40) -> list[Any]:
        start, out = len(self.met), []
        while len(out) < most:
            out.append(self.sample(tp, depth + 1, field))
            if all(self.taken[key] >= self.width[key] for key in self.met[start:]):
                return out
        return out

    def built(self, cls: type[BaseModel], depth: int = 0) -> BaseModel:
        """An instance of an SDK model with every field set, validated as the SDK validates a response."""
        data = {(info.alias or name): self.sample(info.annotation, depth, name)
                for name, info in cls.model_fields.items()}
        return cls.model_validate(data)


def _structured(tp: Any) -> bool:
    """Whether a union member is an object or a list (what the server reads apart), not a scalar."""
    tp = get_args(tp)[0] if get_origin(tp) is typing.Annotated else tp
    return (get_origin(tp) in (list, typing.List, Union, types.UnionType)
            or (isinstance(tp, type) and issubclass(tp, BaseModel)))


def built(cls: type[BaseModel]) -> BaseModel:
    return Walk({}, {}).built(cls)


def instances(cls: type[BaseModel], most: int = 24) -> list[BaseModel]:
    """Instances of `cls` until every member of every union and Literal in its tree has been in one."""
    taken: dict[Any, int] = {}
    width: dict[Any, int] = {}
    out = []
    while len(out) < most:
        walk = Walk(taken, width)
        out.append(walk.built(cls))
        if walk.exhausted:
            return out
    raise AssertionError(f"{cls.__name__}: its unions need more than {most} instances")


def dumps(union: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, model_dump()) of instances of every member of `union` covering its unions' members, and of
    their exclude_none dumps; repeated dumps once."""
    out, seen = [], set()
    for cls in members(union):
        for i, block in enumerate(instances(cls)):
            for suffix, dump in (("", block.model_dump()), ("-exclude_none", block.model_dump(exclude_none=True))):
                key = repr(dump)
                if key not in seen:
                    seen.add(key)
                    out.append((f"{cls.__name__}-{i}{suffix}", dump))
    return out


ANTHROPIC_BLOCKS = dumps(anthropic.types.ContentBlock) + dumps(anthropic.types.beta.BetaContentBlock)
OPENAI_ITEMS = dumps(openai.types.responses.ResponseOutputItem) + dumps(openai.types.responses.ResponseInputItem)


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
    tools = [{"name": name, "description": "A tool.", "input_schema": SCHEMA}
             for name in sorted(names_in(block) | {"text"})]
    assert client.beta.messages.count_tokens(model="tiny", messages=messages, tools=tools).input_tokens > 0


def test_a_message_is_sent_back_whole(client):
    """An answer's content, dumped block by block, is the next turn's assistant content."""
    msg = client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    content = [b.model_dump() for b in msg.content] or [{"type": "text", "text": "-"}]
    again = client.messages.create(model="tiny", max_tokens=1, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": content},
        {"role": "user", "content": "Go on"}])
    assert prompt_of(again.usage) > prompt_of(msg.usage)


def names_in(value: Any) -> set[str]:
    """The tool names a block's sample values use (`name` fields), for the request's tools to declare."""
    if isinstance(value, dict):
        own = {value["name"]} if isinstance(value.get("name"), str) else set()
        return own.union(*(names_in(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(names_in(v) for v in value))
    return set()


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
    hi = {"role": "user", "content": "Hi"}
    if media := media_in(item):  # the one refusal by design: this model reads text only (docs/api.md)
        with pytest.raises(openai.BadRequestError) as info:
            oai.responses.create(model="tiny", input=[hi, item], max_output_tokens=1, store=False)
        assert f"'{media}' are not supported: this model is text-only" in info.value.response.json()["error"]["message"]
        item = without_media(item)  # and its text parts are read
    counted = oai.responses.input_tokens.count(model="tiny", input=[hi, item]).input_tokens
    if counted < CONTEXT:  # (an item that adds many tools may not fit the tiny model: counted, it was read)
        r = oai.responses.create(model="tiny", input=[hi, item], max_output_tokens=1, store=False)
        assert r.status in ("completed", "incomplete") and r.usage.input_tokens == counted


MEDIA = ("input_image", "input_file")


def media_in(value: Any) -> str | None:
    """The type of the first image or file part in an item, if it holds one."""
    if isinstance(value, dict):
        if value.get("type") in MEDIA:
            return value["type"]
        value = list(value.values())
    if isinstance(value, list):
        return next((m for v in value if (m := media_in(v))), None)
    return None


def without_media(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_media(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_media(v) for v in value if not (isinstance(v, dict) and v.get("type") in MEDIA)]
    return value


def test_a_response_is_sent_back_whole(oai):
    """A response's output, item by item as `model_dump()` writes it, is the next request's input."""
    r = oai.responses.create(model="tiny", input="Hi", max_output_tokens=3, store=False)
    follow = [{"role": "user", "content": "Hi"}, *(o.model_dump() for o in r.output),
              {"role": "user", "content": "Go on"}]
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
