"""The Responses API's tools and `tool_choice`, as OpenAI's API reference lists them: unions discriminated
by `type`. Function and custom tools (top level, or inside a `namespace`) are offered to the model;
OpenAI-run tools are accepted and not offered (`HOSTED_TOOLS`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator

from stratum.server.protocol.common import TOOL_NAME, Loose, by_type, check_object_schema

# Tools OpenAI runs itself (search, files, containers, image generation, MCP servers) or whose calls
# are OpenAI's own item types (computer use, shells, patches, tool search, programs): a local model
# was never taught them and this server runs none of them, so they are accepted and not offered to
# the model; a tool_choice that forces one is a 400.
HOSTED_TOOLS = ("file_search", "computer", "computer_use", "computer_use_preview", "web_search",
                "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11", "mcp",
                "code_interpreter", "programmatic_tool_calling", "image_generation", "local_shell", "shell",
                "tool_search", "apply_patch")


class RespFunctionTool(Loose):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # accepted; a deferred tool is offered anyway (no tool search runs here), and no program calls tools
    defer_loading: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return v if v is None else check_object_schema(v)


class RespTextFormat(Loose):
    type: Literal["text"]


class RespGrammarFormat(Loose):
    """A custom tool's input grammar: Lark (llguidance's dialect of it) or a regular expression."""

    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1)


class RespCustomTool(Loose):
    """A freeform tool: the model writes its input as raw text (`format` text), or text the grammar
    accepts."""

    type: Literal["custom"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    format: Annotated[Union[RespTextFormat, RespGrammarFormat], Field(discriminator="type")] | None = None
    defer_loading: bool | None = None


NamespacedTool = Annotated[Union[RespFunctionTool, RespCustomTool], Field(discriminator="type")]


class RespNamespaceTool(Loose):
    """Tools grouped under a name: each is offered to the model, and a call of one names the namespace
    back (`namespace` on its function_call or custom_tool_call item)."""

    type: Literal["namespace"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    tools: list[NamespacedTool] = Field(min_length=1)


class RespHostedTool(Loose):
    """An OpenAI-run tool (`HOSTED_TOOLS`), kept as sent."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal[HOSTED_TOOLS]


_TOOLS: dict[str, type] = {"function": RespFunctionTool, "custom": RespCustomTool, "namespace": RespNamespaceTool,
                           **{kind: RespHostedTool for kind in HOSTED_TOOLS}}
RespTool = Annotated[Union[tuple(Annotated[model, Tag(kind)] for kind, model in _TOOLS.items())],
                     Discriminator(by_type, custom_error_type="item_type",
                                   custom_error_message="Input should be an object")]


# ---- tool_choice --------------------------------------------------------------------------------------
class RespNamedChoice(Loose):
    """{"type": "function" | "custom", "name"}: that tool, which may be inside a namespace."""

    type: Literal["function", "custom"]
    name: str


class RespAllowedTools(Loose):
    """{"type": "allowed_tools", "mode", "tools"}: only these of the request's tools are offered."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class RespHostedChoice(Loose):
    """A tool_choice naming an OpenAI-run tool (`HOSTED_TOOLS`, or an MCP server's): a 400, since none
    is offered here."""

    type: Literal[HOSTED_TOOLS]
    server_label: str | None = None
    name: str | None = None


_CHOICES: dict[str, Any] = {"#str": Literal["none", "auto", "required"], "function": RespNamedChoice,
                            "custom": RespNamedChoice, "allowed_tools": RespAllowedTools,
                            **{kind: RespHostedChoice for kind in HOSTED_TOOLS}}
RespToolChoice = Annotated[Union[tuple(Annotated[model, Tag(kind)] for kind, model in _CHOICES.items())],
                           Discriminator(by_type, custom_error_type="item_type",
                                         custom_error_message="Input should be 'none', 'auto', 'required' "
                                                              "or an object")]


def check_unique(tools: list) -> None:
    """Names are unique among the tools offered at one level (top level, or within a namespace)."""
    names = [t.name for t in tools if t.type in ("function", "custom", "namespace")]
    if len(names) != len(set(names)):
        raise ValueError("tools: tool names must be unique "
                         f"({sorted(n for n in set(names) if names.count(n) > 1)[0]!r} "
                         "is repeated)")
    for t in tools:
        if t.type == "namespace":
            check_unique(t.tools)


__all__ = ["HOSTED_TOOLS", "RespAllowedTools", "RespCustomTool", "RespFunctionTool", "RespHostedChoice",
           "RespNamedChoice", "RespNamespaceTool", "RespTool", "RespToolChoice", "check_unique"]
