"""Anthropic Messages API: the response body and the SSE event stream of one request (`Messages`)."""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterable

from stratum.engine.outputs import RequestOutput
from stratum.server import tools as tool_fmt
from stratum.server.chat import Prompt
from stratum.server.errors import APIError, sse_error
from stratum.server.lifecycle import RequestLifecycle
from stratum.server.pipeline import stream_meta, usage_of


def _forced(prompt: Prompt) -> str:
    """What the prompt itself began of the answer: a forced tool call's opening (tool_choice any / tool)."""
    return prompt.prefill if prompt.is_forced_tool else ""


def split_output(prompt: Prompt, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """A whole answer: its text and its tool calls."""
    full = _forced(prompt) + text
    if not prompt.tool_names:
        return full, []
    return tool_fmt.parse_tool_calls(full, prompt.tool_names, prompt.tool_format)


def answer_splitter(prompt: Prompt) -> tool_fmt.AnswerSplitter:
    """An answer as it streams: its text and its tool calls' pieces."""
    return tool_fmt.AnswerSplitter(prompt.tool_names, _forced(prompt), prompt.tool_format)


def stop_reason(lc: RequestLifecycle, out: RequestOutput, has_calls: bool) -> tuple[str, str | None]:
    if out.finish_reason == "length":  # a call cut short too: its input may be incomplete
        return ("model_context_window_exceeded" if lc.is_context_capped else "max_tokens"), None
    if has_calls:
        return "tool_use", None
    if isinstance(out.stop_reason, str) and out.stop_reason != lc.prompt.tool_format.stop:
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class Messages:
    """A `lifecycle.Renderer`. The stream: message_start, per block content_block_start / _delta / _stop,
    message_delta, the Stratum cost event, message_stop; pings while waiting. Text deltas carry `meta`
    from the runtime's state machine; a tool call's arguments stream as `input_json_delta`s while they
    are generated."""

    ping = sse("ping", {"type": "ping"})

    def __init__(self, lc: RequestLifecycle, model: str):
        self.lc, self.model, self.id = lc, model, "msg_" + uuid.uuid4().hex[:24]
        self.splitter = answer_splitter(lc.prompt)
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.has_calls = False
        self.call_meta: dict[str, Any] | None = None  # the meta of the output where a tool call began

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        out, = outs
        text, calls = split_output(self.lc.prompt, out.text)
        content: list[dict[str, Any]] = []
        if text:
            content.append({"type": "text", "text": text})
        for name, args in calls:
            content.append({"type": "tool_use", "id": tool_fmt.new_tool_id(), "name": name, "input": args})
        reason, sequence = stop_reason(self.lc, out, bool(calls))
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_of(out, self.lc.cache_breakpoint),
        }

    def start(self, first: RequestOutput | None) -> Iterable[bytes]:
        usage0 = self.lc.admitted_usage()
        if first is not None and first.stats is not None:
            usage0 = dict(usage_of(first, self.lc.cache_breakpoint), output_tokens=0)
        yield sse("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage0}})

    def output(self, out: RequestOutput, choice: int) -> Iterable[bytes]:
        if out.state == "tool_use_prepared":
            self.call_meta = stream_meta(out)
        if out.delta_text:
            yield from self._blocks(self.splitter.feed(out.delta_text), stream_meta(out))

    def end(self, final: RequestOutput, cost: dict[str, Any]) -> Iterable[bytes]:
        yield from self._blocks(self.splitter.flush(), stream_meta(final))
        yield from self._close()
        reason, sequence = stop_reason(self.lc, final, self.has_calls)
        yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": usage_of(final, self.lc.cache_breakpoint)})
        yield sse("stratum_cost", {"type": "stratum_cost", **cost})
        yield sse("message_stop", {"type": "message_stop"})

    def error(self, e: APIError) -> bytes:
        return sse_error(e, self.lc.request_id, self.lc.endpoint)

    def _close(self) -> Iterable[bytes]:
        if self.kind is not None:
            self.kind = None
            yield sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _blocks(self, pieces, meta: dict[str, Any]) -> Iterable[bytes]:
        for what, value in pieces:
            if what == "text":
                if self.kind != "text":
                    yield from self._close()
                    self.index, self.kind = self.index + 1, "text"
                    yield sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                      "content_block": {"type": "text", "text": ""}})
                yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                    "type": "text_delta", "text": value, "meta": meta}})
            elif what == "name":
                yield from self._close()
                self.index, self.kind, self.has_calls = self.index + 1, "tool_use", True
                yield sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": {
                    "type": "tool_use", "id": tool_fmt.new_tool_id(), "name": value, "input": {}}})
            elif what == "args":
                yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": value, "meta": self.call_meta or meta}})
                self.call_meta = None
            else:
                yield from self._close()
