"""A Responses API request as chat turns: its conversation (a stored response it continues, item
references resolved, then its input items) and the tools it offers the model.

Items are read as the model's own turns: messages by role (developer as system), function and custom
tool calls as an assistant turn's `tool_calls`, their outputs as `tool` turns. Items of OpenAI-run
tools are history the model reads the same way: a call named by its type (`local_shell_call` is a
`local_shell` call, an `mcp_call` is `SERVER.NAME`), its arguments the item's own fields, and its
output (where it has one) a tool turn holding the output's JSON. Reasoning, compaction, listings and
approvals add nothing. A tool inside a namespace is offered to the model as `NAMESPACE.NAME`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from stratum.server.chat import ChatInput, append_turn, call_arguments, forced_function, tool_call, tool_result
from stratum.server.errors import InvalidRequest
from stratum.server.protocol.response_items import RespInputItem
from stratum.server.protocol.responses import ResponsesRequest
from stratum.server.reasoning import Thinking
from stratum.server.response_store import ResponseStore

_ITEMS = TypeAdapter(RespInputItem)

# An OpenAI-run tool's call item -> the tool's name as the model reads it.
_CALLS = {"file_search_call": "file_search", "computer_call": "computer", "web_search_call": "web_search",
          "tool_search_call": "tool_search", "image_generation_call": "image_generation",
          "code_interpreter_call": "code_interpreter", "local_shell_call": "local_shell", "shell_call": "shell",
          "apply_patch_call": "apply_patch", "mcp_call": "mcp", "program": "program"}
_OUTPUTS = ("computer_call_output", "tool_search_output", "local_shell_call_output", "shell_call_output",
            "apply_patch_call_output", "program_output")
_RESULT_FIELDS = ("results", "outputs", "output", "error")  # a call item's own result, when it carries one
_UNREAD_FIELDS = ("image_url", "file_id", "result", "encrypted_content", "created_by")  # binary, or not for the model


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool offered to the model: a function or a custom (freeform) tool, maybe in a namespace."""

    name: str
    namespace: str | None
    description: str
    parameters: dict[str, Any] | None = None  # a function's
    strict: bool = False
    format: dict[str, Any] | None = None  # a custom tool's: {"type": "text"} or its grammar

    @property
    def model_name(self) -> str:
        """The name the model sees and calls it by."""
        return f"{self.namespace}.{self.name}" if self.namespace else self.name

    @property
    def is_custom(self) -> bool:
        return self.format is not None

    def as_chat_tool(self) -> dict[str, Any]:
        tool = {"name": self.model_name, "description": self.description, "strict": self.strict}
        if self.is_custom:
            return {**tool, "format": self.format}
        return {**tool, "parameters": self.parameters or {"type": "object", "properties": {}}}


def qualified(namespace: str | None, name: str) -> str:
    return f"{namespace}.{name}" if namespace else name


def conversation(req: ResponsesRequest, store: ResponseStore, owner: str) -> tuple[list, list[dict[str, Any]]]:
    """The request's conversation as items: the stored conversation it continues, then its input with
    every item reference replaced by the item it names. Returns (the items, the input as stored: one
    dict per item, each with an id).

    Raises:
        NotFound: the previous response or a referenced item is not stored for this owner.
    """
    history = store.history(owner, req.previous_response_id) if req.previous_response_id else []
    items = [_ITEMS.validate_python(h) for h in history]
    kept: list[dict[str, Any]] = []
    for i, item in enumerate(req.items):
        if item.type == "item_reference":
            raw = store.item(owner, item.id)
            try:
                item = _ITEMS.validate_python(raw)
            except ValidationError as e:
                raise InvalidRequest(f"input.{i}: the item '{item.id}' it references cannot be read: "
                                     f"{e.errors()[0]['msg']}")
        else:
            raw = item.model_dump(by_alias=True, exclude_none=True)
        items.append(item)
        kept.append(raw if raw.get("id") else {**raw, "id": _new_item_id(item.type)})
    return items, kept


def _new_item_id(kind: str) -> str:
    from stratum.server.render import new_id

    return new_id({"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
                   "custom_tool_call": "ctc_", "custom_tool_call_output": "ctco_",
                   "reasoning": "rs_"}.get(kind, "item_"))


def offered_tools(req: ResponsesRequest, items: list) -> list[ToolSpec]:
    """Function and custom tools, top level or in a namespace, from `tools` and from the conversation's
    `additional_tools` items; OpenAI-run tools are not offered (`response_tools.HOSTED_TOOLS`)."""
    tools = [*(req.tools or []), *(t for item in items if item.type == "additional_tools" for t in item.tools)]
    specs = []
    for tool in tools:
        if tool.type == "namespace":
            specs += [_spec(t, tool.name) for t in tool.tools]
        elif tool.type in ("function", "custom"):
            specs.append(_spec(tool, None))
    return specs


def _spec(tool, namespace: str | None) -> ToolSpec:
    if tool.type == "custom":
        fmt = tool.format.model_dump() if tool.format is not None else {"type": "text"}
        return ToolSpec(tool.name, namespace, tool.description or "", format=fmt)
    return ToolSpec(tool.name, namespace, tool.description or "", tool.parameters, bool(tool.strict))


def choose_tools(req: ResponsesRequest, specs: list[ToolSpec]) -> tuple[list[ToolSpec], bool | str]:
    """What `tool_choice` offers and forces: (the tools offered, False / True (any) / the model name of
    the tool a call must name).

    Raises:
        InvalidRequest: it forces a tool this server does not offer (an OpenAI-run one), or names none of
            the request's tools.
    """
    choice = req.tool_choice
    if choice is None or choice in ("auto", "required"):
        return specs, forced_function(choice, None, [s.as_chat_tool() for s in specs])
    if choice == "none":
        return [], False
    if choice.type == "allowed_tools":
        allowed = [s for s in specs if any(_allows(entry, s) for entry in choice.tools)]
        return allowed, forced_function("required" if choice.mode == "required" else "auto", None,
                                        [s.as_chat_tool() for s in allowed])
    if choice.type in ("function", "custom"):
        kind = choice.type == "custom"
        named = [s for s in specs if s.is_custom == kind and choice.name in (s.name, s.model_name)]
        if len(named) != 1:
            why = ("which is not in tools" if not named
                   else "which names several namespaced tools; name it NAMESPACE.NAME")
            raise InvalidRequest(f"tool_choice names the {choice.type} tool {choice.name!r}, {why}")
        return specs, named[0].model_name
    what = f"{choice.type} ({choice.server_label})" if choice.server_label else choice.type
    raise InvalidRequest(f"tool_choice forces the tool {what!r}, which OpenAI runs: this server runs none of those, "
                         "so it accepts them in tools and does not offer them to the model")


def _allows(entry: dict[str, Any], spec: ToolSpec) -> bool:
    kind, name = entry.get("type"), entry.get("name")
    if kind == "namespace":
        return spec.namespace is not None and name == spec.namespace
    return kind == ("custom" if spec.is_custom else "function") and name in (spec.name, spec.model_name)


def responses_input(req: ResponsesRequest, items: list, offered: list[ToolSpec], forced: bool | str) -> ChatInput:
    """The conversation (`conversation`) as chat turns: `instructions` first as a system turn, then
    each item as the module docstring says."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        append_turn(messages, {"role": "system", "content": req.instructions})
    names: dict[str, str] = {}  # call id -> the tool's name as the model sees it
    for item in items:
        for turn in _turns(item, names):
            append_turn(messages, turn)
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest("input holds no message to answer")
    system_text = "\n".join(m["content"] for m in messages if m["role"] == "system")
    tools = [s.as_chat_tool() for s in offered] or None
    return ChatInput(messages, tools, forced if tools else False, system_text, output_schema=req.output_schema,
                     parallel_calls=req.parallel_tool_calls is not False,
                     thinking=Thinking.of_effort(req.reasoning.effort if req.reasoning else None))


@dataclass(frozen=True, slots=True)
class AsChat:
    """A Responses request as the model reads it: its chat input, the tools offered (to name calls back)
    and its input as it would be stored."""

    chat: ChatInput
    offered: list[ToolSpec]
    stored_input: list[dict[str, Any]]


def as_chat(req: ResponsesRequest, store: ResponseStore, owner: str) -> AsChat:
    """`conversation`, the tools it offers and chooses, and its chat turns: what both the generating
    route and /v1/responses/input_tokens read (one count for one prompt)."""
    items, stored_input = conversation(req, store, owner)
    offered, forced = choose_tools(req, offered_tools(req, items))
    return AsChat(responses_input(req, items, offered, forced), offered, stored_input)


def _turns(item, names: dict[str, str]) -> list[dict[str, Any]]:
    kind = item.type
    if kind == "message":
        return [{"role": "system" if item.role == "developer" else item.role, "content": item.text}]
    if kind in ("function_call", "custom_tool_call"):
        name = qualified(item.namespace, item.name)
        names[item.call_id] = name
        arguments = call_arguments(item.arguments) if kind == "function_call" else item.input
        return [{"role": "assistant", "content": "", "tool_calls": [tool_call(item.call_id, name, arguments)]}]
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
        turn = tool_result(item.call_id or "", output, names)
        if getattr(item, "name", None) and not turn["name"]:  # an output that answers no call names its tool
            turn["name"] = qualified(item.namespace, item.name)
        return [turn]
    if kind in _CALLS or kind in _OUTPUTS:
        return _recorded_turns(item, names)
    if kind == "reasoning" and item.text:  # the thought of the assistant turn it begins
        return [{"role": "assistant", "content": "", "reasoning_content": item.text}]
    return []  # additional_tools, and OpenAI's bookkeeping items


def _recorded_turns(item, names: dict[str, str]) -> list[dict[str, Any]]:
    """An OpenAI-run tool's call or output, as the module docstring says."""
    fields = {k: v for k, v in item.fields.items() if k not in _UNREAD_FIELDS and v is not None}
    call_id = item.call_id or item.id or ""
    if item.type in _OUTPUTS:
        output = fields.get("output", fields.get("tools", fields.get("result", "")))
        return [tool_result(call_id, output if isinstance(output, str) else _json(output), names)]
    name = _CALLS[item.type]
    if item.type == "mcp_call":
        name = f"{fields.pop('server_label', 'mcp')}.{fields.pop('name', 'tool')}"
        fields["arguments"] = call_arguments(fields.get("arguments", "{}"))
    names[call_id] = name
    result = {k: fields.pop(k) for k in _RESULT_FIELDS if k in fields}
    turns = [{"role": "assistant", "content": "",
              "tool_calls": [tool_call(call_id, name, fields.get("arguments", fields))]}]
    if result:
        turns.append(tool_result(call_id, _json(result if len(result) > 1 else next(iter(result.values()))), names))
    return turns


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
