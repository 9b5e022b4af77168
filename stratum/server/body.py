"""Reading a request body: bounded in size and in how long it may stall, decoded as JSON and validated
into its pydantic model, every failure a 4xx naming what is wrong."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from stratum.server.errors import BodyTimeout, ClientDisconnected, InvalidRequest, RequestTooLarge
from stratum.server.protocol.common import error_path

log = logging.getLogger("stratum.server")

# Bodies above this are parsed in a worker thread, so a large one does not hold up other clients.
_PARSE_INLINE_BYTES = 64 * 1024
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

Model = TypeVar("Model", bound=BaseModel)


async def read_request(request: Request, model: type[Model], limit: int, timeout_s: float) -> Model:
    """The body as `model`.

    Args:
        limit: bytes the body may have.
        timeout_s: how long the body may stall between two chunks.
    Raises:
        RequestTooLarge: 413. BodyTimeout: 408. ClientDisconnected: the client left while sending it.
        InvalidRequest: 400, not JSON, not an object, or not valid as `model` (the first error, by its path).
    """
    body = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise BodyTimeout(f"the request body stalled for {timeout_s:g}s; received "
                              f"{len(body)} bytes", headers={"connection": "close"}) from None
        except ClientDisconnect:
            log.info("%s: client disconnected while sending its body (%d bytes received)",
                     request.state.request_id, len(body))
            raise ClientDisconnected("client disconnected") from None
        body += chunk
        if len(body) > limit:
            raise RequestTooLarge(f"request body exceeds {limit} bytes")
    request.state.num_body_bytes = len(body)  # what the token-counting routes are charged by (`counting`)
    if len(body) <= _PARSE_INLINE_BYTES:
        return _parse(model, _decode_json(bytes(body)))
    return await asyncio.to_thread(lambda: _parse(model, _decode_json(bytes(body))))


def _decode_json(body: bytes) -> dict[str, Any]:
    # Decoded here, strictly: json.loads on bytes decodes with "surrogatepass", which lets an encoded
    # surrogate (ED A0 80) through as a str no tokenizer can encode.
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body):  # only an escape can put a lone surrogate in valid UTF-8 JSON
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("request body contains a lone UTF-16 surrogate") from None
    return data


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _parse(model: type[Model], data: dict[str, Any]) -> Model:
    """The body as `model`. A failure names its field by its path, through the variant of a union the
    request meant (`messages.1.content.0.tool_use.toolset_name`: the union's tag is in the path), and
    carries the field's own path in the API's terms as the error's `param` (`messages[1].content[0]
    .toolset_name`), which OpenAI's error shape reports."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        path = error_path(first["loc"])
        loc = ".".join(str(p) for p in path)
        sep = "." if first["type"] == "unsupported_content" else ": "  # its message starts with the block's path
        error = InvalidRequest(f"{loc}{sep}{first['msg']}" if loc else first["msg"])
        error.param = _param(data, path)
        raise error from None


def _param(data: Any, path: list[str | int]) -> str | None:
    """`path` as the request's own field path (`input[3].call_id`): union tags, which name a variant and
    not a field, left out (a tag is a step the request's data does not have, short of the last one)."""
    out, value = "", data
    for i, step in enumerate(path):
        if isinstance(step, int) and isinstance(value, list) and step < len(value):
            out, value = f"{out}[{step}]", value[step]
        elif isinstance(step, str) and (isinstance(value, dict) and step in value or i == len(path) - 1):
            out = f"{out}.{step}" if out else step
            value = value.get(step) if isinstance(value, dict) else None
        elif not isinstance(step, str):
            return out or None
    return out or None
