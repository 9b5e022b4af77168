"""Tool use: rendering tool definitions for the model and parsing its tool calls back.

Templates that know about tools (Qwen2.5, Llama 3.1) get them through the template's `tools`
variable. For templates that don't (SmolLM2), the definitions go into the system prompt in the
widely used Hermes format, and the model answers with <tool_call>{"name": ..., "arguments": ...}</tool_call>.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes-style tool instructions for templates with no tool support of their own."""
    lines = [json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools]
    return (
        "You may call one or more functions to assist with the user query.\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(lines)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    )


def forced_prefix(name: str | None) -> str:
    """Assistant prefill that makes the model start a tool call (tool_choice any / tool)."""
    return OPEN + "\n{\"name\": \"" + (name + "\", \"arguments\": " if name else "")


def new_tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str, known: set[str]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """Split model output into leading text and tool calls.

    Returns:
        (text before the first call, [(name, input)]). Calls naming an unknown tool, or whose
        JSON cannot be read even after closing unbalanced brackets, are left as text.
    """
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for m in _CALL.finditer(text, start):
        obj = _loads_lenient(m.group(1).strip())
        if not isinstance(obj, dict):
            continue
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = _loads_lenient(args)
        if name in known and isinstance(args, dict):
            calls.append((name, args))
    if not calls:
        return text, []
    return text[:start], calls


def _loads_lenient(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        pass
    closers = []
    in_str = esc = False
    for ch in s:
        if in_str:
            esc = (ch == "\\") and not esc
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]" and closers:
            closers.pop()
    candidate = s + ('"' if in_str else "") + "".join(reversed(closers))
    try:
        return json.loads(candidate)
    except ValueError:
        return None
