"""Request bodies, as pydantic models that mirror the Anthropic and OpenAI API references."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"


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


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    type: Literal["custom"] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_object_schema(v)


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


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


class OAIFunction(_Loose):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

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


class ChatCompletionRequest(_Loose):
    model: str = Field(min_length=1, max_length=256)
    messages: list[OAIMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: OAIStreamOptions | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    user: str | None = Field(default=None, max_length=256)
    tools: list[OAITool] | None = None
    tool_choice: Literal["none", "auto", "required"] | OAINamedToolChoice | None = None
    ignore_eos: bool = False
