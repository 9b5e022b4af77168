"""Turning API requests into chat messages and prompt token ids through the model's chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stratum.models.chat_template import ChatTemplate, ChatTemplateError
from stratum.server import structured
from stratum.server import tools as tool_fmt
from stratum.server.errors import InvalidRequest
from stratum.server.protocol import ChatCompletionRequest, CountTokensRequest, MessagesRequest


@dataclass
class ChatInput:
    """A request in template terms."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    forced_tool: bool | str = False  # False, True (any tool), or a tool name
    system_text: str = ""
    pinned: dict[int, str | None] = field(default_factory=dict)  # message index -> cache_control ttl
    output_schema: dict[str, Any] | None = None  # structured outputs: the answer is JSON matching it

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


@dataclass
class Prompt:
    token_ids: list[int]
    prefill: str = ""  # assistant text the output continues (part of the answer only if it is a forced tool call)
    tool_names: set[str] = field(default_factory=set)
    is_forced_tool: bool = False
    template_tools: list[dict] | None = None
    forced_name: str | None = None  # the tool a forced call must name, when the request (or a lone tool) fixes it
    grammar: str | None = None  # what the answer must follow (`structured`), for the engine's sampler


def _block_text(block) -> str:
    if block.type in ("thinking", "redacted_thinking"):  # a recorded model's reasoning is not part of the prompt
        return ""
    if block.type == "text":
        return block.text
    if block.type == "tool_use":
        return tool_fmt.OPEN + "\n" + json.dumps({"name": block.name, "arguments": block.input}, ensure_ascii=False) + "\n" + tool_fmt.CLOSE
    content = block.content if isinstance(block.content, str) else "\n".join(b.text for b in block.content)
    return "<tool_response>\n" + content + "\n</tool_response>"


def anthropic_input(req: MessagesRequest | CountTokensRequest) -> ChatInput:
    """Anthropic body -> chat messages. Consecutive turns of one role are merged, as the Messages API does."""
    messages: list[dict[str, Any]] = []
    pinned: dict[int, str | None] = {}
    system = req.system
    if isinstance(system, list):
        system_text = "\n".join(b.text for b in system)
        marks = [b.cache_control for b in system if b.cache_control]
    else:
        system_text, marks = system or "", []
    if system_text:
        messages.append({"role": "system", "content": system_text})
        if marks:
            pinned[0] = marks[-1].ttl
    choice = req.tool_choice
    tools = None
    if req.tools and not (choice and choice.type == "none"):
        tools = [{"name": t.name, "description": t.description or "", "parameters": t.input_schema, "strict": bool(t.strict)}
                 for t in req.tools]
    if choice and choice.type == "tool" and choice.name not in {t.name for t in req.tools or []}:
        raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not in tools")
    if choice and choice.type in ("any", "tool") and not req.tools:
        raise InvalidRequest(f"tool_choice {choice.type!r} requires tools")
    forced: bool | str = False
    if choice is not None and choice.type == "any":
        forced = True
    elif choice is not None and choice.type == "tool":
        forced = choice.name
    for m in req.messages:
        blocks = [] if isinstance(m.content, str) else m.content
        text = m.content if isinstance(m.content, str) else "\n".join(t for t in map(_block_text, blocks) if t)
        if messages and messages[-1]["role"] == m.role:
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": m.role, "content": text})
        marks = [b.cache_control for b in blocks if getattr(b, "cache_control", None)]
        if marks:
            pinned[len(messages) - 1] = marks[-1].ttl
    schema = req.output_schema if isinstance(req, MessagesRequest) else None
    return ChatInput(messages, tools, forced, system_text, pinned, output_schema=schema)


def openai_input(req: ChatCompletionRequest) -> ChatInput:
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        if role == "tool":
            role, text = "user", "<tool_response>\n" + text + "\n</tool_response>"
        for call in m.tool_calls or []:
            text += tool_fmt.OPEN + "\n" + json.dumps({"name": call.function.name, "arguments": _args(call.function.arguments)}) + "\n" + tool_fmt.CLOSE
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": role, "content": text})
    choice = req.tool_choice
    tools = None
    if req.tools and choice != "none":
        tools = [{"name": t.function.name, "description": t.function.description or "", "parameters": t.function.parameters,
                  "strict": bool(t.function.strict)} for t in req.tools]
    forced: bool | str = False
    if choice == "required":
        forced = True
    elif choice is not None and not isinstance(choice, str):  # {"type": "function", "function": {"name": ...}}
        forced = choice.function.name
        if forced not in {t["name"] for t in tools or []}:
            raise InvalidRequest(f"tool_choice names {forced!r}, which is not in tools")
    if forced is not False and not tools:
        raise InvalidRequest("tool_choice requires tools")
    system_text = "\n".join(m["content"] for m in messages if m["role"] == "system")
    schema = req.response_format.schema if req.response_format else None
    return ChatInput(messages, tools, forced, system_text, output_schema=schema)


def _args(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def build_prompt(template: ChatTemplate, chat: ChatInput) -> Prompt:
    """Render messages (+ tools) and tokenize; a final assistant turn becomes a prefill.

    Raises:
        InvalidRequest: the template cannot render these messages.
    """
    messages = [dict(m) for m in chat.messages]
    tools, forced_tool = chat.tools, chat.forced_tool
    if chat.output_schema is not None:
        _add_system(messages, "Answer with JSON that matches this JSON schema:\n" + json.dumps(chat.output_schema, ensure_ascii=False))
    if tools and "tools" not in template.source:
        _add_system(messages, tool_fmt.tools_system_prompt(tools))
        template_tools = None
    else:
        template_tools = [{"type": "function", "function": t} for t in tools] if tools else None
    if forced_tool is True and tools and len(tools) == 1:
        forced_tool = tools[0]["name"]  # "any" with one tool is that tool
    prefill = ""
    if forced_tool is not False:
        prefill = tool_fmt.forced_prefix(forced_tool if isinstance(forced_tool, str) else None)
        if messages[-1]["role"] == "assistant":
            messages[-1]["content"] += prefill
        else:
            messages.append({"role": "assistant", "content": prefill})
    elif messages[-1]["role"] == "assistant":
        prefill = messages[-1]["content"]
    is_continuation = messages[-1]["role"] == "assistant"
    try:
        ids = template.encode(messages, tools=template_tools, continue_final=is_continuation)
    except ChatTemplateError as e:
        raise InvalidRequest(str(e)) from None
    prompt = Prompt(ids, prefill, {t["name"] for t in tools or []}, forced_tool is not False, template_tools,
                    forced_tool if isinstance(forced_tool, str) else None)
    prompt.grammar = structured.answer_grammar(chat, prompt)
    return prompt


def _add_system(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = messages[0]["content"] + "\n\n" + text
    else:
        messages.insert(0, {"role": "system", "content": text})
