"""Anthropic Messages API: the response body and the SSE event stream of one request (`Messages`)."""

from __future__ import annotations

from typing import Any, Iterable

from stratum.engine.outputs import MetaState, RequestOutput
from stratum.server.errors import APIError, sse_error
from stratum.server.render import RenderContext, answer_splitter, new_id, split_output, stream_meta, to_json
from stratum.server.tools import AnswerEvent, CallArguments, CallEnd, CallStart, TextPiece
from stratum.server.usage import usage_of


def new_tool_id() -> str:
    """A tool_use block's id."""
    return new_id("toolu_")


def stop_reason(ctx: RenderContext, out: RequestOutput, has_calls: bool) -> tuple[str, str | None]:
    if out.finish_reason == "content_filter":  # a content policy blocked the prompt or the answer
        return "refusal", None
    if out.finish_reason == "length":  # a call cut short too: its input may be incomplete
        return ("model_context_window_exceeded" if ctx.is_context_capped else "max_tokens"), None
    if has_calls:
        return "tool_use", None
    if isinstance(out.stop_reason, str) and out.stop_reason != ctx.prompt.tool_format.stop:
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def usage(ctx: RenderContext, out: RequestOutput) -> dict[str, Any]:
    """`usage_of`, with the thought's tokens apart where the model thought (they are output tokens too)."""
    use: dict[str, Any] = usage_of(out, ctx.cache_breakpoint)
    if out.stats.num_reasoning_tokens:
        use["output_tokens_details"] = {"thinking_tokens": out.stats.num_reasoning_tokens}
    return use


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {to_json(data)}\n\n".encode()


class Messages:
    """A `render.Renderer`. The stream: message_start, per block content_block_start / _delta / _stop (a
    reasoning model's thought first, as a thinking block: thinking_delta events, then its signature_delta),
    message_delta, message_stop; pings while waiting: Anthropic's events, nothing added to them. A tool
    call's arguments stream as `input_json_delta`s while they are generated. A client that asked for
    Stratum's events (`RenderContext.meta`) also gets, after each text or input delta, a `stratum_meta`
    event (the runtime's state machine and KV efficiency), and a `stratum_cost` event before message_stop:
    events of their own, so that no merger of deltas meets a field it does not know."""

    ping = sse("ping", {"type": "ping"})

    def __init__(self, ctx: RenderContext):
        self.ctx, self.id = ctx, new_id("msg_")
        self.splitter = answer_splitter(ctx.prompt)
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.has_calls = False
        self.call_meta: dict[str, Any] | None = None  # the meta of the output where a tool call began
        self.thought = ""  # the open thinking block's text

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        out, = outs
        text, calls = split_output(self.ctx.prompt, out.text)
        content: list[dict[str, Any]] = []
        if out.reasoning:
            content.append({"type": "thinking", "thinking": out.reasoning, "signature": self._sign(out.reasoning)})
        if text:
            content.append({"type": "text", "text": text})
        for name, args in calls:
            content.append({"type": "tool_use", "id": new_tool_id(), "name": name, "input": args})
        reason, sequence = stop_reason(self.ctx, out, bool(calls))
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.ctx.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(self.ctx, out),
        }

    def _sign(self, thought: str) -> str:
        return self.ctx.thoughts.sign(thought) if self.ctx.thoughts is not None else ""

    def start(self, first: RequestOutput | None, admitted: dict[str, int]) -> Iterable[bytes]:
        usage = admitted
        if first is not None and first.stats is not None:
            usage = dict(usage_of(first, self.ctx.cache_breakpoint), output_tokens=0)
        yield sse("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.ctx.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}})

    def output(self, out: RequestOutput, choice: int) -> Iterable[bytes]:
        if out.state is MetaState.TOOL_USE_PREPARED:
            self.call_meta = stream_meta(out)
        if out.delta_reasoning:
            if self.kind != "thinking":
                yield from self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thought += out.delta_reasoning
            yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                "type": "thinking_delta", "thinking": out.delta_reasoning}})
        if out.delta_text:
            yield from self._blocks(self.splitter.feed(out.delta_text), stream_meta(out))

    def end(self, final: RequestOutput, cost: dict[str, Any]) -> Iterable[bytes]:
        yield from self._blocks(self.splitter.flush(), stream_meta(final))
        yield from self._close()
        reason, sequence = stop_reason(self.ctx, final, self.has_calls)
        yield sse("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": usage(self.ctx, final)})
        if self.ctx.meta:
            yield sse("stratum_cost", {"type": "stratum_cost", **cost})
        yield sse("message_stop", {"type": "message_stop"})

    def error(self, e: APIError) -> bytes:
        return sse_error(e, self.ctx.request_id, self.ctx.endpoint)

    def _close(self) -> Iterable[bytes]:
        if self.kind == "thinking":  # its signature, once its whole text is known (Anthropic's order)
            yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                "type": "signature_delta", "signature": self._sign(self.thought)}})
        if self.kind is not None:
            self.kind = None
            yield sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _open(self, kind: str, block: dict[str, Any]) -> Iterable[bytes]:
        yield from self._close()
        self.index, self.kind = self.index + 1, kind
        yield sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _meta(self, meta: dict[str, Any]) -> Iterable[bytes]:
        """The runtime's state at the delta just sent, for a client that asked for it."""
        if self.ctx.meta:
            yield sse("stratum_meta", {"type": "stratum_meta", "index": self.index, "meta": meta})

    def _blocks(self, events: list[AnswerEvent], meta: dict[str, Any]) -> Iterable[bytes]:
        for event in events:
            match event:
                case TextPiece(text):
                    if self.kind != "text":
                        yield from self._open("text", {"type": "text", "text": ""})
                    yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                        "type": "text_delta", "text": text}})
                    yield from self._meta(meta)
                case CallStart(name):
                    self.has_calls = True
                    yield from self._open("tool_use", {"type": "tool_use", "id": new_tool_id(), "name": name,
                                                       "input": {}})
                case CallArguments(fragment):
                    yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fragment}})
                    yield from self._meta(self.call_meta or meta)
                    self.call_meta = None
                case CallEnd():
                    yield from self._close()
