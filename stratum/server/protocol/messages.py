"""Anthropic's request bodies, mirroring its API reference: Messages (and count_tokens, which shares
its prompt), and Message Batches."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from stratum.server.protocol.common import (MAX_COUNT, SEED_MAX, SEED_MIN, TOOL_NAME, Strict, check_object_schema,
                                            refuse_media, str_or_list)


def _check_messages(messages: list, tools: list | None) -> None:
    """Anthropic's rules: non-empty content except a final assistant turn; unique tool names; and the
    placement of system-role messages in `messages` (not first, right after a user turn, then the end
    or an assistant turn, never two in a row)."""
    for i, m in enumerate(messages):
        if m.role == "system" and not m.content and m.output_config is None:
            raise ValueError(f"messages.{i}: a system message needs content or output_config")
        if not m.content and m.role != "system" and not (i == len(messages) - 1 and m.role == "assistant"):
            raise ValueError(f"messages.{i}: content must be non-empty (only a final assistant message may be empty)")
        if m.role != "system":
            continue
        if i == 0:
            raise ValueError("messages.0: a system message cannot come first; use the top-level system field")
        if messages[i - 1].role != "user" and not _ends_in_server_tool_use(messages[i - 1]):
            raise ValueError(f"messages.{i}: a system message must follow a user message")
        if i + 1 < len(messages) and messages[i + 1].role != "assistant":
            raise ValueError(f"messages.{i}: a system message must be the last message "
                             "or be followed by an assistant message")
    names = [t.name for t in tools or []]
    if len(names) != len(set(names)):
        raise ValueError("tools: tool names must be unique")


def _ends_in_server_tool_use(message) -> bool:
    return (message.role == "assistant" and isinstance(message.content, list) and bool(message.content)
            and message.content[-1].type == "server_tool_use")


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Any = None


class PlainTextSource(Strict):
    type: Literal["text"]
    media_type: Literal["text/plain"]
    data: str


class ContentSource(Strict):
    type: Literal["content"]
    content: str | list[TextBlock]


class DocumentBlock(Strict):
    """A document the model reads as text: plain text, or a list of text blocks (PDFs are refused)."""

    type: Literal["document"]
    source: Annotated[Union[PlainTextSource, ContentSource], Field(discriminator="type")]
    title: str | None = None
    context: str | None = None
    citations: Any = None
    cache_control: CacheControl | None = None


class SearchResultBlock(Strict):
    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]
    citations: Any = None
    cache_control: CacheControl | None = None


class ToolReferenceBlock(Strict):
    type: Literal["tool_reference"]
    tool_name: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Any = None
    toolset_name: str | None = None  # the MCP toolset the tool came from


ToolResultContent = Annotated[Union[TextBlock, SearchResultBlock, DocumentBlock, ToolReferenceBlock],
                              Field(discriminator="type")]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultContent] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class ServerToolUseBlock(Strict):
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
                       "tool_search_tool_result", "mcp_tool_result", "advisor_tool_result")


class ServerToolResultBlock(Strict):
    """A server tool's result in a recorded turn: read by the model as the JSON of its content."""

    type: Literal[SERVER_TOOL_RESULTS]
    tool_use_id: str
    content: Any = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    caller: Any = None


class ThinkingBlock(Strict):
    """A thought from an earlier turn: its signature must be the one this server gave it
    (`chat.check_thought_signatures`); it goes back to the model as its template reads a thought."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict):
    """Another model's encrypted thought: accepted, and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


class ContainerUploadBlock(Strict):
    """A file uploaded to a code-execution container: there is no container here, so it adds nothing."""

    type: Literal["container_upload"]
    file_id: str
    cache_control: CacheControl | None = None


class ToolChangeRef(Strict):
    """What a tool_addition / tool_removal names: a tool by name, a tool defined by value (a `tools`
    entry), or an MCP tool or toolset (no MCP server is reached from here: those change nothing)."""

    type: Literal["tool_reference", "tool_definition", "mcp_tool_reference", "mcp_toolset_reference"]
    name: str | None = None
    definition: dict[str, Any] | None = None
    server_name: str | None = None


class ToolChangeBlock(Strict):
    """A mid-conversation change of the tools offered (`tool_addition`, `tool_removal`): from here on the
    tool is offered, or not (`chat.offered_tools`)."""

    type: Literal["tool_addition", "tool_removal"]
    tool: ToolChangeRef
    cache_control: CacheControl | None = None


class CompactionBlock(Strict):
    """A summary of the conversation before it (read as text), and the tool changes of that range."""

    type: Literal["compaction"]
    content: str | None = None
    encrypted_content: str | None = None
    signature: str | None = None
    tool_changes: list[ToolChangeBlock] | None = None
    cache_control: CacheControl | None = None


class FallbackBlock(Strict):
    """Where a model declined and another took over, in a recorded turn: adds nothing to the prompt."""

    model_config = ConfigDict(populate_by_name=True)  # the SDK's model_dump() writes `from_`

    type: Literal["fallback"]
    from_: dict[str, Any] = Field(alias="from")
    to: dict[str, Any]
    trigger: Any = None


class MCPToolListingBlock(Strict):
    """An MCP server's tool listing from a recorded turn: adds nothing (no MCP server is reached here)."""

    type: Literal["mcp_tool_listing"]
    mcp_server_name: str
    tools: list[dict[str, Any]]


ContentBlock = Annotated[Union[TextBlock, DocumentBlock, SearchResultBlock, ToolUseBlock, ToolResultBlock,
                               ServerToolUseBlock, ServerToolResultBlock, ThinkingBlock, RedactedThinkingBlock,
                               ContainerUploadBlock, CompactionBlock, FallbackBlock, MCPToolListingBlock,
                               ToolChangeBlock], Field(discriminator="type")]
_READABLE = {"text", "document", "search_result", "tool_use", "tool_result", "server_tool_use", "mcp_tool_use",
             *SERVER_TOOL_RESULTS, "thinking", "redacted_thinking", "container_upload", "compaction", "fallback",
             "mcp_tool_listing", "tool_addition", "tool_removal"}
SystemBlock = Annotated[Union[TextBlock, ToolChangeBlock], Field(discriminator="type")]


class SystemOutputConfig(Strict):
    """A system message's per-turn output settings: effort, which has no effect on a local model."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Message(Strict):
    """A user, assistant or system message. A system message's blocks are text and tool changes; it may
    carry `output_config` (then its content may be left out) and `clear_at`."""

    role: Literal["user", "assistant", "system"]
    content: str_or_list(ContentBlock) | None = None
    cache_control: CacheControl | None = None  # a system message's breakpoint, as the top-level system's blocks
    output_config: SystemOutputConfig | None = None
    clear_at: Literal["next_user_message", "never"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            system = data.get("role") == "system"
            refuse_media(data.get("content"), {"text", "tool_addition", "tool_removal"} if system else _READABLE)
        return data

    @model_validator(mode="after")
    def _role_fields(self):
        if self.role != "system" and (self.output_config is not None or self.clear_at is not None):
            raise ValueError("output_config and clear_at are only permitted on role: \"system\" messages")
        if self.role != "system" and self.content is None:
            raise ValueError("content: Field required")
        return self


class Tool(Strict):
    name: str = Field(pattern=TOOL_NAME)
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
        return check_object_schema(v)


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JSONOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no effect on a local model


class ThinkingConfig(Strict):
    """Extended thinking (`chat.anthropic_thinking`): a reasoning model's thought returned as thinking
    blocks; a model that does not reason returns none."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1024, le=MAX_COUNT)  # Anthropic's least
    display: Any = None

    @model_validator(mode="after")
    def _budget(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking.enabled.budget_tokens: Field required")
        return self


class Metadata(Strict):
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


class _Prompted(Strict):
    """What makes a Messages prompt, shared by /v1/messages and /v1/messages/count_tokens, so both
    count the same tokens. Fields of the Anthropic API that a local model has no use for are accepted
    and ignored (docs/api.md: "Accepted and ignored")."""

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
    # up to int64: above the context `sampling.check_output_limit` answers in Anthropic's words (Claude Code reads them)
    max_tokens: int = Field(ge=0, le=SEED_MAX)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=SEED_MAX)  # beyond the vocabulary: no filter
    metadata: Metadata | None = None
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extension, for benchmarks
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # extension: reproducible sampling
    # Accepted for compatibility and ignored: no effect on a local model.
    service_tier: str | None = None
    inference_geo: str | None = None

    @model_validator(mode="after")
    def _thinking(self):
        """Anthropic's rules for a thought: its budget below max_tokens, and no forced tool use with it."""
        thinking, choice = self.thinking, self.tool_choice
        if thinking is not None and thinking.type == "enabled":
            if thinking.budget_tokens >= self.max_tokens:
                raise ValueError("`max_tokens` must be greater than `thinking.budget_tokens`")
            if choice is not None and choice.type in ("any", "tool"):
                raise ValueError("Thinking may not be enabled when tool_choice forces tool use.")
        return self


class CountTokensRequest(_Prompted):
    pass


# ---- Message Batches --------------------------------------------------------------------------------
class BatchRequestItem(Strict):
    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any]  # a Messages request; validated when it runs (an invalid one is an errored result)


class BatchCreateRequest(Strict):
    requests: list[BatchRequestItem] = Field(min_length=1, max_length=100_000)
