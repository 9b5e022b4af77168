"""Request bodies, as pydantic models that mirror the Anthropic and OpenAI API references."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
MAX_N = 16  # samples per request on the OpenAI endpoints


def _check_object_schema(v: dict[str, Any]) -> dict[str, Any]:
    if v.get("type") != "object":
        raise ValueError("a tool's schema must have type 'object'")
    return v


def _check_messages(messages: list, tools: list | None) -> None:
    """Anthropic's rules: non-empty content except a final assistant turn; unique tool names; and the
    placement of system-role messages in `messages` (not first, right after a user turn, then the end
    or an assistant turn, never two in a row)."""
    for i, m in enumerate(messages):
        if not m.content and not (i == len(messages) - 1 and m.role == "assistant"):
            raise ValueError(f"messages.{i}: content must be non-empty (only a final assistant message may be empty)")
        if m.role != "system":
            continue
        if i == 0:
            raise ValueError("messages.0: a system message cannot come first; use the top-level system field")
        if messages[i - 1].role != "user" and not _ends_in_server_tool_use(messages[i - 1]):
            raise ValueError(f"messages.{i}: a system message must follow a user message")
        if i + 1 < len(messages) and messages[i + 1].role != "assistant":
            raise ValueError(f"messages.{i}: a system message must be the last message or be followed by an assistant message")
    names = [t.name for t in tools or []]
    if len(names) != len(set(names)):
        raise ValueError("tools: tool names must be unique")


def _ends_in_server_tool_use(message) -> bool:
    return (message.role == "assistant" and isinstance(message.content, list) and bool(message.content)
            and message.content[-1].type == "server_tool_use")


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


class PlainTextSource(_Strict):
    type: Literal["text"]
    media_type: Literal["text/plain"]
    data: str


class ContentSource(_Strict):
    type: Literal["content"]
    content: str | list[TextBlock]


class DocumentBlock(_Strict):
    """A document the model reads as text: plain text, or a list of text blocks (PDFs are refused)."""

    type: Literal["document"]
    source: Annotated[Union[PlainTextSource, ContentSource], Field(discriminator="type")]
    title: str | None = None
    context: str | None = None
    citations: Any = None
    cache_control: CacheControl | None = None


class SearchResultBlock(_Strict):
    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]
    citations: Any = None
    cache_control: CacheControl | None = None


class ToolReferenceBlock(_Strict):
    type: Literal["tool_reference"]
    tool_name: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Any = None


ToolResultContent = Annotated[Union[TextBlock, SearchResultBlock, DocumentBlock, ToolReferenceBlock],
                              Field(discriminator="type")]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultContent] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class ServerToolUseBlock(_Strict):
    """A call of one of Anthropic's server tools (web search, code execution...) in a recorded turn."""

    type: Literal["server_tool_use", "mcp_tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    server_name: str | None = None
    cache_control: CacheControl | None = None
    caller: Any = None


SERVER_TOOL_RESULTS = ("web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                       "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                       "tool_search_tool_result", "mcp_tool_result")


class ServerToolResultBlock(_Strict):
    """A server tool's result in a recorded turn: read by the model as the JSON of its content."""

    type: Literal[SERVER_TOOL_RESULTS]
    tool_use_id: str
    content: Any = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    caller: Any = None


class ThinkingBlock(_Strict):
    """Extended thinking from a recorded conversation: accepted, and left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


class ContainerUploadBlock(_Strict):
    """A file uploaded to a code-execution container: there is no container here, so it adds nothing."""

    type: Literal["container_upload"]
    file_id: str
    cache_control: CacheControl | None = None


ContentBlock = Annotated[Union[TextBlock, DocumentBlock, SearchResultBlock, ToolUseBlock, ToolResultBlock,
                               ServerToolUseBlock, ServerToolResultBlock, ThinkingBlock, RedactedThinkingBlock,
                               ContainerUploadBlock], Field(discriminator="type")]
_READABLE = {"text", "document", "search_result", "tool_use", "tool_result", "server_tool_use", "mcp_tool_use",
             *SERVER_TOOL_RESULTS, "thinking", "redacted_thinking", "container_upload"}
_TOOL_RESULT_READABLE = {"text", "search_result", "document", "tool_reference"}


def _refuse_media(blocks: Any, known: set[str], where: str = "content") -> None:
    """Name a content block this text-only model cannot read (an image, a PDF), rather than letting
    validation say that the content should have been a string."""
    if not isinstance(blocks, list):
        return
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in known:
            raise PydanticCustomError("unsupported_content", "{where}.{j}: content blocks of type {kind} are not "
                                      "supported: this model is text-only", {"where": where, "j": j, "kind": repr(kind)})
        if kind == "document":
            source = block.get("source")
            source_type = source.get("type") if isinstance(source, dict) else None
            if isinstance(source_type, str) and source_type not in ("text", "content"):
                raise PydanticCustomError(
                    "unsupported_content", "{where}.{j}: documents with a source of type {kind} are not supported: "
                    "this model is text-only (it reads documents with a 'text' or 'content' source)",
                    {"where": where, "j": j, "kind": repr(source_type)})
            if source_type == "content":
                _refuse_media(source.get("content"), {"text"}, f"{where}.{j}.source.content")
        if kind == "tool_result":
            _refuse_media(block.get("content"), _TOOL_RESULT_READABLE, f"{where}.{j}.content")


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]
    cache_control: CacheControl | None = None  # a system message's breakpoint, as the top-level system's blocks

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_media(data.get("content"), {"text"} if data.get("role") == "system" else _READABLE)
        return data


class Tool(_Strict):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None  # the input always follows input_schema; strict also refuses what cannot be enforced
    # Accepted and ignored: arguments always stream as generated, the tool is always offered, no
    # server-side code calls it, and examples are not shown to the model.
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    input_examples: list[dict[str, Any]] | None = None

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
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no effect on a local model


class ThinkingConfig(_Strict):
    """Extended thinking: accepted, no effect (this model has no thinking mode, so none is returned)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=0)
    display: Any = None


class Metadata(_Strict):
    user_id: str | None = Field(default=None, max_length=256)


def _split_tools(data: Any) -> Any:
    """Anthropic-defined tools (a `type` other than "custom": web search, bash, text editor, MCP
    toolsets...) have no schema a local model knows: they go to `anthropic_tools`, are not offered to
    the model, and the custom tools keep their checks."""
    if isinstance(data, dict) and isinstance(data.get("tools"), list):
        tools = data["tools"]
        defined = [t for t in tools if isinstance(t, dict) and t.get("type") not in (None, "custom")]
        if defined:
            data = {**data, "tools": [t for t in tools if not any(t is d for d in defined)], "anthropic_tools": defined}
    return data


class _Prompted(_Strict):
    """What makes a Messages prompt, shared by /v1/messages and /v1/messages/count_tokens, so both
    count the same tokens. Fields of the Anthropic API that a local model has no use for are accepted
    and ignored (README: "Accepted and ignored")."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    anthropic_tools: list[dict[str, Any]] | None = None  # Anthropic-defined tools, not offered to this model
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # structured outputs: format {"type": "json_schema", "schema": ...}
    output_format: JSONOutputFormat | None = None  # the same, as the structured-outputs-2025-11-13 beta named it
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint at the end of the messages
    # Accepted for compatibility and ignored: no effect on a local model.
    context_management: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    container: str | dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    diagnostics: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _anthropic_tools(cls, data: Any) -> Any:
        return _split_tools(data)

    @property
    def output_schema(self) -> dict[str, Any] | None:
        fmt = (self.output_config.format if self.output_config else None) or self.output_format
        return fmt.schema_ if fmt else None

    @model_validator(mode="after")
    def _rules(self):
        _check_messages(self.messages, self.tools)
        return self


class MessagesRequest(_Prompted):
    max_tokens: int = Field(ge=0)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extension, for benchmarks
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # extension: reproducible sampling
    # Accepted for compatibility and ignored: no effect on a local model.
    service_tier: str | None = None
    inference_geo: str | None = None


class CountTokensRequest(_Prompted):
    pass


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
    parallel_tool_calls: bool | None = None  # false: at most one call per answer
    response_format: OAIResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

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


# ---- OpenAI Responses -----------------------------------------------------------------------------
class RespInputText(_Loose):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RespMessage(_Loose):
    """A message input item (`type` "message", or an "easy" message without it)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[RespInputText]


class RespFunctionCall(_Loose):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class RespFunctionCallOutput(_Loose):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[RespInputText]


class RespReasoning(_Loose):
    """A reasoning item from an earlier turn: accepted, and left out of the prompt (as thinking is)."""

    type: Literal["reasoning"]


_RESP_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


def _input_item_kind(v: Any) -> str:
    return (v.get("type") or "message") if isinstance(v, dict) else "message"


RespInputItem = Annotated[Union[
    Annotated[RespMessage, Tag("message")], Annotated[RespFunctionCall, Tag("function_call")],
    Annotated[RespFunctionCallOutput, Tag("function_call_output")], Annotated[RespReasoning, Tag("reasoning")],
], Discriminator(_input_item_kind)]


class RespFunctionTool(_Loose):
    type: Literal["function"]
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return v if v is None else _check_object_schema(v)


class RespNamedToolChoice(_Loose):
    type: Literal["function"]
    name: str


class RespTextFormat(_Loose):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self


class RespTextConfig(_Loose):
    format: RespTextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Loose):
    """POST /v1/responses. Fields of the API that need stored state (previous_response_id,
    conversation, background) are refused; others a local model has no use for are ignored."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[RespInputItem]
    instructions: str | None = None
    tools: list[RespFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | RespNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: RespTextConfig | None = None
    stream: bool = False
    store: bool | None = None  # nothing is stored here, whatever it says
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # extension, as on chat completions

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        items = data.get("input") if isinstance(data, dict) else None
        for i, item in enumerate(items if isinstance(items, list) else []):
            if isinstance(item, dict):
                kind = item.get("type", "message")
                if isinstance(kind, str) and kind not in _RESP_ITEMS:
                    raise PydanticCustomError("unsupported_content", "input.{i}: input items of type {kind} are not "
                                              "supported here (messages, function_call, function_call_output and "
                                              "reasoning are)", {"i": i, "kind": repr(kind)})
                field = "output" if kind == "function_call_output" else "content"
                _refuse_media(item.get(field), {"input_text", "output_text", "text"}, f"input.{i}.{field}")
        return data

    @model_validator(mode="after")
    def _rules(self):
        if self.previous_response_id is not None or self.conversation is not None:
            raise ValueError("previous_response_id and conversation are not supported: this server stores no "
                             "responses; send the whole conversation as input")
        if self.background:
            raise ValueError("background responses are not supported")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        return self

    @property
    def output_schema(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        return {"type": "object"} if fmt.type == "json_object" else fmt.schema_


# ---- Message Batches -----------------------------------------------------------------------------
class BatchRequestItem(_Strict):
    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any]  # a Messages request; validated when it runs (an invalid one is an errored result)


class BatchCreateRequest(_Strict):
    requests: list[BatchRequestItem] = Field(min_length=1, max_length=100_000)
