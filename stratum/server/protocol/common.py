"""What every API's request models share: strict and lenient bases, and the checks they all make."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag
from pydantic_core import PydanticCustomError

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
# Bounds on every number a request carries, so none reaches the engine process unbounded (its frames
# are msgpack, whose integers stop at 64 bits): a count is at most INT32_MAX, far beyond any context;
# a seed is OpenAI's int64, and so is the bound of a number whose large values mean "no limit" (top_k).
MAX_COUNT = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
_TOOL_RESULT_READABLE = {"text", "search_result", "document", "tool_reference"}  # blocks an Anthropic tool_result holds


class Strict(BaseModel):
    """Anthropic's bodies: unknown fields are refused."""

    # strict: "8" is not an int and true is not a number, as in the real APIs (whole numbers still pass as floats)
    model_config = ConfigDict(extra="forbid", strict=True)


class Loose(BaseModel):
    """OpenAI's bodies: unknown fields are ignored, as OpenAI's API ignores them."""

    model_config = ConfigDict(extra="ignore", strict=True)


def check_object_schema(v: dict[str, Any]) -> dict[str, Any]:
    # the anthropic SDK's InputSchema model dumps its unset `properties` / `required` as null: a null
    # keyword says nothing, so it is left out rather than refused
    v = {key: value for key, value in v.items() if value is not None}
    if v.get("type") != "object":
        raise ValueError("a tool's schema must have type 'object'")
    return v


def refuse_media(blocks: Any, known: set[str], where: str = "content") -> None:
    """Name a content block this text-only model cannot read (an image, a PDF), rather than letting
    validation say that the content should have been a string."""
    if not isinstance(blocks, list):
        return
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in known:
            raise PydanticCustomError("unsupported_content", "{where}.{j}: content blocks of type {kind} are not "
                                      "supported: this model is text-only",
                                      {"where": where, "j": j, "kind": repr(kind)})
        if kind == "document":
            source = block.get("source")
            source_type = source.get("type") if isinstance(source, dict) else None
            if isinstance(source_type, str) and source_type not in ("text", "content"):
                raise PydanticCustomError(
                    "unsupported_content", "{where}.{j}: documents with a source of type {kind} are not supported: "
                    "this model is text-only (it reads documents with a 'text' or 'content' source)",
                    {"where": where, "j": j, "kind": repr(source_type)})
            if source_type == "content":
                refuse_media(source.get("content"), {"text"}, f"{where}.{j}.source.content")
        if kind == "tool_result":
            refuse_media(block.get("content"), _TOOL_RESULT_READABLE, f"{where}.{j}.content")


# A field that is a string or a list (content: "text" or blocks) is a union discriminated by the
# value's own JSON type, so a failing list reports the list's error, not that it is not a string.
# Its two tags are not part of the request's path: `error_path` leaves them out.
_STR, _LIST = "#str", "#list"
BRANCH_TAGS = frozenset((_STR, _LIST))


def _str_or_list(value: Any) -> str | None:
    return _STR if isinstance(value, str) else _LIST if isinstance(value, list) else None


def str_or_list(item: Any, what: str = "a list of content blocks") -> Any:
    """`str | list[item]`, validated as the branch the value's JSON type names."""
    return Annotated[Union[Annotated[str, Tag(_STR)], Annotated[list[item], Tag(_LIST)]],
                     Discriminator(_str_or_list, custom_error_type="string_or_list",
                                   custom_error_message=f"Input should be a string or {what}")]


def by_type(value: Any) -> str | None:
    """The tag of an object discriminated by its `type`, or "#str" for a bare string (tool_choice)."""
    if isinstance(value, str):
        return _STR
    return value.get("type") if isinstance(value, dict) else None


def error_path(loc: tuple) -> list[str | int]:
    """A validation error's location as the request's own path (the str/list branch tags left out)."""
    return [p for p in loc if p not in BRANCH_TAGS]
