"""Grammars for what an answer must look like: a tool call, or JSON that matches a schema.

The serving side writes the grammar (llguidance's Lark-like syntax, JSON schemas inline with
`%json`); the engine masks every sampled token with it (`stratum.engine.grammar`). A tool call is
the Hermes format `tools.py` reads back:

    <tool_call>\n{"name": "NAME", "arguments": ARGUMENTS}\n</tool_call>

with NAME one of the declared tools and ARGUMENTS valid against that tool's schema. JSON is written
with the separators `json.dumps` uses (", " and ": "), the form the model sees its tools in.
"""

from __future__ import annotations

import json
from typing import Any

from stratum.engine import grammar as engine_grammar
from stratum.engine.sampling_params import InvalidRequestError
from stratum.server import tools as tool_fmt
from stratum.server.errors import InvalidRequest

_JSON_FORM = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
# Free text that never contains the opening tag, and free text that ends at its first opening tag:
# two lexemes, so the lexer decides at the tag itself, with no lookahead.
_TEXT = r"/(?s:.+)/ & ~/(?s:.*<tool_call>.*)/"
_TEXT_THEN_OPEN = r"/(?s:.*)<tool_call>/ & ~/(?s:.*<tool_call>.+)/"


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


def _schema(schema: dict[str, Any], strict: bool, where: str) -> str:
    """A schema as a `%json` body. Strict: a keyword the compiler does not implement is a 400; not
    strict (a tool without `strict: true`): such keywords are ignored, the rest still holds.

    Raises:
        InvalidRequest: the schema cannot be compiled (strict), naming where it came from.
    """
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where}: a JSON schema must be an object")
    body = closed(schema)
    body["x-guidance"] = {**_JSON_FORM, "lenient": not strict}
    try:
        engine_grammar.check(_grammar_of_schema(body))
    except InvalidRequestError as e:
        raise InvalidRequest(f"{where}: unsupported JSON schema: {e}") from None
    return "%json " + json.dumps(body, ensure_ascii=False)


_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever an object lists its properties and says
    nothing about others: a generated object holds the declared keys only (what strict tools require,
    and xgrammar's default strict mode does), instead of inventing keys until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS + _SCHEMA_LISTS:
        if key in out:
            out[key] = closed(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _grammar_of_schema(body: dict[str, Any]) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(body)


def _lark(rules: list[str]) -> str:
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")
    try:
        engine_grammar.check(grammar)
    except InvalidRequestError as e:
        raise InvalidRequest(f"cannot constrain this request: {e}") from None
    return grammar


def json_grammar(schema: dict[str, Any], where: str) -> str:
    """Output that is one JSON value matching `schema`; what cannot be enforced is a 400, never ignored."""
    return _lark([f"start: {_schema(schema, True, where)}"])


def tool_grammar(tools: list[dict[str, Any]], forced: bool | str, text_schema: dict[str, Any] | None = None) -> str:
    """The rest of an answer that may (auto) or must (forced) be a tool call.

    Args:
        tools: {"name", "parameters", "strict"} per declared tool.
        forced: False (auto: free text, or text then one call), True (any tool: the prompt ends with
            `<tool_call>\\n{"name": "`), or a tool name (the prompt ends with its `"arguments": `).
        text_schema: with auto, an answer that is not a call must be JSON matching this schema.
    """
    args = {t["name"]: _schema(t.get("parameters") or {"type": "object"}, bool(t.get("strict")),
                               f"tools.{i}.input_schema ({t['name']})") for i, t in enumerate(tools)}
    rules = [f"call_{i}: {_lit(name + tool_fmt.ARGUMENTS)} {body}" for i, (name, body) in enumerate(args.items())]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(args))))
    if isinstance(forced, str):
        return _lark([f"start: {args[forced]} {_lit(tool_fmt.CALL_END)}"])
    if forced:
        return _lark([f"start: call {_lit(tool_fmt.CALL_END)}", *rules])
    if text_schema is not None:
        text = f"answer: {_schema(text_schema, True, 'output format')}"
    else:  # free text, possibly none (an answer may end at once, as without tools)
        text = f"answer: TEXT?\nTEXT: {_TEXT}"
    return _lark([f"start: answer | OPEN {_lit(tool_fmt.CALL_START)} call {_lit(tool_fmt.CALL_END)}", text,
                  f"OPEN: {_TEXT_THEN_OPEN}", *rules])


def answer_grammar(chat, prompt) -> str | None:
    """The grammar a request's answer must follow, or None when it is free.

    Args:
        chat: the request (`chat.ChatInput`): its tools, tool choice and output schema.
        prompt: the rendered prompt (`chat.Prompt`): whether it ends inside a forced call, and for which tool.
    """
    if chat.tools:
        forced = prompt.forced_name or prompt.is_forced_tool
        return tool_grammar(chat.tools, forced, chat.output_schema)
    if chat.output_schema is not None:
        return json_grammar(chat.output_schema, "output format")
    return None
