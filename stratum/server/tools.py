"""Tool use: how each model family writes tool calls, rendering tool definitions for the model, and
reading its calls back (whole, or as they stream).

A family's format comes from its chat template (`format_for`):
- Hermes, Qwen2.5/Qwen3's: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, text may come first;
- Llama 3.x JSON: `{"name": ..., "parameters": {...}}` as the whole answer, after an optional <|python_tag|>;
- Mistral's v3 template: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`;
- Mistral's newer templates: `[TOOL_CALLS]name[ARGS]{...}`, once per call.
Templates that know about tools get them through the template's `tools` variable. For templates that
don't (SmolLM2), the definitions go into the system prompt in the Hermes format, which is then the
format the model answers in.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, replace
from typing import Any

_NAME_FIRST = r'\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'  # a JSON call's head


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax. A model writes one call as

        open call_start NAME arguments ARGS call_end close

    with ARGS a JSON object, and several (where the family has a form for them: `parallel`) as

        open call_start NAME arguments ARGS call_end between call_start NAME arguments ARGS ... call_end close

    That is what forced calls are constrained to (`structured.tool_grammar`).
    Reading is more lenient and reads several calls: `first_head` / `next_head` match the text up to
    a call's arguments (whitespace may vary, and a special-token marker may be missing from the text),
    and `starts` are the answer beginnings that commit it to calls when no text may come before them.
    """

    name: str
    open: str
    call_start: str
    arguments: str
    call_end: str
    close: str
    text_before: bool  # text may come before the calls (the calls begin at `open`, wherever it is)
    first_head: re.Pattern  # from the calls' start through the first call's name (group 1) and `arguments`
    next_head: re.Pattern  # from the end of one call's arguments through the next call's name
    starts: tuple[str, ...] = ()  # without text_before: beginnings that mean "these are calls"
    marker: str = ""  # output text showing that a call is under way (the engine's tool_use_prepared)
    stop: str | None = None  # a stop string that ends the answer after its call
    lead: str = ""  # a marker the model may write before the calls (Llama 3's <|python_tag|>)
    between: str = ""  # what comes between one call's call_end and the next one's call_start
    parallel: bool = True  # the family writes several calls in one answer (Llama 3.1's template refuses them)
    call_id_length: int = 0  # the templates want tool call ids of exactly this many letters and digits (Mistral's)
    # the format's markers that are special tokens of the model's vocabulary, with their ids (a grammar
    # must name them as tokens: as text they would be spelled out); see `for_vocabulary`
    special_tokens: tuple[tuple[str, int], ...] = ()

    def for_vocabulary(self, tokenizer) -> "ToolFormat":
        """This format with the markers that `tokenizer` holds as special tokens."""
        markers = [self.lead, *re.findall(r"\[[A-Z_]+\]|<\|[a-z_]+\|>", self.open + self.call_start + self.arguments)]
        found = tuple((m, i) for m in dict.fromkeys(markers) if m and (i := tokenizer.special_token_id(m)) is not None)
        return replace(self, special_tokens=found) if found else self

    def forced_prefix(self, name: str | None) -> str:
        """Assistant prefill that makes the model start a call (tool_choice any / a named tool)."""
        return self.open + self.call_start + (name + self.arguments if name else "")


HERMES = ToolFormat(
    "hermes", open="<tool_call>", call_start='\n{"name": "', arguments='", "arguments": ', call_end="}\n</tool_call>",
    close="", text_before=True,
    first_head=re.compile(r"<tool_call>\s*" + _NAME_FIRST),
    next_head=re.compile(r"\s*\}\s*</tool_call>\s*<tool_call>\s*" + _NAME_FIRST),
    marker="<tool_call>", stop="</tool_call>", between="\n<tool_call>")
LLAMA3_JSON = ToolFormat(
    "llama3_json", open="", call_start='{"name": "', arguments='", "parameters": ', call_end="}", close="",
    text_before=False,
    first_head=re.compile(r"\s*(?:<\|python_tag\|>)?\s*" + _NAME_FIRST),
    next_head=re.compile(r"\s*\}\s*;\s*" + _NAME_FIRST),
    starts=("{", "<|python_tag|>"), marker='{"name"', lead="<|python_tag|>", between="; ", parallel=False)
MISTRAL = ToolFormat(
    "mistral", open="[TOOL_CALLS] [", call_start='{"name": "', arguments='", "arguments": ', call_end="}",
    close="]", text_before=False,
    first_head=re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*\[\s*" + _NAME_FIRST),  # the marker may be a dropped special token
    next_head=re.compile(r"\s*\}\s*,\s*" + _NAME_FIRST),
    starts=("[TOOL_CALLS]", "["), marker='{"name"', between=", ", call_id_length=9)
MISTRAL_NAME_ARGS = ToolFormat(
    "mistral_args", open="", call_start="[TOOL_CALLS]", arguments="[ARGS]", call_end="", close="",
    text_before=False,
    first_head=re.compile(r"\s*\[TOOL_CALLS\]\s*([^\s\[\]{]+)\s*\[ARGS\]\s*"),
    next_head=re.compile(r"\s*\[TOOL_CALLS\]\s*([^\s\[\]{]+)\s*\[ARGS\]\s*"),
    starts=("[TOOL_CALLS]",), marker="[ARGS]", call_id_length=9)
_MISTRAL_TIGHT = replace(MISTRAL, open="[TOOL_CALLS][")  # Mistral Nemo's v3-style template


def format_for(template_source: str) -> ToolFormat:
    """The tool-call format a chat template teaches its model, read from the template's own text (how it
    writes a call in the history, or what it tells the model to answer); Hermes where it says nothing."""
    if "[TOOL_CALLS]" in template_source:
        if "[ARGS]" in template_source:
            return MISTRAL_NAME_ARGS
        # v3 writes "[TOOL_CALLS] [", later v3-style templates (Nemo) "[TOOL_CALLS]["
        return MISTRAL if "[TOOL_CALLS] [" in template_source else _MISTRAL_TIGHT
    if "<tool_call>" in template_source:
        return HERMES
    if '"parameters": ' in template_source and ("<|python_tag|>" in template_source or "ipython" in template_source):
        return LLAMA3_JSON
    return HERMES


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes-style tool instructions for templates with no tool support of their own. A custom
    (freeform) tool is listed with its input format, and called with its raw input as the arguments."""
    lines = [json.dumps({"type": "custom", "custom": {k: t[k] for k in ("name", "description", "format")}}
                        if "format" in t else {"type": "function", "function": t}, ensure_ascii=False) for t in tools]
    text = (
        "You may call one or more functions to assist with the user query.\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(lines)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    )
    if any("format" in t for t in tools):
        text += ("\n\nA custom tool takes raw text, not JSON: call it last, as\n<tool_call>\n{\"name\": <tool-name>, "
                 "\"arguments\": <its input, as raw text in its format>")
    return text


def parse_tool_calls(text: str, known: set[str], fmt: ToolFormat = HERMES,
                     raw: frozenset[str] = frozenset()) -> tuple[str, list[tuple[str, dict[str, Any] | str]]]:
    """Split model output into leading text and tool calls, reading it as `AnswerSplitter` streams it.

    Args:
        raw: the custom (freeform) tools: a call of one holds its raw input, to the end of the answer.
    Returns:
        (text before the first call, [(name, input)]): a function call's input is its arguments object,
        a custom call's its raw text. Calls naming an unknown tool, or whose arguments are not a JSON
        object even after closing unbalanced brackets, are dropped; when no call is left, the whole
        output is text.
    """
    splitter = AnswerSplitter(known, fmt=fmt, raw=raw)
    before, calls = "", []
    for event in splitter.feed(text) + splitter.flush():
        match event:
            case TextPiece(piece):
                before += piece
            case CallStart(name):
                calls.append([name, ""])
            case CallArguments(fragment):
                calls[-1][1] += fragment
    parsed: list[tuple[str, dict[str, Any] | str]] = []
    for name, written in calls:
        if name in raw:
            parsed.append((name, written))
            continue
        args = _loads_lenient(written.strip())
        if isinstance(args, str):  # arguments written as a JSON string holding the object
            args = _loads_lenient(args)
        if name in known and isinstance(args, dict):
            parsed.append((name, args))
    if not parsed:
        return text, []
    return before, parsed


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


class _Arguments:
    """Scans a call's arguments (a JSON value) as they arrive, up to the character that ends them."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = self.started = False
        self.done = False

    def scan(self, text: str) -> int:
        """How much of text belongs to the arguments."""
        for i, ch in enumerate(text):
            self.started = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:  # the arguments were one JSON string
                        self.done = True
                        return i + 1
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


@dataclass(frozen=True, slots=True)
class TextPiece:
    """Answer text, free of call markup."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """A tool call begins: the tool's name."""

    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    """A fragment of the open call's arguments, as generated (the fragments joined are its JSON)."""

    fragment: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    """The open call's arguments are complete."""


AnswerEvent = TextPiece | CallStart | CallArguments | CallEnd


class SplitState(enum.Enum):
    """Where an `AnswerSplitter` is in its answer: TEXT -> HEAD -> ARGS (or RAW, to the end) ->
    BETWEEN -> HEAD ...; or PLAIN."""

    TEXT = enum.auto()  # before any call: text that may yet turn out to begin one
    HEAD = enum.auto()  # the first call's head, up to its arguments
    ARGS = enum.auto()  # a call's JSON arguments
    RAW = enum.auto()  # a raw (custom) tool's input: the rest of the answer
    BETWEEN = enum.auto()  # after a call: the next call's head, or the end
    PLAIN = enum.auto()  # no calls in this answer: all of it is text


class AnswerSplitter:
    """Splits a streamed answer into text and tool calls as it arrives, in one family's format.

    `feed(delta)` returns `AnswerEvent`s: text pieces, and per call its start (the name), fragments of
    its arguments and its end. Text that could be the start of a call is held back until it is known
    not to be one, so call markup never reaches a text block; text after the last call is dropped, as
    `parse_tool_calls` does. A call whose head never completes comes out as text at `flush`. `prefill`
    is the prompt's forced start of a call (tool_choice any / tool), read as the answer's beginning. A
    call of a `raw` (custom) tool takes the rest of the answer as its input, but for the format's
    closing tag (`fmt.stop`) at its very end, which the model may write after it.
    """

    def __init__(self, tool_names: set[str], prefill: str = "", fmt: ToolFormat = HERMES,
                 raw: frozenset[str] = frozenset()):
        self.has_tools = bool(tool_names)
        self.fmt = fmt
        self.raw = raw
        self.held = ""
        self.state = SplitState.TEXT
        self.calls = 0
        self.args: _Arguments | None = None
        self.skip = 0  # in a raw call, leading whitespace still to drop
        self._pending: list[AnswerEvent] = []
        self._pending = self.feed(prefill) if prefill else []

    def feed(self, text: str) -> list[AnswerEvent]:
        events, self._pending = self._pending, []
        if not self.has_tools or self.state is SplitState.PLAIN:
            return events + ([TextPiece(text)] if text else [])
        self.held += text
        while self.held:
            before = (self.state, len(self.held))
            if self.state is SplitState.TEXT:
                events += self._find_calls()
            elif self.state in (SplitState.HEAD, SplitState.BETWEEN):
                pattern = self.fmt.first_head if self.state is SplitState.HEAD else self.fmt.next_head
                m = pattern.match(self.held)
                if m is not None:
                    events.append(CallStart(m.group(1)))
                    state = SplitState.RAW if m.group(1) in self.raw else SplitState.ARGS
                    self.held, self.state, self.args = self.held[m.end():], state, _Arguments()
                    # the space the format writes after `arguments` is not input, whether or not the head read it
                    head = m.group(0)
                    self.skip = max(0, len(self.fmt.arguments) - len(self.fmt.arguments.rstrip())
                                    - (len(head) - len(head.rstrip())))
            elif self.state is SplitState.RAW:
                if self.skip:
                    n = min(self.skip, len(self.held) - len(self.held.lstrip()))
                    self.held, self.skip = self.held[n:], 0
                cut = len(self.held) - _raw_tail(self.held, self.fmt.stop)
                if cut:
                    events.append(CallArguments(self.held[:cut]))
                    self.held = self.held[cut:]
            elif self.state is SplitState.ARGS:
                if not self.args.started:  # whitespace before the arguments is not part of them
                    self.held = self.held.lstrip()
                end = self.args.scan(self.held)
                if end:
                    events.append(CallArguments(self.held[:end]))
                self.held = self.held[end:]
                if self.args.done:
                    events.append(CallEnd())
                    self.state, self.calls = SplitState.BETWEEN, self.calls + 1
            if (self.state, len(self.held)) == before or self.state is SplitState.PLAIN:
                break
        if self.state is SplitState.PLAIN and self.held:
            events.append(TextPiece(self.held))
            self.held = ""
        return events

    def _find_calls(self) -> list[AnswerEvent]:
        """In text, before any call: release what cannot begin one; at the calls' start, move to head."""
        fmt = self.fmt
        if fmt.text_before:
            cut = self.held.find(fmt.open)
            if cut >= 0:
                text, self.held, self.state = self.held[:cut], self.held[cut:], SplitState.HEAD
                return [TextPiece(text)] if text else []
            keep = partial_suffix(self.held, fmt.open)
            text, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
            return [TextPiece(text)] if text else []
        begin = self.held.lstrip()
        if not begin:
            return []
        if any(begin.startswith(s) for s in fmt.starts):
            self.state = SplitState.HEAD
        elif not any(s.startswith(begin) for s in fmt.starts):
            self.state = SplitState.PLAIN
        return []

    def flush(self) -> list[AnswerEvent]:
        """The end of the answer: held-back text that never became a call."""
        events, self._pending = self._pending, []
        if self.state is SplitState.RAW:
            closed = self.fmt.stop and self.held.strip() == self.fmt.stop
            events += ([CallArguments(self.held)] if self.held and not closed else []) + [CallEnd()]
            self.state, self.calls = SplitState.BETWEEN, self.calls + 1
        elif self.held and not self.calls and self.state in (SplitState.TEXT, SplitState.HEAD, SplitState.PLAIN):
            events.append(TextPiece(self.held))
        self.held = ""
        return events


def _raw_tail(text: str, tag: str | None) -> int:
    """How much of the end of a raw input to hold back: what may yet be (whitespace and) the closing tag."""
    if not tag:
        return 0
    body = text.rstrip()
    if body.endswith(tag):
        return len(text) - len(body[: -len(tag)].rstrip())
    if len(body) < len(text):  # trailing whitespace: a tag may follow it
        return len(text) - len(body)
    keep = partial_suffix(body, tag)
    return len(text) - len(body[: len(body) - keep].rstrip()) if keep else 0


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of token."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
