"""OpenAI Responses API (`POST /v1/responses`): the response object and its SSE event stream.

An answer becomes output items: a reasoning model's thought first, as a `reasoning` item (its whole text
as one `reasoning_text` part), then a `message` holding one `output_text` part, a `function_call` item per
function call (arguments as a JSON string, with a `call_id` the client answers with a
`function_call_output` item) and a `custom_tool_call` item per custom tool call (its raw `input`); a
call of a tool inside a namespace names the `namespace` and the tool's own name. The stream is the
documented event sequence, every event numbered by `sequence_number`:

    response.created, response.in_progress
    per item: response.output_item.added
        reasoning:        response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                          response.content_part.done
        message:          response.content_part.added, response.output_text.delta..., response.output_text.done,
                          response.content_part.done
        function_call:    response.function_call_arguments.delta..., response.function_call_arguments.done
        custom_tool_call: response.custom_tool_call_input.delta..., response.custom_tool_call_input.done
      response.output_item.done
    response.completed (or response.incomplete when max_output_tokens ended it; it also carries stratum_cost when
    the client asked for Stratum's events)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from stratum.engine.outputs import RequestOutput
from stratum.server.errors import APIError, sse_error
from stratum.server.protocol import ResponsesRequest
from stratum.server.render import RenderContext, answer_splitter, new_call_id, new_id, split_output, to_json
from stratum.server.tools import AnswerEvent, CallArguments, CallEnd, CallStart, TextPiece


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage: input_tokens counts every prompt token, cache reads among them."""
    s = out.stats
    return {"input_tokens": s.num_prompt_tokens, "input_tokens_details": {"cached_tokens": s.num_cached_tokens},
            "output_tokens": s.num_output_tokens, "output_tokens_details": {"reasoning_tokens": s.num_reasoning_tokens},
            "total_tokens": s.num_prompt_tokens + s.num_output_tokens}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thought, whole (its `content`; no summary is made of it)."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = ([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
               if status == "completed" else [])
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


# A tool as the model calls it (`responses_chat.ToolSpec.model_name`) -> (its namespace, its name, is custom).
ToolNames = dict[str, tuple[str | None, str, bool]]


def _call_item(names: ToolNames, model_name: str, payload: str, status: str) -> dict[str, Any]:
    """A function_call (arguments) or custom_tool_call (input) item, naming the namespace it is in."""
    namespace, name, is_custom = names.get(model_name, (None, model_name, False))
    item: dict[str, Any] = {"type": "custom_tool_call" if is_custom else "function_call",
                            "id": new_id("ctc_" if is_custom else "fc_"), "call_id": new_call_id(), "name": name,
                            "input" if is_custom else "arguments": payload}
    if not is_custom:
        item["status"] = status
    if namespace is not None:
        item["namespace"] = namespace
    return item


class ResponseShell:
    """The fields of a response object that do not depend on the answer: what the request asked."""

    def __init__(self, req: ResponsesRequest, sampling_temperature: float, sampling_top_p: float):
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        fmt = req.text.format if req.text and req.text.format else None
        text_format: dict[str, Any] = {"type": "text"}
        if fmt is not None and fmt.type != "text":
            text_format = {"type": fmt.type}
            if fmt.type == "json_schema":
                text_format.update(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
        choice = req.tool_choice or "auto"
        self.fields = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.is_stored, "temperature": sampling_temperature, "top_p": sampling_top_p,
            "text": {"format": text_format}, "tool_choice": choice if isinstance(choice, str) else _dump(choice),
            "tools": [_dump(t) for t in req.tools or []], "truncation": req.truncation or "disabled",
            "user": req.user, "metadata": req.metadata or {},
        }

    def body(self, status: str, output: list[dict[str, Any]], out: RequestOutput | None) -> dict[str, Any]:
        incomplete = None
        if status == "incomplete":
            blocked = out is not None and out.finish_reason == "content_filter"
            incomplete = {"reason": "content_filter" if blocked else "max_output_tokens"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
                "incomplete_details": incomplete, "output": output, **self.fields,
                "usage": usage(out) if out is not None else None}


def item_page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """One page of a list of items, OpenAI's list object: the `limit` items after the one of id `after`."""
    start = next((i + 1 for i, item in enumerate(items) if item.get("id") == after), 0) if after else 0
    page = items[start: start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


def _dump(model) -> dict[str, Any]:
    return model.model_dump(by_alias=True, exclude_none=True)


def _status(out: RequestOutput) -> str:
    return "incomplete" if out.finish_reason in ("length", "content_filter") else "completed"


class Responses:
    """A `render.Renderer`: the response object, or the documented event sequence (module
    docstring), every event numbered; `response.in_progress` again as its keep-alive."""

    def __init__(self, ctx: RenderContext, shell: ResponseShell, names: ToolNames | None = None,
                 on_done: Callable[[dict[str, Any]], None] | None = None):
        """Args:
            names: the tools offered, by the name the model calls them.
            on_done: given the final response object (stored, where the request asked for that).
        """
        self.ctx, self.shell = ctx, shell
        self.names = names or {}
        self.on_done = on_done
        self.splitter = answer_splitter(ctx.prompt)
        self.sequence = 0
        self.output_items: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None  # the open output item
        self.text = ""  # the open message's text so far

    @property
    def ping(self) -> bytes:
        """The keep-alive while nothing else is sent (a long prefill): the Responses API has no ping event,
        and an SSE comment is no event to a client that times out between events (Codex reconnects after
        300 s without one), so the response says again that it is in progress."""
        return self._event("response.in_progress", response=self.shell.body("in_progress", self.output_items, None))

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        out, = outs
        text, calls = split_output(self.ctx.prompt, out.text)
        output = [_reasoning_item(new_id("rs_"), out.reasoning, "completed")] if out.reasoning else []
        if text or not calls:
            output.append(_message_item(new_id("msg_"), text, "completed"))
        for name, args in calls:
            output.append(_call_item(self.names, name, args if isinstance(args, str) else to_json(args), "completed"))
        return self._done(self.shell.body(_status(out), output, out))

    def _done(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.on_done is not None:
            self.on_done(body)
        return body

    def start(self, first: RequestOutput | None, admitted: dict[str, int]) -> Iterable[bytes]:
        yield self._event("response.created", response=self.shell.body("in_progress", [], None))
        yield self._event("response.in_progress", response=self.shell.body("in_progress", [], None))

    def output(self, out: RequestOutput, choice: int) -> Iterable[bytes]:
        if out.delta_reasoning:
            if self.item is None or self.item["type"] != "reasoning":
                yield from self._close_item()
                yield from self._open_item(_reasoning_item(new_id("rs_"), "", "in_progress"))
            self.text += out.delta_reasoning
            yield self._event("response.reasoning_text.delta", item_id=self.item["id"],
                              output_index=len(self.output_items), content_index=0, delta=out.delta_reasoning)
        if out.delta_text:
            yield from self._pieces(self.splitter.feed(out.delta_text))

    def end(self, final: RequestOutput, cost: dict[str, Any]) -> Iterable[bytes]:
        yield from self._pieces(self.splitter.flush())
        yield from self._close_item()
        if not any(item["type"] != "reasoning" for item in self.output_items):  # an empty answer is still one
            # (empty) message, as the body has
            yield from self._open_item(_message_item(new_id("msg_"), "", "in_progress"))
            yield from self._close_item()
        status = _status(final)
        body = self._done(self.shell.body(status, self.output_items, final))
        yield self._event(f"response.{status}", response=body, **({"stratum_cost": cost} if self.ctx.meta else {}))

    def error(self, e: APIError) -> bytes:
        return sse_error(e, self.ctx.request_id, self.ctx.endpoint, self.sequence)

    def _event(self, kind: str, **data: Any) -> bytes:
        body = to_json({"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        return f"event: {kind}\ndata: {body}\n\n".encode()

    def _open_item(self, new: dict[str, Any]) -> Iterable[bytes]:
        self.item = new
        index = len(self.output_items)
        yield self._event("response.output_item.added", output_index=index, item=new)
        if new["type"] == "message":
            yield self._event("response.content_part.added", item_id=new["id"], output_index=index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        elif new["type"] == "reasoning":
            yield self._event("response.content_part.added", item_id=new["id"], output_index=index,
                              content_index=0, part={"type": "reasoning_text", "text": ""})

    def _close_item(self) -> Iterable[bytes]:
        if self.item is None:
            return
        index, done = len(self.output_items), self.item
        if done["type"] == "message":
            text = self.text
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield self._event("response.output_text.done", item_id=done["id"], output_index=index, content_index=0,
                              text=text, logprobs=[])
            yield self._event("response.content_part.done", item_id=done["id"], output_index=index, content_index=0,
                              part=part)
            done, self.text = _message_item(done["id"], text, "completed"), ""
        elif done["type"] == "reasoning":
            text, part = self.text, {"type": "reasoning_text", "text": self.text}
            yield self._event("response.reasoning_text.done", item_id=done["id"], output_index=index, content_index=0,
                              text=text)
            yield self._event("response.content_part.done", item_id=done["id"], output_index=index, content_index=0,
                              part=part)
            done, self.text = _reasoning_item(done["id"], text, "completed"), ""
        elif done["type"] == "custom_tool_call":
            yield self._event("response.custom_tool_call_input.done", item_id=done["id"], output_index=index,
                              input=done["input"])
        else:
            yield self._event("response.function_call_arguments.done", item_id=done["id"], output_index=index,
                              name=done["name"], arguments=done["arguments"])
            done = {**done, "status": "completed"}
        yield self._event("response.output_item.done", output_index=index, item=done)
        self.output_items.append(done)
        self.item = None

    def _pieces(self, events: list[AnswerEvent]) -> Iterable[bytes]:
        for event in events:
            match event:
                case TextPiece(text):
                    if self.item is None or self.item["type"] != "message":
                        yield from self._close_item()
                        yield from self._open_item(_message_item(new_id("msg_"), "", "in_progress"))
                    self.text += text
                    yield self._event("response.output_text.delta", item_id=self.item["id"],
                                      output_index=len(self.output_items), content_index=0, delta=text, logprobs=[])
                case CallStart(name):
                    yield from self._close_item()
                    yield from self._open_item(_call_item(self.names, name, "", "in_progress"))
                case CallArguments(fragment):
                    is_custom = self.item["type"] == "custom_tool_call"
                    self.item["input" if is_custom else "arguments"] += fragment
                    kind = "custom_tool_call_input" if is_custom else "function_call_arguments"
                    yield self._event(f"response.{kind}.delta", item_id=self.item["id"],
                                      output_index=len(self.output_items), delta=fragment)
                case CallEnd():
                    yield from self._close_item()
