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
CALL_START = '\n{"name": "'  # after OPEN
ARGUMENTS = '", "arguments": '  # after the name
CALL_END = "}\n" + CLOSE  # after the arguments
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
    return OPEN + CALL_START + (name + ARGUMENTS if name else "")


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


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class CallStream:
    """Reads tool calls out of streamed text as it arrives, for incremental deltas.

    Feed it the text after an opening tag; it returns events: ("name", name) once the name is
    complete, ("args", fragment) for each piece of the arguments' JSON, ("end", None) when the
    arguments' object closes. The arguments are streamed as written; they are complete and valid
    when the call was generated under its grammar (`structured.tool_grammar`).
    """

    def __init__(self):
        self.buffer = ""
        self.name: str | None = None
        self.depth = 0
        self.in_string = self.escaped = False
        self.done = False

    def feed(self, text: str) -> list[tuple[str, str | None]]:
        events: list[tuple[str, str | None]] = []
        if self.done:
            return events
        self.buffer += text
        if self.name is None:
            m = _HEAD.match(self.buffer)
            if m is None:
                return events
            self.name = m.group(1)
            events.append(("name", self.name))
            self.buffer = self.buffer[m.end():]
        if self.depth == 0:
            self.buffer = self.buffer.lstrip()
        end = self._scan(self.buffer)
        piece, self.buffer = self.buffer[:end], self.buffer[end:]
        if piece:
            events.append(("args", piece))
        if self.done:
            events.append(("end", None))
        return events

    def _scan(self, text: str) -> int:
        """How much of text belongs to the arguments: up to the brace that closes them."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
        return len(text)


class AnswerSplitter:
    """Splits a streamed answer into text and tool calls as it arrives.

    `feed(delta)` returns events: ("text", s), ("name", name), ("args", fragment), ("end", None).
    Text that could be the start of an opening tag is held back until it is known not to be one, so
    the tool-call markup never reaches a text block; text after the last call is dropped, as
    `parse_tool_calls` does. `prefill` is the prompt's forced start of a call (tool_choice any / tool).
    """

    def __init__(self, tool_names: set[str], prefill: str = ""):
        self.has_tools = bool(tool_names)
        self.held = ""
        self.call: CallStream | None = None
        self.calls = 0
        self._pending: list[tuple[str, str | None]] = []
        if prefill.startswith(OPEN):
            self.call = CallStream()
            self._pending = self.call.feed(prefill[len(OPEN):])

    def feed(self, text: str) -> list[tuple[str, str | None]]:
        events, self._pending = self._pending, []
        if not self.has_tools:
            return events + ([("text", text)] if text else [])
        self.held += text
        while self.held:
            if self.call is not None:
                events += self.call.feed(self.held)
                self.held = ""
                if not self.call.done:
                    break
                self.held, self.call = self.call.buffer, None
                self.calls += 1
                continue
            cut = self.held.find(OPEN)
            if cut >= 0:
                if cut and not self.calls:
                    events.append(("text", self.held[:cut]))
                self.held, self.call = self.held[cut + len(OPEN):], CallStream()
                continue
            keep = partial_suffix(self.held, OPEN)
            if not self.calls and len(self.held) > keep:
                events.append(("text", self.held[: len(self.held) - keep]))
            self.held = self.held[len(self.held) - keep:]
            break
        return events

    def flush(self) -> list[tuple[str, str | None]]:
        """The end of the answer: held-back text that never became a call."""
        events, self._pending = self._pending, []
        if self.call is None and self.held and not self.calls:
            events.append(("text", self.held))
        self.held = ""
        return events


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of token."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
