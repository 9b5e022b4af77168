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
    return tool_fmt.parse_tool_calls(full, prompt.tool_names, prompt.tool_format)


def stop_reason(job: pipeline.Job, out: RequestOutput, has_calls: bool) -> tuple[str, str | None]:
    if out.finish_reason == "length":  # a call cut short too: its input may be incomplete
        return ("model_context_window_exceeded" if job.is_context_capped else "max_tokens"), None
    if has_calls:
        return "tool_use", None
    if isinstance(out.stop_reason, str) and out.stop_reason != tool_fmt.CLOSE:
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def message_body(msg_id: str, model: str, job: pipeline.Job, out: RequestOutput) -> dict[str, Any]:
    text, calls = split_output(job.prompt, out.text)
    content: list[dict[str, Any]] = []
    if text:
        content.append({"type": "text", "text": text})
    for name, args in calls:
        content.append({"type": "tool_use", "id": tool_fmt.new_tool_id(), "name": name, "input": args})
    reason, sequence = stop_reason(job, out, bool(calls))
    return {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence, "usage": pipeline.usage_of(out, job.cache_breakpoint),
    }


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def event_stream(rt: pipeline.Runtime, job: pipeline.Job, stream: RequestStream, first: RequestOutput | None,
                 msg_id: str, model: str, ping_interval_s: float) -> StreamingResponse:
    """message_start, per block content_block_start / _delta / _stop, message_delta, the Stratum cost
    event, message_stop; pings while waiting. Text deltas carry `meta` from the runtime's state machine;
    a tool call's arguments stream as `input_json_delta`s while they are generated."""
    prompt = job.prompt

    async def events():
        index = -1
        kind = None  # the open block's type
        splitter = tool_fmt.AnswerSplitter(prompt.tool_names, prompt.prefill if prompt.is_forced_tool else "",
                                           prompt.tool_format)
        has_calls = False
        final = None
        call_meta = None  # the meta of the output where a tool call began, for its block's first delta

        def close():
            nonlocal kind
            if kind is None:
                return b""
            kind = None
            return sse("content_block_stop", {"type": "content_block_stop", "index": index})

        def blocks(pieces, meta):
            nonlocal index, kind, has_calls, call_meta
            for what, value in pieces:
                if what == "text":
                    if kind != "text":
                        yield close()
                        index, kind = index + 1, "text"
                        yield sse("content_block_start", {"type": "content_block_start", "index": index,
                                                          "content_block": {"type": "text", "text": ""}})
                    yield sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "text_delta", "text": value, "meta": meta}})
                elif what == "name":
                    yield close()
                    index, kind, has_calls = index + 1, "tool_use", True
                    yield sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                        "type": "tool_use", "id": tool_fmt.new_tool_id(), "name": value, "input": {}}})
                elif what == "args":
                    yield sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": value, "meta": call_meta or meta}})
                    call_meta = None
                else:
                    yield close()

        try:
            usage0 = pipeline.admitted_usage(rt, job)
            if first is not None and first.stats is not None:
                usage0 = dict(pipeline.usage_of(first, job.cache_breakpoint), output_tokens=0)
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
                if out.delta_text:
                    for event in blocks(splitter.feed(out.delta_text), pipeline.stream_meta(out)):
                        if event:
                            yield event
            for event in blocks(splitter.flush(), pipeline.stream_meta(final)):
                if event:
                    yield event
            if kind is not None:
                yield close()
            reason, sequence = stop_reason(job, final, has_calls)
            yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": pipeline.usage_of(final, job.cache_breakpoint)})
            _, cost = pipeline.finish(rt, job, final)
            yield sse("stratum_cost", {"type": "stratum_cost", **cost})
            yield sse("message_stop", {"type": "message_stop"})
        except Exception as e:  # after the 200 a failure becomes one error event, then the stream ends
            if not isinstance(e, APIError):
                log.exception("stream failed")
            yield sse_error(as_api_error(e), job.request_id, job.endpoint)

    return pipeline.event_response(events(), rt, job, pipeline.early_headers(rt, first, job))
