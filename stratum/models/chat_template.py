"""Chat templates: the model's own Jinja template rendered with Hugging Face semantics.

Message text is never spliced into the template's output as a string to be re-tokenized with
special tokens on. Each piece of user-supplied text is rendered as a unique placeholder; special
tokens are then read from the template's own text only, and the text between them is encoded as
plain text. What the template does to a placeholder that must reach its text (escaping it into JSON
with `tojson`, `trim`) is recorded on the placeholder and done to the text when it is put back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stratum.models.tokenizer import TextTokenizer

# Used when a checkpoint carries no template (ChatML, as in SmolLM2 and Qwen).
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The markers reasoning families write their thought between (Qwen3, QwQ and DeepSeek-R1's distills;
# Magistral), as their templates spell them.
THOUGHT_MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))
THINKING_SWITCH = "enable_thinking"  # the template variable that turns thinking off (Qwen3's)


@dataclass(frozen=True, slots=True)
class ThoughtMarkers:
    """How a template's family writes its thought: between `start` and `end`; `has_switch`: the template
    reads `enable_thinking` (False renders the thought closed, as Qwen3's does)."""

    start: str
    end: str
    has_switch: bool


class ChatTemplateError(ValueError):
    """The template could not render these messages (it raised, or referenced missing fields)."""


def _raise(message: str):
    raise TemplateError(message)


# A placeholder: @@<marker><index><ops>@@, ops being what to do to its text, in order (see _OPS).
_PLACEHOLDER = re.compile(r"@@([0-9a-f]{32}\d+)([a-z]*)@@")
_OPS = {
    "j": lambda text: json.dumps(text, ensure_ascii=False)[1:-1],  # inside a JSON string (tojson)
    "a": lambda text: json.dumps(text, ensure_ascii=True)[1:-1],  # the same, tojson(ensure_ascii=true)
    "l": str.lstrip,  # at the start of a trimmed string
    "r": str.rstrip,  # at its end
}


def _mark(text: str, op: str) -> str:
    return _PLACEHOLDER.sub(lambda m: f"@@{m.group(1)}{m.group(2)}{op}@@", text)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' tojson; the placeholders in value end up inside JSON strings, so their text is escaped."""
    out = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return _mark(out, "a" if ensure_ascii else "j")


def _trim(value: Any, chars: str | None = None) -> str:
    """jinja's trim, reaching into the text of a placeholder at either end."""
    text = str(value).strip(chars)
    if chars is None:
        last = None
        for last in _PLACEHOLDER.finditer(text):
            pass
        if last is not None and last.end() == len(text):
            text = text[: last.start()] + _mark(last.group(0), "r")
        if first := _PLACEHOLDER.match(text):
            text = _mark(first.group(0), "l") + text[first.end():]
    return text


class ChatTemplate:
    def __init__(self, source: str | None, tokenizer: TextTokenizer):
        self.source = source or DEFAULT_TEMPLATE
        self.tokenizer = tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.filters["trim"] = _trim
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(self.source)

    @property
    def thought_markers(self) -> ThoughtMarkers | None:
        """How this template's model reasons, if it does: the first pair of `THOUGHT_MARKERS` the template
        writes (None: it writes none, so its model does not reason)."""
        for start, end in THOUGHT_MARKERS:
            if start in self.source and end in self.source:
                return ThoughtMarkers(start, end, THINKING_SWITCH in self.source)
        return None

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **variables: Any) -> str:
        """Render to text, exactly as `transformers.apply_chat_template(tokenize=False, **variables)` would
        (`variables`: what else the template reads, as `enable_thinking`)."""
        try:
            return self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.tokenizer.bos_token or "",
                eos_token=self.tokenizer.eos_token or "",
                **variables,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
        suffix: str = "",
        **variables: Any,
    ) -> list[int]:
        """Render and tokenize, treating every message string as plain text; the ids begin with BOS
        once where the tokenizer adds it (`TextTokenizer.add_bos`), whether or not the template writes it.

        Args:
            continue_final: the last message is an assistant prefill; the prompt stops right after
                its text instead of closing the turn.
            suffix: the server's own text to end the prompt with (a forced tool call's opening),
                tokenized as template text: its special tokens are read.
            variables: what else the template reads (`render`).
        """
        marker = uuid.uuid4().hex
        pieces: dict[str, str] = {}

        def hide(key: str | None, text: str) -> str:
            # names, roles, types and ids stay themselves (templates compare them, and Mistral's checks
            # an id's length) unless they hold a special token's text; empty text stays empty (falsy)
            if not text or key in _NAMES and len(self.tokenizer.split_special(text)) == 1:
                return text
            index = str(len(pieces))
            pieces[index] = text
            return f"@@{marker}{index}@@"

        hidden = [_hide_strings(m, hide) for m in messages]
        tail = None
        if continue_final and hidden and str(hidden[-1].get("content")).startswith("@@"):
            tail = re.escape(hidden[-1]["content"][:-2]) + "[a-z]*@@"  # the prefill's text, whatever ops it got
        text = self.render(hidden, tools=_hide_strings(tools, hide) if tools else None,
                           add_generation_prompt=add_generation_prompt and not continue_final, **variables)
        if tail is not None:
            ends = [m.end() for m in re.finditer(tail, text)]
            text = text[: ends[-1]] if ends else text
        text += suffix
        # Special tokens are read from the template's text only. The text between two of them (template
        # text and user text alike) is encoded as one run, as tokenizing the whole rendered prompt would:
        # cut at the placeholders instead, a SentencePiece vocabulary would begin each piece with a
        # dummy-prefix space, and any vocabulary could lose a merge across the cut.
        ids: list[int] = []
        run = ""
        parts = re.split(f"@@{marker}(\\d+)([a-z]*)@@", text)
        for i in range(0, len(parts), 3):
            for before, special_id in self.tokenizer.split_special(parts[i]):
                run += before
                if special_id is not None:
                    ids += self.tokenizer.encode(run)
                    ids.append(special_id)
                    run = ""
            if i + 1 < len(parts):
                piece = pieces[parts[i + 1]]
                for op in parts[i + 2]:
                    piece = _OPS[op](piece)
                run += piece
        # one BOS where the tokenizer adds it, as llama-server does: none more if the template wrote it
        return self.tokenizer.with_bos(ids + self.tokenizer.encode(run))


_NAMES = ("role", "type", "name", "id", "tool_call_id")


def _hide_strings(value: Any, hide, key: str | None = None) -> Any:
    """Replace message and tool strings (not keys) with placeholders: `hide(key, text)`."""
    if isinstance(value, dict):
        return {k: _hide_strings(v, hide, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_hide_strings(v, hide) for v in value]
    if isinstance(value, str):
        return hide(key, value)
    return value
