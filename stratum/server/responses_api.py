"""OpenAI Responses API (`POST /v1/responses`): the response object and its SSE event stream.

An answer becomes output items: a `message` holding one `output_text` part, and a `function_call`
item per tool call (arguments as a JSON string, with a `call_id` the client answers with a
`function_call_output` item). The stream is the documented event sequence, every event numbered by
`sequence_number`:

    response.created, response.in_progress
    per item: response.output_item.added
        message:       response.content_part.added, response.output_text.delta..., response.output_text.done,
                       response.content_part.done
        function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
      response.output_item.done
    response.completed (or response.incomplete when max_output_tokens ended it; it also carries stratum_cost)
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from fastapi.responses import StreamingResponse

from stratum.engine.client import RequestStream
from stratum.engine.outputs import RequestOutput
from stratum.server import pipeline
from stratum.server import tools as tool_fmt
from stratum.server.anthropic_api import split_output
from stratum.server.errors import APIError, as_api_error, sse_error
from stratum.server.openai_api import new_call_id
from stratum.server.protocol import ResponsesRequest

log = logging.getLogger("stratum.server")


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex[:24]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage: input_tokens counts every prompt token, cache reads among them."""
    s = out.stats
    return {"input_tokens": s.num_prompt_tokens, "input_tokens_details": {"cached_tokens": s.num_cached_tokens},
            "output_tokens": s.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.num_prompt_tokens + s.num_output_tokens}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseShell:
    """The fields of a response object that do not depend on the answer: what the request asked."""

    def __init__(self, req: ResponsesRequest, sampling_temperature: float, sampling_top_p: float):
        self.id = new_response_id()
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
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": sampling_temperature, "top_p": sampling_top_p, "text": {"format": text_format},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or []], "truncation": "disabled",
            "user": req.user, "metadata": req.metadata or {},
        }

    def body(self, status: str, output: list[dict[str, Any]], out: RequestOutput | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
                "incomplete_details": incomplete, "output": output, **self.fields,
                "usage": usage(out) if out is not None else None}


def _status(out: RequestOutput) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"


def response_body(shell: ResponseShell, job: pipeline.Job, out: RequestOutput) -> dict[str, Any]:
    text, calls = split_output(job.prompt, out.text)
    output = []
    if text or not calls:
        output.append(_message_item(_item_id("msg"), text, "completed"))
    for name, args in calls:
        output.append(_call_item(_item_id("fc"), new_call_id(), name, json.dumps(args, ensure_ascii=False), "completed"))
    return shell.body(_status(out), output, out)


def event_stream(rt: pipeline.Runtime, job: pipeline.Job, stream: RequestStream, first: RequestOutput | None,
                 shell: ResponseShell, ping_interval_s: float) -> StreamingResponse:
    """The documented event sequence (module docstring); a keep-alive comment while waiting."""
    prompt = job.prompt
    sequence = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal sequence
        body = json.dumps({"type": kind, "sequence_number": sequence, **data}, ensure_ascii=False)
        sequence += 1
        return f"event: {kind}\ndata: {body}\n\n".encode()

    async def events():
        output: list[dict[str, Any]] = []
        item: dict[str, Any] | None = None  # the open output item
        text = ""  # the open message's text so far

        def open_item(new: dict[str, Any]):
            nonlocal item
            item = new
            yield event("response.output_item.added", output_index=len(output), item=new)
            if new["type"] == "message":
                yield event("response.content_part.added", item_id=new["id"], output_index=len(output),
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})

        def close_item():
            nonlocal item, text
            if item is None:
                return
            index, done = len(output), item
            if done["type"] == "message":
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                yield event("response.output_text.done", item_id=done["id"], output_index=index, content_index=0,
                            text=text, logprobs=[])
                yield event("response.content_part.done", item_id=done["id"], output_index=index, content_index=0,
                            part=part)
                done, text = _message_item(done["id"], text, "completed"), ""
            else:
                yield event("response.function_call_arguments.done", item_id=done["id"], output_index=index,
                            name=done["name"], arguments=done["arguments"])
                done = {**done, "status": "completed"}
            yield event("response.output_item.done", output_index=index, item=done)
            output.append(done)
            item = None

        def pieces_to_events(pieces):
            nonlocal text
            for what, value in pieces:
                if what == "text":
                    if item is None or item["type"] != "message":
                        yield from close_item()
                        yield from open_item(_message_item(_item_id("msg"), "", "in_progress"))
                    text += value
                    yield event("response.output_text.delta", item_id=item["id"], output_index=len(output),
                                content_index=0, delta=value, logprobs=[])
                elif what == "name":
                    yield from close_item()
                    yield from open_item(_call_item(_item_id("fc"), new_call_id(), value, "", "in_progress"))
                elif what == "args":
                    item["arguments"] += value
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=len(output),
                                delta=value)
                else:  # the end of a call
                    yield from close_item()

        try:
            yield event("response.created", response=shell.body("in_progress", [], None))
            yield event("response.in_progress", response=shell.body("in_progress", [], None))
            splitter = tool_fmt.AnswerSplitter(prompt.tool_names, prompt.prefill if prompt.is_forced_tool else "", prompt.tool_format)
            final = None
            async for out in pipeline.paced(stream, first, ping_interval_s):
                if out is None:
                    yield b": ping\n\n"
                    continue
                final = out
                if out.delta_text:
                    for chunk in pieces_to_events(splitter.feed(out.delta_text)):
                        yield chunk
            for chunk in pieces_to_events(splitter.flush()):
                yield chunk
            for chunk in close_item():
                yield chunk
            if not output:  # an empty answer is still one (empty) message, as the body has
                for chunk in open_item(_message_item(_item_id("msg"), "", "in_progress")):
                    yield chunk
                for chunk in close_item():
                    yield chunk
            _, cost = pipeline.finish(rt, job, final)
            status = _status(final)
            yield event(f"response.{status}", response=shell.body(status, output, final), stratum_cost=cost)
        except Exception as e:  # after the 200 a failure becomes one error event, then the stream ends
            if not isinstance(e, APIError):
                log.exception("stream failed")
            yield sse_error(as_api_error(e), job.request_id, job.endpoint, sequence)

    return pipeline.event_response(events(), rt, job, pipeline.early_headers(rt, first, job))
