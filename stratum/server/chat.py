"""Turning API requests into chat messages and prompt token ids through the model's chat template."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from stratum.engine.reasoning import Reasoning
from stratum.models.chat_template import ChatTemplate, ChatTemplateError
from stratum.server import structured
from stratum.server import tools as tool_fmt
from stratum.server.errors import InvalidRequest
from stratum.server.protocol import ChatCompletionRequest, CountTokensRequest, MessagesRequest
from stratum.server.protocol.messages import Tool
from stratum.server.reasoning import Thinking, ThoughtSigner


@dataclass
class ChatInput:
    """A request in template terms."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    forced_tool: bool | str = False  # False, True (any tool), or a tool name
    system_text: str = ""
    pinned: dict[int, str | None] = field(default_factory=dict)  # message index -> cache_control ttl
    output_schema: dict[str, Any] | None = None  # structured outputs: the answer is JSON matching it
    parallel_calls: bool = True  # the answer may hold several tool calls (OpenAI's parallel_tool_calls)
    thinking: Thinking = Thinking()  # what a reasoning model's thought should be

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

    def write_tools_as_text(self) -> bool:
        """Writes tool calls and results into the turns' text in the Hermes form (the form the system
        prompt teaches a model whose template knows no tools): calls after their assistant turn's text,
        results as user turns, merged with the turns of their role around them. False when there is
        none to write."""
        if not any(m["role"] == "tool" or m.get("tool_calls") for m in self.messages):
            return False
        written: list[dict[str, Any]] = []
        where = {}
        for i, m in enumerate(self.messages):
            if m["role"] == "tool":
                turn = {"role": "user", "content": "<tool_response>\n" + m["content"] + "\n</tool_response>"}
            else:
                calls = [tool_fmt.HERMES.open + "\n" + json.dumps({"name": c["function"]["name"],
                                                                  "arguments": c["function"]["arguments"]},
                                                                 ensure_ascii=False) + "\n" + tool_fmt.HERMES.stop
                         for c in m.get("tool_calls", ())]
                turn = {"role": m["role"], "content": "\n".join(t for t in (m["content"], *calls) if t)}
            if written and written[-1]["role"] == turn["role"]:
                written[-1]["content"] += "\n" + turn["content"]
            else:
                written.append(turn)
            where[i] = len(written) - 1
        self.messages = written
        self.pinned = {where[i]: ttl for i, ttl in self.pinned.items()}
        return True

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as the engine gets it, and what reading its answer needs to know."""

    token_ids: list[int]
    prefill: str = ""  # assistant text the output continues (part of the answer only if it is a forced tool call)
    reasoning: Reasoning | None = None  # the model thinks first: how its thought is told from its answer
    tool_names: set[str] = field(default_factory=set)
    is_forced_tool: bool = False
    template_tools: list[dict] | None = None
    forced_name: str | None = None  # the tool a forced call must name, when the request (or a lone tool) fixes it
    grammar: str | None = None  # what the answer must follow (`structured`), for the engine's sampler
    tool_format: tool_fmt.ToolFormat = tool_fmt.HERMES  # how the model writes tool calls (its family's format)
    # the answer may hold several calls: the request allows it, and the template has a form for them (not
    # Llama 3.1's, nor one that knows no tools: a model never taught calls repeats its one until max_tokens)
    parallel_calls: bool = True
    raw_tools: frozenset[str] = frozenset()  # custom (freeform) tools: a call's input is raw text to the answer's end


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """A tool call in an assistant turn, as Hugging Face chat templates read `tool_calls`."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_result(call_id: str, content: str, names: dict[str, str]) -> dict[str, Any]:
    """A tool's result as a `tool` turn, naming the call it answers (and, where known, its tool)."""
    return {"role": "tool", "tool_call_id": call_id, "name": names.get(call_id, ""), "content": content}


_SILENT_BLOCKS = ("thinking", "redacted_thinking", "container_upload", "fallback", "mcp_tool_listing", "tool_addition",
                  "tool_removal")


def _block_text(block) -> str:
    """One content block as the model reads it, for all but tool calls and results (docs/api.md, "Content
    blocks"): text as is; documents and search results as their title, context and text; thinking and
    container uploads add nothing."""
    kind = block.type
    if kind in _SILENT_BLOCKS:  # a recorded model's reasoning is not prompt, nor is bookkeeping
        return ""
    if kind in ("text", "compaction"):  # a compaction block's content is its summary of what came before
        return (block.text if kind == "text" else block.content) or ""
    if kind == "document":
        source = block.source
        body = source.data if source.type == "text" else (
            source.content if isinstance(source.content, str) else "\n".join(b.text for b in source.content))
        return "\n".join(t for t in (block.title, block.context, body) if t)
    if kind == "search_result":
        return "\n".join([block.title, block.source, *(b.text for b in block.content)])
    if kind == "tool_reference":
        return f"Tool: {block.tool_name}"
    raise AssertionError(f"{kind} is a tool call or result")


def _anthropic_turns(role: str, blocks, names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message's blocks as chat turns: an assistant's tool calls (its server tools' too) as
    its `tool_calls`, its thinking as its `reasoning_content` (as reasoning families' templates read it);
    each tool result (a server tool's as the JSON of its content) as a `tool` turn, before the rest of the
    message's text."""
    texts, calls, results, thoughts = [], [], [], []
    for block in blocks:
        if block.type == "thinking" and role == "assistant":
            thoughts.append(block.thinking)
        elif block.type in ("tool_use", "server_tool_use", "mcp_tool_use"):
            names[block.id] = block.name
            calls.append(tool_call(block.id, block.name, block.input))
        elif block.type == "tool_result":
            content = block.content if isinstance(block.content, str) else "\n".join(map(_block_text, block.content))
            results.append(tool_result(block.tool_use_id, content, names))
        elif hasattr(block, "tool_use_id"):  # a server tool's result (web search, code execution...)
            results.append(tool_result(block.tool_use_id, json.dumps(block.content, ensure_ascii=False), names))
        elif text := _block_text(block):
            texts.append(text)
    turns = results
    if texts or calls or thoughts or not results:
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if thoughts:
            turn["reasoning_content"] = "\n".join(thoughts)
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


def append_turn(messages: list[dict[str, Any]], turn: dict[str, Any]) -> None:
    """Add a turn; consecutive turns of one role are merged, as the Messages API does: their text joined,
    their tool calls in order (text after an assistant's calls starts a turn of its own). Tool results
    stay one turn each."""
    last = messages[-1] if messages else None
    if (last is None or last["role"] != turn["role"] or turn["role"] == "tool"
            or (last.get("tool_calls") and turn["content"])
            or (last.get("tool_calls") or last["content"]) and turn.get("reasoning_content")):
        messages.append(dict(turn))  # (a thought after an answer or a call begins the next step's turn)
        return
    last["content"] = "\n".join(t for t in (last["content"], turn["content"]) if t)
    if turn.get("reasoning_content"):
        thoughts = (last.get("reasoning_content"), turn["reasoning_content"])
        last["reasoning_content"] = "\n".join(t for t in thoughts if t)
    if turn.get("tool_calls"):
        last["tool_calls"] = last.get("tool_calls", []) + turn["tool_calls"]


def _marks(blocks) -> list:
    return [b.cache_control for b in blocks if getattr(b, "cache_control", None)]


def anthropic_input(req: MessagesRequest | CountTokensRequest, signer: ThoughtSigner | None = None) -> ChatInput:
    """Anthropic body -> chat messages. Consecutive turns of one role are merged, as the Messages API
    does; a system message inside `messages` stays a system turn at its place in the conversation (one
    with `clear_at: next_user_message` only until a user message follows it).

    Args:
        signer: where the model reasons, what checks a thinking block's signature (a model that does not
            reason never reads a thinking block, so any is accepted and left out).
    Raises:
        InvalidRequest: a thinking block's signature is not the one this server gave it (with `signer`).
    """
    if signer is not None:
        check_thought_signatures(req, signer)
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
    tools, forced = _anthropic_tools(req)
    system_texts = [system_text] if system_text else []
    names: dict[str, str] = {}  # tool call id -> the tool's name
    for i, m in enumerate(req.messages):
        if m.role == "system" and (not m.content or m.clear_at == "next_user_message"
                                   and any(later.role == "user" for later in req.messages[i + 1:])):
            continue  # only output_config, or cleared by the user message after it
        blocks = [] if isinstance(m.content, str) else m.content
        turns = ([{"role": m.role, "content": m.content}] if isinstance(m.content, str)
                 else _anthropic_turns(m.role, blocks, names))
        if m.role == "system":
            system_texts.append(turns[0]["content"])
        for turn in turns:
            append_turn(messages, turn)
        marks = _marks(blocks) + ([m.cache_control] if m.cache_control else [])
        if marks:
            pinned[len(messages) - 1] = marks[-1].ttl
    if req.cache_control is not None:  # automatic caching: a breakpoint after the last message
        pinned[len(messages) - 1] = req.cache_control.ttl
    choice = req.tool_choice
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return ChatInput(messages, tools, forced, "\n".join(system_texts), pinned, output_schema=req.output_schema,
                     parallel_calls=parallel, thinking=anthropic_thinking(req))


def anthropic_thinking(req: MessagesRequest | CountTokensRequest) -> Thinking:
    """The Messages API's `thinking`: enabled with its budget; adaptive as the model decides (its
    template's default), within the effort's budget; disabled, between_tools or absent: no thought (the
    API's default)."""
    config, effort = req.thinking, req.output_config.effort if req.output_config else None
    if config is None or config.type in ("disabled", "between_tools"):
        return Thinking(enabled=False)
    if config.type == "enabled":
        return Thinking(enabled=True, budget=config.budget_tokens)
    return Thinking(budget=Thinking.of_effort(effort).budget)


def check_thought_signatures(req: MessagesRequest | CountTokensRequest, signer: ThoughtSigner) -> None:
    """Every thinking block sent back carries the signature this server gave its text: a client can
    neither write nor alter what the model thought.

    Raises:
        InvalidRequest: one does not (Anthropic's words for it).
    """
    for i, m in enumerate(req.messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
            if block.type == "thinking" and not signer.verify(block.thinking, block.signature):
                raise InvalidRequest(f"messages.{i}.content.{j}: Invalid `signature` in `thinking` block")


def _anthropic_tools(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]] | None, bool | str]:
    """The custom tools offered at the end of the conversation (`tools`, changed by the messages'
    tool_addition / tool_removal blocks, a compaction's among them) and what tool_choice forces.

    Raises:
        InvalidRequest: tool_choice names a tool not offered, or forces one where none is.
    """
    declared = {t.name: t for t in req.tools or []}
    offered = dict(declared)
    for m in req.messages:
        for block in m.content if isinstance(m.content, list) else ():
            for change in (block.tool_changes or []) if block.type == "compaction" else [block]:
                if change.type in ("tool_addition", "tool_removal"):
                    _change_tools(offered, declared, change)
    choice = req.tool_choice
    if choice and choice.type == "tool" and choice.name not in offered:
        raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not in tools")
    if choice and choice.type in ("any", "tool") and not offered:
        raise InvalidRequest(f"tool_choice {choice.type!r} requires tools")
    if not offered or (choice and choice.type == "none"):
        return None, False
    tools = [{"name": t.name, "description": t.description or "", "parameters": t.input_schema,
              "strict": bool(t.strict)}
             for t in offered.values()]
    return tools, (True if choice is not None and choice.type == "any"
                   else choice.name if choice and choice.type == "tool" else False)


def _change_tools(offered: dict[str, Any], declared: dict[str, Any], change) -> None:
    """Apply one tool_addition / tool_removal to the tools offered (MCP references change nothing here)."""
    ref = change.tool
    if ref.type == "tool_definition":
        if (ref.definition or {}).get("type") not in (None, "custom"):
            return  # an Anthropic-defined tool: not offered to this model
        try:
            tool = Tool.model_validate(ref.definition)
        except ValueError as e:
            raise InvalidRequest(f"tool_addition: the tool definition is not valid: {e}"[:500]) from None
        if change.type == "tool_addition":
            offered[tool.name] = declared[tool.name] = tool
        return
    if ref.type != "tool_reference" or ref.name is None:
        return
    if change.type == "tool_removal":
        offered.pop(ref.name, None)
    elif ref.name in declared:
        offered[ref.name] = declared[ref.name]
    else:
        raise InvalidRequest(f"tool_addition names {ref.name!r}, which is neither in tools nor defined earlier")


def openai_input(req: ChatCompletionRequest) -> ChatInput:
    """OpenAI chat completions -> chat messages: developer turns as system ones, an assistant's tool calls
    (a custom tool's with its raw input; the deprecated `function_call` too) as its `tool_calls`, tool
    (and deprecated function) turns as tool turns."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for m in req.messages:
        if m.role in ("tool", "function"):
            call_id = m.tool_call_id or ""
            append_turn(messages, {**tool_result(call_id, m.text, names), **({"name": m.name} if m.name else {})})
            continue
        turn = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        thought = m.reasoning_content or m.reasoning  # (the field vLLM and DeepSeek's API name both ways)
        if thought and m.role == "assistant":
            turn["reasoning_content"] = thought
        calls = [(c.id, c.function.name, call_arguments(c.function.arguments)) if c.type == "function"
                 else (c.id, c.custom.name, c.custom.input) for c in m.tool_calls or []]
        if m.function_call is not None:
            calls.append(("", m.function_call.name, call_arguments(m.function_call.arguments)))
        if calls:
            names.update((call_id, name) for call_id, name, _ in calls)
            turn["tool_calls"] = [tool_call(*c) for c in calls]
        append_turn(messages, turn)
    tools, forced = _openai_tools(req)
    system_text = "\n".join(m["content"] for m in messages if m["role"] == "system")
    schema = req.response_format.schema if req.response_format else None
    return ChatInput(messages, tools, forced, system_text, output_schema=schema,
                     parallel_calls=req.parallel_tool_calls is not False,
                     thinking=Thinking.of_effort(req.reasoning_effort))


def _openai_tools(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, bool | str]:
    """The function and custom tools offered (those `allowed_tools` names, where tool_choice names some)
    and what tool_choice forces."""
    choice = req.tool_choice
    offered = list(req.tools or [])
    if choice is not None and not isinstance(choice, str) and choice.type == "allowed_tools":
        allowed = {(t.get("type"), (t.get(t.get("type") or "") or {}).get("name")) for t in choice.allowed_tools.tools}
        offered = [t for t in offered if (t.type, _tool_name(t)) in allowed]
        choice = "required" if choice.allowed_tools.mode == "required" else "auto"
    tools = None
    if offered and choice != "none":
        tools = [{"name": t.custom.name, "description": t.custom.description or "", "format": t.format}
                 if t.type == "custom" else
                 {"name": t.function.name, "description": t.function.description or "",
                  "parameters": t.function.parameters, "strict": bool(t.function.strict)} for t in offered]
    named = choice.name if choice is not None and not isinstance(choice, str) else None
    return tools, forced_function(choice, named, tools)


def _tool_name(tool) -> str:
    return tool.custom.name if tool.type == "custom" else tool.function.name


def forced_function(choice, named: str | None, tools: list[dict[str, Any]] | None) -> bool | str:
    """OpenAI's tool_choice ("required", or a named function) as `ChatInput.forced_tool`."""
    forced: bool | str = True if choice == "required" else named if named is not None else False
    if isinstance(forced, str) and forced not in {t["name"] for t in tools or []}:
        raise InvalidRequest(f"tool_choice names {forced!r}, which is not in tools")
    if forced is not False and not tools:
        raise InvalidRequest("tool_choice requires tools")
    return forced


def call_arguments(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def build_prompt(template: ChatTemplate, chat: ChatInput, parse_thought: bool = True) -> Prompt:
    """Render messages (+ tools) and tokenize; a final assistant turn becomes a prefill. A template whose
    family reasons is rendered with its thought on or off as `chat.thinking` asks, and (unless
    parse_thought is False: `--reasoning-format none`) the prompt says how to tell the thought from
    the answer (`Prompt.reasoning`).

    Raises:
        InvalidRequest: the template cannot render these messages.
    """
    if "tool_calls" not in template.source:  # a template that knows no tool turns reads them as text
        chat.write_tools_as_text()
    fmt = tool_fmt.format_for(template.source)
    if fmt.call_id_length:
        chat.messages = [_short_ids(m, fmt.call_id_length) for m in chat.messages]
    messages = [dict(m) for m in chat.messages]
    tools, forced_tool = chat.tools, chat.forced_tool
    if chat.output_schema is not None:
        _add_system(messages, "Answer with JSON that matches this JSON schema:\n"
                    + json.dumps(chat.output_schema, ensure_ascii=False))
    if tools and "tools" not in template.source:
        _add_system(messages, tool_fmt.tools_system_prompt(tools))
        template_tools, fmt = None, tool_fmt.HERMES
    else:  # as transformers' apply_chat_template passes them: OpenAI's function tools
        template_tools = [_template_tool(t) for t in tools] if tools else None
        fmt = fmt.for_vocabulary(template.tokenizer)
    if forced_tool is True and tools and len(tools) == 1:
        forced_tool = tools[0]["name"]  # "any" with one tool is that tool
    # a forced call's opening is the server's text, written after the template's generation prompt (or
    # after an assistant prefill) with its special tokens read, as the model itself would write it
    forced_prefix = (fmt.forced_prefix(forced_tool if isinstance(forced_tool, str) else None)
                     if forced_tool is not False else "")
    is_continuation = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    prefill = forced_prefix or (messages[-1]["content"] if is_continuation else "")
    markers = template.thought_markers if parse_thought else None
    # a forced call is the answer's start: no thought comes before it
    think = False if forced_tool is not False else chat.thinking.enabled
    variables = {"enable_thinking": think} if markers and markers.has_switch and think is not None else {}
    try:
        ids = template.encode(messages, tools=template_tools, continue_final=is_continuation, suffix=forced_prefix,
                              **variables)
        is_open = markers is not None and _opens_thought(template, ids, markers.start, markers.end)
        if is_open and think is False:  # a template that always opens the thought (DeepSeek-R1's): closed at once
            ids = template.encode(messages, tools=template_tools, continue_final=is_continuation,
                                  suffix=markers.end + "\n\n" + forced_prefix, **variables)
            is_open = False
    except ChatTemplateError as e:
        if not chat.fold_late_system():
            raise InvalidRequest(str(e)) from None
        return build_prompt(template, chat, parse_thought)  # a template that allows a system turn only first
    reasoning = None
    if markers is not None and (think is not False or is_open):
        tok = template.tokenizer
        special = {i: m for m in (markers.start, markers.end) if (i := tok.special_token_id(m)) is not None}
        reasoning = Reasoning(markers.start, markers.end, is_open, chat.thinking.budget,
                              tok.encode("\n" + markers.end + "\n\n", allow_special=True), special)
    prompt = Prompt(ids, prefill, reasoning, {t["name"] for t in tools or []}, forced_tool is not False, template_tools,
                    forced_tool if isinstance(forced_tool, str) else None, tool_format=fmt,
                    parallel_calls=chat.parallel_calls and fmt.parallel and template_tools is not None,
                    raw_tools=frozenset(t["name"] for t in tools or [] if "format" in t))
    return replace(prompt, grammar=structured.answer_grammar(chat, prompt))


def _opens_thought(template: ChatTemplate, ids: list[int], start: str, end: str) -> bool:
    """Whether the prompt ends inside a thought: its generation prompt wrote the start marker last."""
    tail = template.tokenizer.decode(ids[-16:], skip_special_tokens=False)
    return tail.rfind(start) > tail.rfind(end)


def _template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as a chat template reads it: a function; a custom tool as one whose input is raw text, its
    format in its description."""
    if "format" in tool:
        fmt = tool["format"]
        how = (f"Its input is raw text in this {fmt['syntax']} grammar:\n{fmt['definition']}"
               if fmt.get("type") == "grammar" else "Its input is raw text.")
        return {"type": "function",
                "function": {"name": tool["name"], "description": f"{tool['description']}\n{how}".strip()}}
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k)}}


PIN_TTLS = {"5m": 300.0, "1h": 3600.0}


def pins_for(template: ChatTemplate, messages: list[dict[str, Any]], marked: dict[int, str | None],
             tools) -> list[tuple[int, float]]:
    """cache_control on a message's block pins the prompt prefix through the end of that message:
    (the prefix's length in tokens, its ttl in seconds) per marked message."""
    pins = []
    for index, ttl in marked.items():
        prefix = template.encode(messages[: index + 1], tools=tools, add_generation_prompt=False)
        pins.append((len(prefix), PIN_TTLS.get(ttl or "5m", 300.0)))
    return pins


def _short_ids(message: dict[str, Any], length: int) -> dict[str, Any]:
    """A turn whose tool call ids are `length` letters and digits (Mistral's templates refuse others), the
    id's last ones (as vLLM shortens them for Mistral) or, where it has too few, a digest of it; a call
    and its result get the same one."""
    def short(call_id: str) -> str:
        alnum = re.sub("[^A-Za-z0-9]", "", call_id)
        return alnum[-length:] if len(alnum) >= length else hashlib.sha256(call_id.encode()).hexdigest()[:length]

    if message["role"] == "tool":
        return {**message, "tool_call_id": short(message["tool_call_id"])}
    if message.get("tool_calls"):
        return {**message, "tool_calls": [{**c, "id": short(c["id"])} for c in message["tool_calls"]]}
    return message


def _add_system(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = messages[0]["content"] + "\n\n" + text
    else:
        messages.insert(0, {"role": "system", "content": text})
