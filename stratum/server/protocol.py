"""Request bodies, as pydantic models that mirror the Anthropic and OpenAI API references."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
MAX_N = 16  # samples per request on the OpenAI endpoints


def _check_object_schema(v: dict[str, Any]) -> dict[str, Any]:
    if v.get("type") != "object":
        raise ValueError("a tool's schema must have type 'object'")
    return v


def _check_messages(messages: list, tools: list | None) -> None:
    """Anthropic's rules: non-empty content except a final assistant turn; unique tool names."""
    for i, m in enumerate(messages):
        if not m.content and not (i == len(messages) - 1 and m.role == "assistant"):
            raise ValueError(f"messages.{i}: content must be non-empty (only a final assistant message may be empty)")
    names = [t.name for t in tools or []]
    if len(names) != len(set(names)):
        raise ValueError("tools: tool names must be unique")


class _Strict(BaseModel):
    # strict: "8" is not an int and true is not a number, as in the real APIs (whole numbers still pass as floats)
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Any = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    """Extended thinking from a recorded conversation: accepted, and left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                         Field(discriminator="type")]
_TEXT_ONLY = {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}


def _refuse_media(blocks: Any, known: set[str], where: str = "content") -> None:
    """Name a content block this text-only model cannot read (image, document, ...), rather than
    letting validation say that the content should have been a string."""
    if not isinstance(blocks, list):
        return
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in known:
            raise PydanticCustomError("unsupported_content", "{where}.{j}: content blocks of type {kind} are not "
                                      "supported: this model is text-only", {"where": where, "j": j, "kind": repr(kind)})
        if kind == "tool_result":
            _refuse_media(block.get("content"), {"text"}, f"{where}.{j}.content")


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_media(data.get("content"), _TEXT_ONLY)
        return data


class Tool(_Strict):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None  # the input always follows input_schema; strict also refuses what cannot be enforced

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_object_schema(v)


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JSONOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JSONOutputFormat | None = None
    effort: Any = None  # accepted for compatibility; no effect on a local model


class Metadata(_Strict):
    user_id: str | None = Field(default=None, max_length=256)


class MessagesRequest(_Strict):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int = Field(ge=0)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    ignore_eos: bool = False  # vLLM's extension, for benchmarks
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # extension: reproducible sampling
    # Accepted for compatibility and ignored: no effect on a local model.
    service_tier: str | None = None
    thinking: Any = None
    container: Any = None
    mcp_servers: Any = None
    output_config: OutputConfig | None = None  # structured outputs: format {"type": "json_schema", "schema": ...}
    output_format: JSONOutputFormat | None = None  # the same, as the structured-outputs-2025-11-13 beta named it

    @property
    def output_schema(self) -> dict[str, Any] | None:
        fmt = (self.output_config.format if self.output_config else None) or self.output_format
        return fmt.schema_ if fmt else None

    @model_validator(mode="after")
    def _rules(self):
        _check_messages(self.messages, self.tools)
        return self


class CountTokensRequest(_Strict):
    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Any = None

    @model_validator(mode="after")
    def _rules(self):
        _check_messages(self.messages, self.tools)
        return self


# ---- OpenAI chat completions ---------------------------------------------------------------------
class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class OAIContentPart(_Loose):
    type: Literal["text"]
    text: str


class OAIFunctionCall(_Loose):
    name: str
    arguments: str


class OAIToolCall(_Loose):
    id: str
    type: Literal["function"] = "function"
    function: OAIFunctionCall


class OAIMessage(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[OAIContentPart] | None = None
    tool_calls: list[OAIToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_media(data.get("content"), {"text"})
        return data


class OAIFunction(_Loose):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_object_schema(v)


class OAITool(_Loose):
    type: Literal["function"]
    function: OAIFunction


class OAIFunctionName(_Loose):
    name: str


class OAINamedToolChoice(_Loose):
    type: Literal["function"]
    function: OAIFunctionName


class OAIStreamOptions(_Loose):
    include_usage: bool = False


class OAIJSONSchema(_Loose):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class OAIResponseFormat(_Loose):
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


class _Sampled(_Loose):
    """What the OpenAI endpoints share: sampling, n samples, log-probabilities."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: OAIStreamOptions | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: bool = False


class ChatCompletionRequest(_Sampled):
    model: str = Field(min_length=1, max_length=256)
    messages: list[OAIMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    tools: list[OAITool] | None = None
    tool_choice: Literal["none", "auto", "required"] | OAINamedToolChoice | None = None
    response_format: OAIResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self


class CompletionRequest(_Sampled):
    """The legacy OpenAI completions endpoint: a prompt string (or token ids) continued as is."""

    model: str = Field(min_length=1, max_length=256)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _rules(self):
        if self.suffix:
            raise ValueError("suffix is not supported: the model has no fill-in-the-middle mode")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


# ---- Message Batches -----------------------------------------------------------------------------
class BatchRequestItem(_Strict):
    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any]  # a Messages request; validated when it runs (an invalid one is an errored result)


class BatchCreateRequest(_Strict):
    requests: list[BatchRequestItem] = Field(min_length=1, max_length=100_000)
