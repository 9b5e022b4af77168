"""Turning API requests into chat messages and prompt token ids through the model's chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stratum.models.chat_template import ChatTemplate, ChatTemplateError
from stratum.server import structured
from stratum.server import tools as tool_fmt
from stratum.server.errors import InvalidRequest
from stratum.server.protocol import (ChatCompletionRequest, CountTokensRequest, MessagesRequest, RespMessage,
                                     ResponsesRequest)


@dataclass
class ChatInput:
    """A request in template terms."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    forced_tool: bool | str = False  # False, True (any tool), or a tool name
    system_text: str = ""
    pinned: dict[int, str | None] = field(default_factory=dict)  # message index -> cache_control ttl
    output_schema: dict[str, Any] | None = None  # structured outputs: the answer is JSON matching it

    def fold_late_system(self) -> bool:
        """Folds each system turn after the first message into the user turn before it (or makes it a
        user turn where none is), for templates that take a system turn only first (Gemma's,
        Mistral's); a cache_control mark moves with its text. False when there is none to fold."""
        if not any(m["role"] == "system" for m in self.messages[1:]):
            return False
        folded, where = self.messages[:1], {0: 0}
        for i, m in enumerate(self.messages[1:], 1):
            if m["role"] != "system":
                folded.append(m)
            elif folded[-1]["role"] == "user":
                folded[-1] = {**folded[-1], "content": folded[-1]["content"] + "\n\n" + m["content"]}
            else:
                folded.append({"role": "user", "content": m["content"]})
            where[i] = len(folded) - 1
        self.messages = folded
        self.pinned = {where[i]: ttl for i, ttl in self.pinned.items()}
        return True

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
    tool_format: tool_fmt.ToolFormat = tool_fmt.HERMES  # how the model writes tool calls (its family's format)


def _tool_call_text(name: str, arguments: Any) -> str:
    return tool_fmt.OPEN + "\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n" + tool_fmt.CLOSE


def _tool_response_text(content: str) -> str:
    return "<tool_response>\n" + content + "\n</tool_response>"


def _block_text(block) -> str:
    """One content block as the model reads it. The rules (README, "Content blocks"): text as is;
    documents and search results as their title, context and text; tool calls and results (Anthropic's
    server tools' too) in the Hermes form the model is prompted with; thinking and container uploads
    add nothing."""
    kind = block.type
    if kind in ("thinking", "redacted_thinking", "container_upload"):  # a recorded model's reasoning is not prompt
        return ""
    if kind == "text":
        return block.text
    if kind == "document":
        source = block.source
        body = source.data if source.type == "text" else (
            source.content if isinstance(source.content, str) else "\n".join(b.text for b in source.content))
        return "\n".join(t for t in (block.title, block.context, body) if t)
    if kind == "search_result":
        return "\n".join([block.title, block.source, *(b.text for b in block.content)])
    if kind == "tool_reference":
        return f"Tool: {block.tool_name}"
    if kind in ("tool_use", "server_tool_use", "mcp_tool_use"):
        return _tool_call_text(block.name, block.input)
    if kind == "tool_result":
        content = block.content if isinstance(block.content, str) else "\n".join(map(_block_text, block.content))
        return _tool_response_text(content)
    # a server tool's result (web search, code execution...): its content as JSON
    return _tool_response_text(json.dumps(block.content, ensure_ascii=False))


def _append(messages: list[dict[str, Any]], role: str, text: str) -> None:
    """Add a turn; consecutive turns of one role are merged, as the Messages API does."""
    if messages and messages[-1]["role"] == role:
        messages[-1]["content"] += "\n" + text
    else:
        messages.append({"role": role, "content": text})


def _marks(blocks) -> list:
    return [b.cache_control for b in blocks if getattr(b, "cache_control", None)]


def anthropic_input(req: MessagesRequest | CountTokensRequest) -> ChatInput:
    """Anthropic body -> chat messages. Consecutive turns of one role are merged, as the Messages API
    does; a system message inside `messages` stays a system turn at its place in the conversation."""
    messages: list[dict[str, Any]] = []
    pinned: dict[int, str | None] = {}
    system = req.system
    if isinstance(system, list):
        system_text = "\n".join(b.text for b in system)
        marks = _marks(system)
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
    system_texts = [system_text] if system_text else []
    for m in req.messages:
        blocks = [] if isinstance(m.content, str) else m.content
        text = m.content if isinstance(m.content, str) else "\n".join(t for t in map(_block_text, blocks) if t)
        if m.role == "system":
            system_texts.append(text)
        _append(messages, m.role, text)
        marks = _marks(blocks) + ([m.cache_control] if m.cache_control else [])
        if marks:
            pinned[len(messages) - 1] = marks[-1].ttl
    if req.cache_control is not None:  # automatic caching: a breakpoint after the last message
        pinned[len(messages) - 1] = req.cache_control.ttl
    return ChatInput(messages, tools, forced, "\n".join(system_texts), pinned, output_schema=req.output_schema)


def openai_input(req: ChatCompletionRequest) -> ChatInput:
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        if role == "tool":
            role, text = "user", _tool_response_text(text)
        for call in m.tool_calls or []:
            text += _tool_call_text(call.function.name, _args(call.function.arguments))
        _append(messages, role, text)
    choice = req.tool_choice
    tools = None
    if req.tools and choice != "none":
        tools = [{"name": t.function.name, "description": t.function.description or "", "parameters": t.function.parameters,
                  "strict": bool(t.function.strict)} for t in req.tools]
    named = choice.function.name if choice is not None and not isinstance(choice, str) else None
    forced = _forced_function(choice, named, tools)
    system_text = "\n".join(m["content"] for m in messages if m["role"] == "system")
    schema = req.response_format.schema if req.response_format else None
    return ChatInput(messages, tools, forced, system_text, output_schema=schema)


def responses_input(req: ResponsesRequest) -> ChatInput:
    """A Responses API request as chat messages: `instructions` first as a system message, developer
    messages as system ones, function calls and their outputs in the Hermes form, as chat completions'
    tool calls are."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        _append(messages, "system", req.instructions)
    items = [RespMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if item.type == "message":
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            _append(messages, "system" if item.role == "developer" else item.role, text)
        elif item.type == "function_call":
            _append(messages, "assistant", _tool_call_text(item.name, _args(item.arguments)))
        elif item.type == "function_call_output":
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            _append(messages, "user", _tool_response_text(output))
    choice = req.tool_choice
    tools = None
    if req.tools and choice != "none":
        tools = [{"name": t.name, "description": t.description or "",
                  "parameters": t.parameters or {"type": "object", "properties": {}}, "strict": bool(t.strict)}
                 for t in req.tools]
    forced = _forced_function(choice, choice.name if choice is not None and not isinstance(choice, str) else None, tools)
    if not messages:
        raise InvalidRequest("input holds no message to answer")
    system_text = "\n".join(m["content"] for m in messages if m["role"] == "system")
    return ChatInput(messages, tools, forced, system_text, output_schema=req.output_schema)


def _forced_function(choice, named: str | None, tools: list[dict[str, Any]] | None) -> bool | str:
    """OpenAI's tool_choice ("required", or a named function) as `ChatInput.forced_tool`."""
    forced: bool | str = True if choice == "required" else named if named is not None else False
    if isinstance(forced, str) and forced not in {t["name"] for t in tools or []}:
        raise InvalidRequest(f"tool_choice names {forced!r}, which is not in tools")
    if forced is not False and not tools:
        raise InvalidRequest("tool_choice requires tools")
    return forced


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
        template_tools, fmt = None, tool_fmt.HERMES
    else:  # as transformers' apply_chat_template passes them: OpenAI's function tools
        template_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                             if t.get(k)}} for t in tools] if tools else None
        fmt = tool_fmt.format_for(template.source).for_vocabulary(template.tokenizer)
    if forced_tool is True and tools and len(tools) == 1:
        forced_tool = tools[0]["name"]  # "any" with one tool is that tool
    # a forced call's opening is the server's text, written after the template's generation prompt (or
    # after an assistant prefill) with its special tokens read, as the model itself would write it
    forced_prefix = fmt.forced_prefix(forced_tool if isinstance(forced_tool, str) else None) if forced_tool is not False else ""
    is_continuation = messages[-1]["role"] == "assistant"
    prefill = forced_prefix or (messages[-1]["content"] if is_continuation else "")
    try:
        ids = template.encode(messages, tools=template_tools, continue_final=is_continuation, suffix=forced_prefix)
    except ChatTemplateError as e:
        if not chat.fold_late_system():
            raise InvalidRequest(str(e)) from None
        return build_prompt(template, chat)  # a template that allows a system turn only first
    prompt = Prompt(ids, prefill, {t["name"] for t in tools or []}, forced_tool is not False, template_tools,
                    forced_tool if isinstance(forced_tool, str) else None, tool_format=fmt)
    prompt.grammar = structured.answer_grammar(chat, prompt)
    return prompt


def _add_system(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = messages[0]["content"] + "\n\n" + text
    else:
        messages.insert(0, {"role": "system", "content": text})
