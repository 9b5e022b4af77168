"""OpenAI chat completions and (legacy) completions: response bodies and SSE chunk streams.

n > 1 answers with one choice per sample; usage counts the prompt once. logprobs come from the
distribution each token was sampled from (`stratum.engine.sampler`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from fastapi.responses import StreamingResponse

from stratum.engine.client import RequestGroup, RequestStream
from stratum.engine.outputs import RequestOutput
from stratum.server import pipeline
from stratum.server import tools as tool_fmt
from stratum.server.anthropic_api import split_output
from stratum.server.errors import APIError, as_api_error, sse_error

log = logging.getLogger("stratum.server")


def finish_reason(out: RequestOutput, has_calls: bool) -> str:
    if out.finish_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def usage(out: RequestOutput) -> dict[str, Any]:
    s = out.stats
    return {"prompt_tokens": s.num_prompt_tokens, "completion_tokens": s.num_output_tokens,
            "total_tokens": s.num_prompt_tokens + s.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": s.num_cached_tokens}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_calls(calls) -> list[dict[str, Any]]:
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}} for n, a in calls]


# ---- log-probabilities -----------------------------------------------------------------------------
def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer, token_ids: list[int], entries: list | None) -> dict[str, Any] | None:
    """Chat's `logprobs.content`: per token its text, bytes, logprob and top alternatives, best first."""
    if entries is None:
        return None
    content = []
    for token_id, (logprob, top) in zip(token_ids, entries):
        text, raw = _token(tokenizer, token_id)
        alternatives = []
        for alt, lp in top:
            alt_text, alt_raw = _token(tokenizer, alt)
            alternatives.append({"token": alt_text, "logprob": lp, "bytes": alt_raw})
        content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def text_logprobs(tokenizer, token_ids: list[int], entries: list | None, offset: int) -> dict[str, Any] | None:
    """Completions' `logprobs`: tokens, token_logprobs, top_logprobs (token -> logprob) and text_offset.
    An entry may be None (the first prompt token of an echo: nothing precedes it)."""
    if entries is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text, _ = _token(tokenizer, token_id)
        tokens.append(text)
        values.append(None if entry is None else entry[0])
        tops.append(None if entry is None else {_token(tokenizer, alt)[0]: lp for alt, lp in entry[1]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _echo_logprobs(tokenizer, job: pipeline.Job, choice: int, out: RequestOutput) -> dict[str, Any] | None:
    """The scored prompt of an echoed choice, as completions' `logprobs` from offset 0."""
    if out.prompt_logprobs is None:
        return None
    return text_logprobs(tokenizer, job.prompt_ids[choice // job.n], out.prompt_logprobs, 0)


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


# ---- chat completions ------------------------------------------------------------------------------
def completion_body(cid: str, model: str, job: pipeline.Job, outs: list[RequestOutput], tokenizer) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outs):
        text, calls = split_output(job.prompt, out.text)
        message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
        if calls:
            message["tool_calls"] = tool_calls(calls)
        choices.append({"index": i, "message": message, "finish_reason": finish_reason(out, bool(calls)),
                        "logprobs": chat_logprobs(tokenizer, out.token_ids, out.logprobs)})
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(pipeline.merge(outs, job.n))}


def _chunk(cid: str, kind: str, created: int, model: str, index: int | None, payload: dict[str, Any],
           finish: str | None, logprobs, extra: dict[str, Any] | None, use: dict[str, Any] | None) -> bytes:
    """One SSE chunk: one choice's payload (a delta or text), or none with only usage (index None)."""
    body: dict[str, Any] = {"id": cid, "object": kind, "created": created, "model": model, "choices": [] if index is None
                            else [{"index": index, **payload, "finish_reason": finish, "logprobs": logprobs}]}
    if use is not None:
        body["usage"] = use
    if extra:
        body.update(extra)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def chunk_stream(rt: pipeline.Runtime, job: pipeline.Job, stream: RequestStream | RequestGroup,
                 first: RequestOutput | None, cid: str, model: str, include_usage: bool,
                 ping_interval_s: float) -> StreamingResponse:
    """One chunk per output per choice: content deltas, tool-call deltas (the name first, then argument
    fragments as they are generated), the finish reason, the cost, then usage if asked and [DONE]."""
    prompt = job.prompt
    tokenizer = rt.engine.tokenizer
    created = int(time.time())

    def chunk(index: int | None, delta: dict[str, Any], finish: str | None = None, logprobs=None, extra=None,
              use=None) -> bytes:
        return _chunk(cid, "chat.completion.chunk", created, model, index, {"delta": delta}, finish, logprobs, extra, use)

    async def events():
        prefill = prompt.prefill if prompt.is_forced_tool else ""
        splitters = {i: tool_fmt.AnswerSplitter(prompt.tool_names, prefill, prompt.tool_format) for i in job.choices.values()}
        calls = {i: -1 for i in job.choices.values()}  # the index of each choice's current tool call
        finals: dict[int, RequestOutput] = {}
        try:
            for i in splitters:
                yield chunk(i, {"role": "assistant", "content": ""})
            async for out in pipeline.paced(stream, first, ping_interval_s):
                if out is None:
                    yield b": ping\n\n"
                    continue
                i = job.choices[out.request_id]
                pieces = splitters[i].feed(out.delta_text) if out.delta_text else []
                if out.finished:
                    pieces += splitters[i].flush()
                logprobs = chat_logprobs(tokenizer, out.delta_token_ids, out.delta_logprobs)
                meta = {"stratum_meta": pipeline.stream_meta(out)}
                for what, value in pieces:
                    if what == "text":
                        yield chunk(i, {"content": value}, logprobs=logprobs, extra=meta)
                        logprobs = None
                    elif what == "name":
                        calls[i] += 1
                        yield chunk(i, {"tool_calls": [{"index": calls[i], "id": new_call_id(), "type": "function",
                                                        "function": {"name": value, "arguments": ""}}]}, extra=meta)
                    elif what == "args":
                        yield chunk(i, {"tool_calls": [{"index": calls[i], "function": {"arguments": value}}]},
                                    logprobs=logprobs, extra=meta)
                        logprobs = None
                if logprobs is not None and logprobs["content"]:  # tokens whose text is held back or markup
                    yield chunk(i, {}, logprobs=logprobs)
                if out.finished:
                    finals[i] = out
                    if len(finals) < len(job.choices):
                        yield chunk(i, {}, finish=finish_reason(out, calls[i] >= 0))
            merged = pipeline.merge([finals[i] for i in range(len(finals))], job.n)
            _, cost = pipeline.finish(rt, job, merged)
            yield chunk(i, {}, finish=finish_reason(finals[i], calls[i] >= 0), extra={"stratum_cost": cost})
            if include_usage:
                yield chunk(None, {}, use=usage(merged))
            yield b"data: [DONE]\n\n"
        except Exception as e:  # after the 200 a failure becomes one error chunk, then the stream ends
            if not isinstance(e, APIError):
                log.exception("stream failed")
            yield sse_error(as_api_error(e), job.request_id, job.endpoint)

    return pipeline.event_response(events(), rt, job, pipeline.early_headers(rt, first, job))


# ---- completions -----------------------------------------------------------------------------------
def text_body(cid: str, model: str, job: pipeline.Job, outs: list[RequestOutput], echoes: list[str],
              tokenizer) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outs):
        echo = echoes[i // job.n]
        logprobs = text_logprobs(tokenizer, out.token_ids, out.logprobs, len(echo))
        if echo:
            logprobs = _joined(_echo_logprobs(tokenizer, job, i, out), logprobs)
        choices.append({"index": i, "text": echo + out.text, "finish_reason": finish_reason(out, False),
                        "logprobs": logprobs})
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(pipeline.merge(outs, job.n))}


def text_stream(rt: pipeline.Runtime, job: pipeline.Job, stream: RequestStream | RequestGroup,
                first: RequestOutput | None, cid: str, model: str, include_usage: bool, ping_interval_s: float,
                echoes: list[str]) -> StreamingResponse:
    """Text chunks per choice; an echoed prompt (with its scores) comes first, with the choice's first output."""
    tokenizer = rt.engine.tokenizer
    created = int(time.time())

    def chunk(index: int | None, text: str, finish: str | None = None, logprobs=None, extra=None, use=None) -> bytes:
        return _chunk(cid, "text_completion", created, model, index, {"text": text}, finish, logprobs, extra, use)

    async def events():
        offsets = {i: len(echoes[i // job.n]) for i in job.choices.values()}
        started: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        try:
            async for out in pipeline.paced(stream, first, ping_interval_s):
                if out is None:
                    yield b": ping\n\n"
                    continue
                i = job.choices[out.request_id]
                echo = echoes[i // job.n]
                if echo and i not in started:
                    yield chunk(i, echo, logprobs=_echo_logprobs(tokenizer, job, i, out))
                started.add(i)
                logprobs = text_logprobs(tokenizer, out.delta_token_ids, out.delta_logprobs, offsets[i])
                offsets[i] += len(out.delta_text)
                if out.finished:
                    finals[i] = out
                if out.delta_text or (logprobs and logprobs["tokens"]):
                    yield chunk(i, out.delta_text, logprobs=logprobs, extra={"stratum_meta": pipeline.stream_meta(out)})
                if out.finished and len(finals) < len(job.choices):
                    yield chunk(i, "", finish=finish_reason(out, False))
            merged = pipeline.merge([finals[i] for i in range(len(finals))], job.n)
            _, cost = pipeline.finish(rt, job, merged)
            yield chunk(i, "", finish=finish_reason(finals[i], False), extra={"stratum_cost": cost})
            if include_usage:
                yield chunk(None, "", use=usage(merged))
            yield b"data: [DONE]\n\n"
        except Exception as e:
            if not isinstance(e, APIError):
                log.exception("stream failed")
            yield sse_error(as_api_error(e), job.request_id, job.endpoint)

    return pipeline.event_response(events(), rt, job, pipeline.early_headers(rt, first, job))
