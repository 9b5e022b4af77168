"""OpenAI's chat completions and (legacy) completions request bodies, mirroring its API reference."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from stratum.server.protocol.common import (MAX_COUNT, SEED_MAX, SEED_MIN, TOOL_NAME, Loose, by_type,
                                            check_object_schema, refuse_media, str_or_list)

MAX_N = 16  # samples per request on the OpenAI endpoints
MAX_STOP = 4  # stop sequences per request: OpenAI's limit
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # OpenAI's range for frequency and presence penalties


class OAITextPart(Loose):
    type: Literal["text"]
    text: str


class OAIRefusalPart(Loose):
    """An assistant's refusal, from an earlier turn: read as its text."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


OAIContentPart = Annotated[Union[OAITextPart, OAIRefusalPart], Field(discriminator="type")]


class OAIFunctionCall(Loose):
    name: str
    arguments: str


class OAIFunctionToolCall(Loose):
    id: str
    type: Literal["function"] = "function"
    function: OAIFunctionCall


class OAICustomCall(Loose):
    name: str
    input: str


class OAICustomToolCall(Loose):
    """A custom (freeform) tool's call from an earlier turn: its raw input."""

    id: str
    type: Literal["custom"]
    custom: OAICustomCall


def _call_kind(v: Any) -> str | None:
    return (v.get("type") or "function") if isinstance(v, dict) else None  # `type` may be left out of a function call


OAIToolCall = Annotated[Union[Annotated[OAIFunctionToolCall, Tag("function")],
                              Annotated[OAICustomToolCall, Tag("custom")]],
                        Discriminator(_call_kind, custom_error_type="call_type",
                                      custom_error_message="Input should be a function or custom tool call")]


class OAIMessage(Loose):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: the deprecated tool turn
    content: str_or_list(OAIContentPart, "a list of content parts") | None = None
    tool_calls: list[OAIToolCall] | None = None
    function_call: OAIFunctionCall | None = None  # deprecated: one call, before tool_calls
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's thought, sent back (vLLM, llama-server, DeepSeek)
    reasoning: str | None = None  # the same, as newer vLLM names it

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_media(data.get("content"), {"text", "refusal"})
        return data

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])


class OAIFunction(Loose):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_object_schema(v)


class OAIFunctionTool(Loose):
    type: Literal["function"]
    function: OAIFunction


class OAIGrammar(Loose):
    definition: str = Field(min_length=1)
    syntax: Literal["lark", "regex"]


class OAICustomFormat(Loose):
    type: Literal["text", "grammar"]
    grammar: OAIGrammar | None = None

    @model_validator(mode="after")
    def _grammar_given(self):
        if self.type == "grammar" and self.grammar is None:
            raise ValueError("a custom tool's format of type grammar needs grammar")
        return self


class OAICustom(Loose):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    format: OAICustomFormat | None = None


class OAICustomTool(Loose):
    """A custom (freeform) tool: the model writes its input as raw text (in its grammar, where it has one)."""

    type: Literal["custom"]
    custom: OAICustom

    @property
    def format(self) -> dict[str, Any]:
        fmt = self.custom.format
        if fmt is None or fmt.type == "text":
            return {"type": "text"}
        return {"type": "grammar", "syntax": fmt.grammar.syntax, "definition": fmt.grammar.definition}


OAITool = Annotated[Union[OAIFunctionTool, OAICustomTool], Field(discriminator="type")]


class OAIFunctionName(Loose):
    name: str


class OAINamedToolChoice(Loose):
    """{"type": "function", "function": {"name"}} or {"type": "custom", "custom": {"name"}}."""

    type: Literal["function", "custom"]
    function: OAIFunctionName | None = None
    custom: OAIFunctionName | None = None

    @model_validator(mode="after")
    def _named(self):
        if (self.function if self.type == "function" else self.custom) is None:
            raise ValueError(f"tool_choice of type {self.type} needs {self.type}.name")
        return self

    @property
    def name(self) -> str:
        return (self.function if self.type == "function" else self.custom).name


class OAIAllowed(Loose):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class OAIAllowedTools(Loose):
    """{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}: only those of `tools` are offered."""

    type: Literal["allowed_tools"]
    allowed_tools: OAIAllowed


OAIToolChoice = Annotated[
    Union[Annotated[Literal["none", "auto", "required"], Tag("#str")], Annotated[OAINamedToolChoice, Tag("function")],
          Annotated[OAINamedToolChoice, Tag("custom")], Annotated[OAIAllowedTools, Tag("allowed_tools")]],
    Discriminator(by_type, custom_error_type="choice_type",
                  custom_error_message="Input should be 'none', 'auto', 'required' or an object")]


class OAIStreamOptions(Loose):
    include_usage: bool = False


class OAIJSONSchema(Loose):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class OAIResponseFormat(Loose):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: OAIJSONSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self

    @property
    def schema(self) -> dict[str, Any] | None:
        """The schema the output must match (`strict` or not: what cannot be enforced is refused), or
        None for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_
        return None


class _Sampled(Loose):
    """What the OpenAI endpoints share: sampling, n samples, log-probabilities."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=SEED_MAX)  # beyond the vocabulary: no filter
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: OAIStreamOptions | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: bool = False
    # Checked as OpenAI checks them, and without effect: the sampler has no penalties or biases.
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise PydanticCustomError("too_many_stops", "at most {most} stop sequences, got {n}",
                                      {"most": MAX_STOP, "n": len(v)})
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        for key in v or {}:
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_COUNT):
                raise PydanticCustomError("bias_key", "keys must be token ids, got {key}", {"key": repr(key[:32])})
        return v


class ChatCompletionRequest(_Sampled):
    model: str = Field(min_length=1, max_length=256)
    messages: list[OAIMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    tools: list[OAITool] | None = None
    tool_choice: OAIToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer
    response_format: OAIResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # a reasoning model's thought: "none" turns it off, the others are budgets (server/reasoning.py)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self


TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # beyond any vocabulary; the engine checks its own size


class CompletionRequest(_Sampled):
    """The legacy OpenAI completions endpoint: a prompt string (or token ids) continued as is."""

    model: str = Field(min_length=1, max_length=256)
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(default=16, ge=0, le=MAX_COUNT)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _rules(self):
        if self.suffix:
            raise ValueError("suffix is not supported: the model has no fill-in-the-middle mode")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self
