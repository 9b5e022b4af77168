"""OpenAI's Responses API request body (`POST /v1/responses`), mirroring its API reference; its input
items are in `response_items`, its tools and tool_choice in `response_tools`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from stratum.server.protocol.common import MAX_COUNT, SEED_MAX, SEED_MIN, TOOL_NAME, Loose, str_or_list
from stratum.server.protocol.response_items import RespInputItem, RespMessage
from stratum.server.protocol.response_tools import RespTool, RespToolChoice, check_unique


class RespTextFormat(Loose):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=TOOL_NAME)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self


class RespTextConfig(Loose):
    format: RespTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no effect on a local model


class RespReasoningConfig(Loose):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # the thought is returned whole, not summarised


class ResponsesRequest(Loose):
    """POST /v1/responses. `store` (default true) keeps the response for GET /v1/responses/{id} and
    for `previous_response_id` / `item_reference`; `conversation`, `background` and `prompt` need
    OpenAI's stored objects and are refused; fields a local model has no use for are ignored."""

    model: str = Field(min_length=1, max_length=256)
    input: str_or_list(RespInputItem, "a list of input items")
    instructions: str | None = None
    tools: list[RespTool] | None = None
    tool_choice: RespToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: RespTextConfig | None = None
    reasoning: RespReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    previous_response_id: str | None = Field(default=None, min_length=1)
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    truncation: Literal["auto", "disabled"] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # extension, as on chat completions
    ignore_eos: bool = False  # vLLM's extension, for benchmarks

    @model_validator(mode="after")
    def _rules(self):
        if self.conversation is not None:
            raise ValueError("conversation is not supported: this server has no Conversations API; send the "
                             "conversation as input, or chain responses with previous_response_id")
        if self.background:
            raise ValueError("background responses are not supported: stream the response instead")
        if self.prompt is not None:
            raise ValueError("prompt (a stored prompt template) is not supported: this server stores no prompt "
                             "templates; send the prompt as instructions and input")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        check_unique([*(self.tools or []), *self.additional_tools])
        return self

    @property
    def is_stored(self) -> bool:
        """OpenAI's default: a response is stored unless `store` is false."""
        return self.store is not False

    @property
    def items(self) -> list:
        """The input as items: a string input is one user message."""
        return [RespMessage(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input or [])

    @property
    def additional_tools(self) -> list:
        """Tools given as `additional_tools` input items, in order."""
        return [t for item in self.items if item.type == "additional_tools" for t in item.tools]

    @property
    def output_schema(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        return {"type": "object"} if fmt.type == "json_object" else fmt.schema_


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: what a response to the same body would read, counted; `model` and
    `input` may be left out (a stored response continued is the input then)."""

    model: str | None = Field(default=None, min_length=1, max_length=256)
    input: str_or_list(RespInputItem, "a list of input items") | None = None
