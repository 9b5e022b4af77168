"""The Responses API's input items (`input` as a list), as OpenAI's API reference lists them: one model
per item type, read as a union discriminated by `type` (an item without one is a message when it has a
`role`, else an `item_reference`), so an error names the field of the item the request meant."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from stratum.server.protocol.common import Loose, refuse_media, str_or_list
from stratum.server.protocol.response_tools import RespTool

_TEXT_PARTS = {"input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"}


class Item(Loose):
    """An input item: the fields this server reads are typed; the others are kept as sent (a stored
    response's input is listed back as it came, reasoning summaries and annotations included)."""

    model_config = ConfigDict(extra="allow", strict=True)


class RespText(Item):
    """A text part: `input_text`, `output_text` (its annotations and logprobs ignored), `refusal`."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class RespRefusal(Item):
    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


RespPart = Annotated[Union[RespText, RespRefusal], Field(discriminator="type")]


def _readable(data: Any, field: str) -> Any:
    """A part this text-only model cannot read (`input_image`, `input_file`, `input_audio`) is named as
    such, rather than reported as a part of no known type."""
    if isinstance(data, dict):
        refuse_media(data.get(field), _TEXT_PARTS, field)
    return data


class RespMessage(Item):
    """A message: an "easy" one (`content` a string or parts, `type` optional) or a typed one from an
    earlier response (`id`, `status`, `phase`)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str_or_list(RespPart, "a list of content parts")
    id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return _readable(data, "content")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class RespFunctionCall(Item):
    """A function call from an earlier turn; `namespace` names the namespace tool it came from."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None


class RespFunctionCallOutput(Item):
    """A function's output. `call_id` may be left out (an output that answers no call, as Codex sends
    after `create_goal`): it is then a tool turn named by `namespace` and `name`."""

    type: Literal["function_call_output"]
    output: str_or_list(RespPart, "a list of content parts")
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return _readable(data, "output")


class RespCustomToolCall(Item):
    """A custom (freeform) tool's call: its `input` is the tool's raw text."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None
    id: str | None = None


class RespCustomToolCallOutput(Item):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str_or_list(RespPart, "a list of content parts")
    id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return _readable(data, "output")


class RespReasoningPart(Item):
    """A reasoning item's `reasoning_text` (its content) or `summary_text` (its summary)."""

    type: Literal["reasoning_text", "summary_text"]
    text: str


class RespReasoning(Item):
    """A reasoning item from an earlier turn: its thought (its `content`'s reasoning text, else its
    summary) goes back to the model as its template reads a thought; `encrypted_content` is ignored."""

    type: Literal["reasoning"]
    id: str | None = None
    content: list[RespReasoningPart] | None = None
    summary: list[RespReasoningPart] | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary or [])


class RespItemReference(Item):
    """An item of a stored response (or of its input), by id: replaced by that item."""

    type: Literal["item_reference"] = "item_reference"
    id: str


class RespAdditionalTools(Item):
    """Tools given as an input item (Codex sends its tools this way when it talks to its own models):
    offered as if they were in `tools`."""

    type: Literal["additional_tools"]
    tools: list[RespTool]
    role: str | None = None  # "developer" in a request; an output item's may be any role
    id: str | None = None


# Items of OpenAI-run tools (and OpenAI's own bookkeeping) from an earlier turn: the model here cannot
# have made them, so they are read as history (`responses_chat`): a call as an assistant tool call
# named by its type, its output as a tool turn, and the rest (listings, approvals, compaction) as
# nothing. Fields are kept as sent.
RECORDED_ITEMS = ("file_search_call", "computer_call", "computer_call_output", "web_search_call", "tool_search_call",
                  "tool_search_output", "configuration_update", "compaction", "image_generation_call",
                  "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call",
                  "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_list_tools",
                  "mcp_approval_request", "mcp_approval_response", "mcp_call", "compaction_trigger", "program",
                  "program_output")


class RespRecordedItem(Item):
    type: Literal[RECORDED_ITEMS]
    id: str | None = None
    call_id: str | None = None

    @property
    def fields(self) -> dict[str, Any]:
        return dict(self.__pydantic_extra__ or {})


_INPUT_ITEMS: dict[str, type] = {
    "message": RespMessage, "function_call": RespFunctionCall, "function_call_output": RespFunctionCallOutput,
    "custom_tool_call": RespCustomToolCall, "custom_tool_call_output": RespCustomToolCallOutput,
    "reasoning": RespReasoning, "item_reference": RespItemReference, "additional_tools": RespAdditionalTools,
    **{kind: RespRecordedItem for kind in RECORDED_ITEMS},
}


def _item_kind(v: Any) -> str | None:
    if not isinstance(v, dict):
        return None
    kind = v.get("type")
    if kind is None:  # the reference lets both an easy message and an item reference leave `type` out
        return "item_reference" if "role" not in v and "id" in v else "message"
    return kind if isinstance(kind, str) else None  # an unknown type is named in the error, with the known ones


RespInputItem = Annotated[
    Union[tuple(Annotated[model, Tag(kind)] for kind, model in _INPUT_ITEMS.items())],
    Discriminator(_item_kind, custom_error_type="item_type",
                  custom_error_message="Input should be an object whose type is one of "
                                       "the Responses API's input item types")]
