"""Turning API requests into prompt token ids through the model's chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stratum.models.chat_template import ChatTemplate, ChatTemplateError
from stratum.server.errors import InvalidRequest
from stratum.server.protocol import ChatCompletionRequest, CountTokensRequest, MessagesRequest
from stratum.server import tools as tool_fmt


@dataclass
class Prompt:
    token_ids: list[int]
    prefill: str = ""  # assistant text the output continues (part of the answer only if it is a forced tool call)
    tool_names: set[str] = field(default_factory=set)
    is_forced_tool: bool = False


def _block_text(block) -> str:
    if block.type == "text":
        return block.text
    if block.type == "tool_use":
        return tool_fmt.OPEN + "\n" + json.dumps({"name": block.name, "arguments": block.input}, ensure_ascii=False) + "\n" + tool_fmt.CLOSE
    content = block.content if isinstance(block.content, str) else "\n".join(b.text for b in block.content)
    return "<tool_response>\n" + content + "\n</tool_response>"


def anthropic_messages(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]], list[dict] | None, Any]:
    """Anthropic body -> (chat messages, tool definitions to render, tool_choice).

    Consecutive turns of one role are merged, as the Messages API does.
    """
    messages: list[dict[str, Any]] = []
    system = req.system if isinstance(req.system, str) or req.system is None else "\n".join(b.text for b in req.system)
    choice = req.tool_choice
    tools = None
    if req.tools and not (choice and choice.type == "none"):
        tools = [{"name": t.name, "description": t.description or "", "parameters": t.input_schema} for t in req.tools]
    if choice and choice.type == "tool" and choice.name not in {t.name for t in req.tools or []}:
        raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not in tools")
    if choice and choice.type in ("any", "tool") and not req.tools:
        raise InvalidRequest(f"tool_choice {choice.type!r} requires tools")
    if system:
        messages.append({"role": "system", "content": system})
    for m in req.messages:
        text = m.content if isinstance(m.content, str) else "\n".join(_block_text(b) for b in m.content)
        if messages and messages[-1]["role"] == m.role:
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": m.role, "content": text})
    return messages, tools, choice


def openai_messages(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[dict] | None, Any]:
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
    tools = None
    choice = req.tool_choice
    if req.tools and choice != "none":
        tools = [{"name": t.function.name, "description": t.function.description or "", "parameters": t.function.parameters} for t in req.tools]
    return messages, tools, choice


def _args(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def build_prompt(template: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict] | None,
                 forced_tool: str | None | bool = False) -> Prompt:
    """Render messages (+ tools) and tokenize; a final assistant turn becomes a prefill.

    Args:
        forced_tool: False for no forcing, True for "any tool", or a tool name.

    Raises:
        InvalidRequest: the template cannot render these messages.
    """
    messages = [dict(m) for m in messages]
    if tools and "tools" not in template.source:
        prompt_text = tool_fmt.tools_system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = messages[0]["content"] + "\n\n" + prompt_text
        else:
            messages.insert(0, {"role": "system", "content": prompt_text})
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
    return Prompt(ids, prefill, {t["name"] for t in tools or []}, forced_tool is not False)
