"""Anthropic Messages API: the response body and the SSE event stream."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import StreamingResponse

from stratum.engine.client import RequestStream
from stratum.engine.outputs import RequestOutput
from stratum.server import pipeline
from stratum.server import tools as tool_fmt
from stratum.server.chat import Prompt
from stratum.server.errors import APIError, as_api_error, sse_error

log = logging.getLogger("stratum.server")


def split_output(prompt: Prompt, text: str) -> tuple[str, list[tuple[str, dict]]]:
    full = (prompt.prefill if prompt.is_forced_tool else "") + text
    if not prompt.tool_names:
        return full, []
    return tool_fmt.parse_tool_calls(full, prompt.tool_names)


def stop_reason(out: RequestOutput, has_calls: bool) -> tuple[str, str | None]:
    if has_calls:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str) and out.stop_reason != tool_fmt.CLOSE:
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def message_body(msg_id: str, model: str, prompt: Prompt, out: RequestOutput) -> dict[str, Any]:
    text, calls = split_output(prompt, out.text)
    content: list[dict[str, Any]] = []
    if text:
        content.append({"type": "text", "text": text})
    for name, args in calls:
        content.append({"type": "tool_use", "id": tool_fmt.new_tool_id(), "name": name, "input": args})
    reason, sequence = stop_reason(out, bool(calls))
    return {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence, "usage": pipeline.usage_of(out),
    }


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of token."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def event_stream(rt: pipeline.Runtime, job: pipeline.Job, stream: RequestStream, first: RequestOutput | None,
                 msg_id: str, model: str, ping_interval_s: float) -> StreamingResponse:
    """message_start, per block content_block_start / _delta / _stop, message_delta, the Stratum cost
    event, message_stop; pings while waiting. Text deltas carry `meta` from the runtime's state machine."""
    prompt = job.prompt

    async def events():
        index = 0
        text_open = False
        emitted = ""
        held = ""  # text that may be the start of a tool call, not yet released
        in_call = prompt.is_forced_tool
        call_meta = None  # the meta of the output where the tool call began, for the tool block's delta
        final = None
        try:
            usage0 = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
            if first is not None and first.stats is not None:
                usage0 = dict(pipeline.usage_of(first), output_tokens=0)
            yield sse("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage0}})
            async for out in pipeline.paced(stream, first, ping_interval_s):
                if out is None:
                    yield sse("ping", {"type": "ping"})
                    continue
                final = out
                if out.state == "tool_use_prepared":
                    call_meta = pipeline.stream_meta(out)
                if out.delta_text and not in_call:
                    held += out.delta_text
                    cut = held.find(tool_fmt.OPEN) if prompt.tool_names else -1
                    if cut >= 0:
                        release, held, in_call = held[:cut], "", True
                    else:
                        keep = partial_suffix(held, tool_fmt.OPEN) if prompt.tool_names else 0
                        release, held = held[: len(held) - keep], held[len(held) - keep:]
                    if release:
                        if not text_open:
                            yield sse("content_block_start", {"type": "content_block_start", "index": index,
                                                              "content_block": {"type": "text", "text": ""}})
                            text_open = True
                        emitted += release
                        yield sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                            "type": "text_delta", "text": release, "meta": pipeline.stream_meta(out)}})
            text, calls = split_output(prompt, final.text)
            if not calls and len(text) > len(emitted):  # held-back text that turned out not to be a call
                if not text_open:
                    yield sse("content_block_start", {"type": "content_block_start", "index": index,
                                                      "content_block": {"type": "text", "text": ""}})
                    text_open = True
                yield sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "text_delta", "text": text[len(emitted):], "meta": pipeline.stream_meta(final)}})
            if text_open:
                yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
            for name, args in calls:
                yield sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                    "type": "tool_use", "id": tool_fmt.new_tool_id(), "name": name, "input": {}}})
                yield sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(args, ensure_ascii=False),
                    "meta": call_meta or pipeline.stream_meta(final)}})
                yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
            reason, sequence = stop_reason(final, bool(calls))
            yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": pipeline.usage_of(final)})
            _, cost = pipeline.finish(rt, job, final)
            yield sse("stratum_cost", {"type": "stratum_cost", **cost})
            yield sse("message_stop", {"type": "message_stop"})
        except Exception as e:  # after the 200 a failure becomes one error event, then the stream ends
            if not isinstance(e, APIError):
                log.exception("stream failed")
            yield sse_error(as_api_error(e), job.request_id, job.endpoint)

    return pipeline.event_response(events(), rt, job, pipeline.early_headers(rt, first, job))
