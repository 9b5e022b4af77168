"""Ollama's request bodies (`/api/chat`, `/api/generate`, `/api/show`, `/api/embed`), mirroring its API
reference (docs/api.md in the ollama repository). Unknown fields are ignored, as Ollama's server ignores them."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from stratum.server.protocol.common import MAX_COUNT, SEED_MAX, TOOL_NAME, Loose, check_object_schema

FOREVER = math.inf  # a keep-alive that never runs out
# Go's time.ParseDuration units, which Ollama's keep_alive strings use ("5m", "1h30m", "-1s", "0"); a body's
# keep_alive is held to Go's form (`_DURATION`), a header's may also be a number of seconds
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION = re.compile(rf"^[-+]?(?:{_PART.pattern})+$|^[-+]?0$")


def keep_alive_seconds(value: float | int | str | None) -> float | None:
    """Ollama's keep_alive as seconds: a number of seconds or a Go duration ("5m", "1h30m"); negative
    is forever (`FOREVER`), 0 unloads after the request; None where none is given.

    Raises:
        ValueError: neither a number nor a duration.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign, body = (-1.0, text[1:]) if text[:1] == "-" else (1.0, text.lstrip("+"))
            parts = _PART.findall(body)
            if not body or "".join(a + u for a, u in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration (\"5m\", \"1h\", \"-1\") or seconds")
            seconds = sign * sum(float(a) * _UNIT_S[u] for a, u in parts)
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise ValueError("keep_alive is not a number")
    return FOREVER if seconds < 0 else seconds


class OllamaOptions(Loose):
    """`options`: the sampling the sampler has (temperature, top_p, top_k, seed, num_predict, stop), and
    the options Ollama names that it does not (min_p, the penalties, mirostat, num_ctx...), accepted
    and not applied (docs/api.md, "Ollama's API")."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, le=SEED_MAX)  # beyond the vocabulary: no filter
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    # -1: to the end of the context (-2: the same here)
    num_predict: int | None = Field(default=None, ge=-2, le=MAX_COUNT)
    stop: list[str] | str | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = None  # the context is the server's (`--max-model-len`)

    @property
    def max_tokens(self) -> int | None:
        """num_predict as max_tokens: None (to the context) for a negative one or none."""
        return None if self.num_predict is None or self.num_predict < 0 else self.num_predict


JSONFormat = Literal["", "json"] | dict[str, Any]
Think = bool | Literal["low", "medium", "high"]


class _Generating(Loose):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1, max_length=256)
    stream: bool = True  # Ollama streams unless told not to
    format: JSONFormat | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    keep_alive: float | str | None = None  # accepted: the model stays loaded as long as the server runs
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        """A null field is an absent one, as Go's decoder reads it (clients send `"options": null`)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, str) and not _DURATION.match(v.strip()):
            raise ValueError(f"keep_alive {v!r} is not a duration (\"5m\", \"1h\", \"-1\") or a number of seconds")
        return v

    @property
    def output_schema(self) -> dict[str, Any] | None:
        """The schema the answer must match: "json" is any JSON object (the root llama.cpp's JSON grammar has)."""
        if self.format == "json":
            return {"type": "object"}
        return self.format or None

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to report (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def is_unload(self) -> bool:
        return keep_alive_seconds(self.keep_alive) == 0


class OllamaFunctionCall(Loose):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(Loose):
    function: OllamaFunctionCall
    id: str | None = None


class OllamaMessage(Loose):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # the tool a result answers
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.images:
            raise ValueError("images are not supported: this model is text-only")
        return self


class OllamaFunction(Loose):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_object_schema(v)


class OllamaTool(Loose):
    type: Literal["function"] = "function"
    function: OllamaFunction


class OllamaChatRequest(_Generating):
    messages: list[OllamaMessage] = Field(default_factory=list)  # none: load the model and answer at once
    tools: list[OllamaTool] | None = None


class OllamaGenerateRequest(_Generating):
    prompt: str = ""  # empty (without context): load the model and answer at once
    system: str | None = None
    template: str | None = None
    # a previous answer's `context`: the conversation's tokens so far
    context: list[Annotated[int, Field(ge=0, le=MAX_COUNT)]] | None = None
    raw: bool = False  # the prompt as it is, no template
    suffix: str | None = None
    images: list[str] | None = None

    @model_validator(mode="after")
    def _rules(self):
        if self.images:
            raise ValueError("images are not supported: this model is text-only")
        if self.suffix:
            raise ValueError("suffix is not supported: the model has no fill-in-the-middle mode")
        if self.template:
            raise ValueError("template is not supported: prompts are rendered with the model's own chat template "
                             "(send raw: true with the prompt written out instead)")
        return self


class OllamaShowRequest(Loose):
    model: str = Field(min_length=1, max_length=256)
    verbose: bool = False

    @model_validator(mode="before")
    @classmethod
    def _name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" not in data and "name" in data:  # the field's older name
            return {**data, "model": data["name"]}
        return data


class OllamaEmbedRequest(Loose):
    """/api/embed's `input` and /api/embeddings' `prompt` (its older form)."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[str] | None = None
    prompt: str | None = None
    truncate: bool = True  # an input longer than the context is cut to it (Ollama's default), else refused
