"""Chat templates: the model's own Jinja template rendered with Hugging Face semantics.

Message text is never spliced into the template's output as a string to be re-tokenized with
special tokens on. Each piece of user-supplied text is rendered as a unique placeholder; special
tokens are then read from the template's own text only, and the text between them is encoded as
plain text.
"""

from __future__ import annotations

import json
import re
import uuid
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


class ChatTemplateError(ValueError):
    """The template could not render these messages (it raised, or referenced missing fields)."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str | None, tokenizer: TextTokenizer):
        self.source = source or DEFAULT_TEMPLATE
        self.tokenizer = tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(self.source)

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
        """Render to text, exactly as `transformers.apply_chat_template(tokenize=False)` would."""
        try:
            return self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.tokenizer.bos_token or "",
                eos_token=self.tokenizer.eos_token or "",
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
    ) -> list[int]:
        """Render and tokenize, treating every message string as plain text.

        Args:
            continue_final: the last message is an assistant prefill; the prompt stops right after
                its text instead of closing the turn.
            suffix: the server's own text to end the prompt with (a forced tool call's opening),
                tokenized as template text: its special tokens are read.
        """
        marker = uuid.uuid4().hex
        pieces: dict[str, str] = {}

        def hide(text: str) -> str:
            key = f"@@{marker}{len(pieces)}@@"
            pieces[key] = text
            return key

        hidden = [_hide_strings(m, hide) for m in messages]
        tail_key = None
        if continue_final and hidden:
            tail_key = hidden[-1].get("content") if isinstance(hidden[-1].get("content"), str) else None
        text = self.render(hidden, tools=_hide_strings(tools, hide) if tools else None,
                           add_generation_prompt=add_generation_prompt and not continue_final)
        if tail_key is not None:
            text = text[: text.rindex(tail_key) + len(tail_key)]
        text += suffix
        # Special tokens are read from the template's text only. The text between two of them (template
        # text and user text alike) is encoded as one run, as tokenizing the whole rendered prompt would:
        # cut at the placeholders instead, a SentencePiece vocabulary would begin each piece with a
        # dummy-prefix space, and any vocabulary could lose a merge across the cut.
        ids: list[int] = []
        run = ""
        for part in re.split(f"(@@{marker}\\d+@@)", text):
            if part in pieces:
                run += pieces[part]
                continue
            for before, special_id in self.tokenizer.split_special(part):
                run += before
                if special_id is not None:
                    ids += self.tokenizer.encode(run)
                    ids.append(special_id)
                    run = ""
        return ids + self.tokenizer.encode(run)


def _hide_strings(value: Any, hide) -> Any:
    """Replace message and tool strings (not role names or keys) with placeholders."""
    if isinstance(value, dict):
        return {k: (v if k in ("role", "type", "name") else _hide_strings(v, hide)) for k, v in value.items()}
    if isinstance(value, list):
        return [_hide_strings(v, hide) for v in value]
    if isinstance(value, str):
        return hide(value)
    return value
