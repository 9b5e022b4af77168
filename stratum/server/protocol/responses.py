"""OpenAI's Responses API request body (`POST /v1/responses`), mirroring its API reference: input
items and tools as unions discriminated by `type`, so a new kind is one model and one tag."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from stratum.server.protocol.common import TOOL_NAME, Loose, check_object_schema, refuse_media


class RespInputText(Loose):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RespMessage(Loose):
    """A message input item (`type` "message", or an "easy" message without it)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[RespInputText]


class RespFunctionCall(Loose):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class RespFunctionCallOutput(Loose):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[RespInputText]


class RespReasoning(Loose):
    """A reasoning item from an earlier turn: accepted, and left out of the prompt (as thinking is)."""

    type: Literal["reasoning"]


# The input items taken, by their `type` (a message may leave it out): a new kind is a model and an entry here.
_INPUT_ITEMS = {"message": RespMessage, "function_call": RespFunctionCall,
                "function_call_output": RespFunctionCallOutput, "reasoning": RespReasoning}
_RESP_ITEMS = tuple(_INPUT_ITEMS)


def _input_item_kind(v: Any) -> str:
    return (v.get("type") or "message") if isinstance(v, dict) else "message"


RespInputItem = Annotated[Union[tuple(Annotated[model, Tag(kind)] for kind, model in _INPUT_ITEMS.items())],
                          Discriminator(_input_item_kind)]


class RespFunctionTool(Loose):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return v if v is None else check_object_schema(v)


# The tool kinds served (function tools today); several become a union discriminated by `type`, as
# `RespInputItem` is.
RespTool = RespFunctionTool


class RespNamedToolChoice(Loose):
    type: Literal["function"]
    name: str


class RespTextFormat(Loose):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self


class RespTextConfig(Loose):
    format: RespTextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(Loose):
    """POST /v1/responses. Fields of the API that need stored state (previous_response_id,
    conversation, background) are refused; others a local model has no use for are ignored."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[RespInputItem]
    instructions: str | None = None
    tools: list[RespTool] | None = None
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
                refuse_media(item.get(field), {"input_text", "output_text", "text"}, f"input.{i}.{field}")
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
