"""OpenAI chat completions: the response body and the SSE chunk stream."""

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
from stratum.server.anthropic_api import split_output
from stratum.server.errors import APIError, as_api_error, sse_error

log = logging.getLogger("stratum.server")


def finish_reason(out: RequestOutput, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if out.finish_reason == "length" else "stop"


def usage(out: RequestOutput) -> dict[str, Any]:
    s = out.stats
    return {"prompt_tokens": s.num_prompt_tokens, "completion_tokens": s.num_output_tokens,
            "total_tokens": s.num_prompt_tokens + s.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": s.num_cached_tokens}}


def tool_calls(calls) -> list[dict[str, Any]]:
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}} for n, a in calls]


def completion_body(cid: str, model: str, prompt, out: RequestOutput) -> dict[str, Any]:
    text, calls = split_output(prompt, out.text)
    message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        message["tool_calls"] = tool_calls(calls)
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(out, bool(calls)), "logprobs": None}],
            "usage": usage(out)}


def chunk_stream(rt: pipeline.Runtime, job: pipeline.Job, stream: RequestStream, first: RequestOutput | None, cid: str,
                 model: str, include_usage: bool, ping_interval_s: float) -> StreamingResponse:
    prompt = job.prompt
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, use=None, choices=True, extra=None) -> bytes:
        body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if choices else []}
        if use is not None:
            body["usage"] = use
        if extra:
            body.update(extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    async def events():
        buffer_all = bool(prompt.tool_names)
        out = None
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for out in pipeline.paced(stream, first, ping_interval_s):
                if out is None:
                    yield b": ping\n\n"
                elif out.delta_text and not buffer_all:
                    yield chunk({"content": out.delta_text}, extra={"stratum_meta": pipeline.stream_meta(out)})
            text, calls = split_output(prompt, out.text)
            if buffer_all and text:
                yield chunk({"content": text})
            if calls:
                yield chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(tool_calls(calls))]})
            _, cost = pipeline.finish(rt, job, out)
            yield chunk({}, finish=finish_reason(out, bool(calls)), extra={"stratum_cost": cost})
            if include_usage:
                yield chunk({}, use=usage(out), choices=False)
            yield b"data: [DONE]\n\n"
        except Exception as e:  # after the 200 a failure becomes one error chunk, then the stream ends
            if not isinstance(e, APIError):
                log.exception("stream failed")
            yield sse_error(as_api_error(e), job.request_id, job.endpoint)

    return pipeline.event_response(events(), rt, job, pipeline.early_headers(rt, first, job))
