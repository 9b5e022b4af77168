"""Grammars for what an answer must look like: a tool call, or JSON that matches a schema.

The serving side writes the grammar (llguidance's Lark-like syntax, JSON schemas inline with
`%json`); the engine masks every sampled token with it (`stratum.engine.grammar`). A tool call is
written in the model family's format (`tools.ToolFormat`), e.g. Hermes:

    <tool_call>\n{"name": "NAME", "arguments": ARGUMENTS}\n</tool_call>

with NAME one of the declared tools and ARGUMENTS valid against that tool's schema; one call or
several, as the request allows (`parallel_tool_calls`, `disable_parallel_tool_use`). JSON is written
with the separators `json.dumps` uses (", " and ": "), the form the model sees its tools in.
"""

from __future__ import annotations

import json
import re
from typing import Any

from stratum.engine import grammar as engine_grammar
from stratum.engine.sampling_params import InvalidRequestError
from stratum.server import tools as tool_fmt
from stratum.server.errors import InvalidRequest

_JSON_FORM = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


def _seq(text: str, fmt: tool_fmt.ToolFormat) -> str:
    """text as a Lark sequence: the format's special-token markers as tokens (<[id]>), the rest as literals."""
    tokens = dict(fmt.special_tokens)
    parts = re.split("(" + "|".join(map(re.escape, tokens)) + ")", text) if tokens else [text]
    return " ".join(f"<[{tokens[p]}]>" if p in tokens else _lit(p) for p in parts if p)


def _regex(text: str) -> str:
    """text as a literal inside a Lark /regex/ (Rust regex syntax, with / as the delimiter)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}/])", r"\\\1", text)


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


def _lark(rules: list[str], subgrammars: dict[str, str] | None = None) -> str:
    """The grammar of `rules`, with the named Lark `subgrammars` its rules reference as @NAME (a custom
    tool's grammar keeps a lexer of its own that way: it is never parsed into these rules)."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")
    if subgrammars:
        grammar = json.dumps({"grammars": [{"lark_grammar": grammar},
                                           *({"name": name, "lark_grammar": lark}
                                             for name, lark in subgrammars.items())]})
    try:
        engine_grammar.check(grammar)
    except InvalidRequestError as e:
        raise InvalidRequest(f"cannot constrain this request: {e}") from None
    return grammar


def json_grammar(schema: dict[str, Any], where: str) -> str:
    """Output that is one JSON value matching `schema`; what cannot be enforced is a 400, never ignored."""
    return _lark([f"start: {_schema(schema, True, where)}"])


def _custom_input(tool: dict[str, Any], i: int, subgrammars: dict[str, str]) -> str:
    """A custom tool's raw input: any text, or text its Lark grammar or regex accepts (as a subgrammar).

    Raises:
        InvalidRequest: the grammar does not compile, naming the tool.
    """
    import llguidance

    fmt = tool["format"]
    if fmt.get("type") != "grammar":
        return "/(?s:.*)/"
    lark = fmt["definition"] if fmt["syntax"] == "lark" else f"start: /{llguidance.regex_to_lark(fmt['definition'])}/"
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(lark)
    if is_error:
        raise InvalidRequest(f"tools ({tool['name']}): format.definition is not a valid {fmt['syntax']} grammar: "
                             f"{messages[0] if messages else 'it does not compile'}"[:1000])
    subgrammars[f"tool_{i}"] = lark
    return f"@tool_{i}"


def _calls(first: dict[str, list[str]], rest: dict[str, str], sep: str, end: str, parallel: bool) -> str:
    """The calls of an answer, from the first one's alternatives (`first["function"]`,
    `first["custom"]`) on: function calls closed by `end`, several joined by `sep` where `parallel`; a
    custom call's raw input runs to the end of the answer, so it can only come last."""
    opts = []
    f, c = " | ".join(first["function"]), " | ".join(first["custom"])
    if f:
        opts.append(f"({f}) ({sep} {rest['function']})* {end}" if parallel else f"({f}) {end}")
    if c:
        opts.append(f"({c})")
    if parallel and f and rest["custom"]:
        opts.append(f"({f}) ({sep} {rest['function']})* {sep} {rest['custom']}" if rest["function"]
                    else f"({f}) {sep} {rest['custom']}")
    return " | ".join(opts)


def tool_grammar(tools: list[dict[str, Any]], forced: bool | str, text_schema: dict[str, Any] | None = None,
                 fmt: tool_fmt.ToolFormat = tool_fmt.HERMES, parallel: bool = True) -> str:
    """The rest of an answer that may (auto) or must (forced) be tool calls, in the family's format.

    Args:
        tools: {"name", "parameters", "strict"} per declared function tool; {"name", "format"} per custom
            (freeform) tool, whose call is its head (`name`, `fmt.arguments`) then its raw input.
        forced: False (auto: free text, or calls where the format allows them), True (any tool: the
            prompt ends with `fmt.forced_prefix(None)`), or a tool name (the prompt ends with
            `fmt.forced_prefix(name)`, right before the arguments; every call is to that tool).
        text_schema: with auto, an answer that is not a call must be JSON matching this schema.
        fmt: the model family's tool-call format.
        parallel: one or more calls (written as `fmt` writes several); False: exactly one.
    """
    subgrammars: dict[str, str] = {}
    bodies = {t["name"]: _custom_input(t, i, subgrammars) if "format" in t else
              _schema(t.get("parameters") or {"type": "object"}, bool(t.get("strict")),
                      f"tools.{i}.input_schema ({t['name']})")
              for i, t in enumerate(tools)}
    kinds = {t["name"]: "custom" if "format" in t else "function" for t in tools}
    many = parallel and fmt.parallel
    sep, end = _seq(fmt.call_end + fmt.between + fmt.call_start, fmt), _seq(fmt.call_end + fmt.close, fmt)
    rules = [f"call_{i}: {_seq(name + fmt.arguments, fmt)} {body}" for i, (name, body) in enumerate(bodies.items())]
    rest = {}
    for kind in ("function", "custom"):
        names = [f"call_{i}" for i, name in enumerate(bodies) if kinds[name] == kind]
        rest[kind] = f"{kind}_call" if names else ""
        rules += [f"{kind}_call: " + " | ".join(names)] if names else []
    if isinstance(forced, str):
        if kinds[forced] == "custom":
            return _lark([f"start: {bodies[forced]}", *rules], subgrammars)
        more = f"({sep} {_seq(forced + fmt.arguments, fmt)} {bodies[forced]})* " if many else ""
        return _lark([f"start: {bodies[forced]} {more}{end}", *rules], subgrammars)
    first = {kind: [rest[kind]] if rest[kind] else [] for kind in rest}
    if forced:
        return _lark([f"start: {_calls(first, rest, sep, end, many)}", *rules], subgrammars)
    if text_schema is not None:
        text = f"answer: {_schema(text_schema, True, 'output format')}"
    else:  # free text, possibly none (an answer may end at once, as without tools)
        text = "answer: TEXT?"
    if fmt.text_before:
        # free text that never holds the opening tag, and free text that ends at its first opening tag:
        # two lexemes, so the lexer decides at the tag itself, with no lookahead
        tag = _regex(fmt.open)
        lexemes = [f"TEXT: /(?s:.+)/ & ~/(?s:.*{tag}.*)/", f"OPEN: /(?s:.*){tag}/ & ~/(?s:.*{tag}.+)/"]
        call = f"OPEN {_lit(fmt.call_start)} ({_calls(first, rest, sep, end, many)})"
    else:  # the calls are the whole answer: text is what `tools` would not read as their beginning
        lexemes = [f"TEXT: /(?s:.+)/ & ~/(?s:{fmt.first_head.pattern}.*)/"]
        lead = f"{_seq(fmt.lead, fmt)}? " if fmt.lead in dict(fmt.special_tokens) else ""
        # the first call's head is one lexeme from the opening through its name and `arguments`: TEXT
        # only ends there (where `first_head` matches), and the lexer cannot take back what it gave TEXT
        heads = {name: f"first_{i}" for i, name in enumerate(bodies)}
        rules += [f"first_{i}: {_seq(fmt.open + fmt.call_start + name + fmt.arguments, fmt)} {body}"
                  for i, (name, body) in enumerate(bodies.items())]
        first = {kind: [heads[n] for n in bodies if kinds[n] == kind] for kind in ("function", "custom")}
        call = f"{lead}({_calls(first, rest, sep, end, many)})"
    return _lark([f"start: answer | {call}", text, *lexemes, *rules], subgrammars)


def answer_grammar(chat, prompt) -> str | None:
    """The grammar a request's answer must follow, or None when it is free.

    Args:
        chat: the request (`chat.ChatInput`): its tools, tool choice and output schema.
        prompt: the rendered prompt (`chat.Prompt`): whether it ends inside a forced call, and for which tool.
    """
    if chat.tools:
        forced = prompt.forced_name or prompt.is_forced_tool
        return tool_grammar(chat.tools, forced, chat.output_schema, prompt.tool_format, prompt.parallel_calls)
    if chat.output_schema is not None:
        return json_grammar(chat.output_schema, "output format")
    return None
