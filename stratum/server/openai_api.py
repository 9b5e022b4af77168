"""OpenAI chat completions and (legacy) completions: response bodies and SSE chunk streams.

n > 1 answers with one choice per sample; usage counts the prompt once. logprobs come from the
distribution each token was sampled from (`stratum.engine.sampler`).
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from stratum.engine.outputs import RequestOutput
from stratum.server.errors import APIError, sse_error
from stratum.server.render import (
    RenderContext, answer_splitter, new_call_id, new_id, split_output, stream_meta, to_json,
)
from stratum.server.tools import CallArguments, CallStart, TextPiece
from stratum.server.usage import merge


def finish_reason(out: RequestOutput, has_calls: bool) -> str:
    if out.finish_reason in ("length", "content_filter"):
        return out.finish_reason
    return "tool_calls" if has_calls else "stop"


def usage(out: RequestOutput) -> dict[str, Any]:
    s = out.stats
    return {"prompt_tokens": s.num_prompt_tokens, "completion_tokens": s.num_output_tokens,
            "total_tokens": s.num_prompt_tokens + s.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": s.num_cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": s.num_reasoning_tokens}}


def tool_calls(calls) -> list[dict[str, Any]]:
    """The calls as chat completions' `tool_calls`: a function's arguments as JSON, a custom tool's raw input."""
    return [{"id": new_call_id(), "type": "custom", "custom": {"name": n, "input": a}} if isinstance(a, str) else
            {"id": new_call_id(), "type": "function", "function": {"name": n, "arguments": to_json(a)}}
            for n, a in calls]


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
        if tokenizer.special_token_id(text) != token_id:  # a special token (BOS) is not in the text
            offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _echo_logprobs(tokenizer, ctx: RenderContext, choice: int, out: RequestOutput) -> dict[str, Any] | None:
    """The scored prompt of an echoed choice, as completions' `logprobs` from offset 0."""
    if out.prompt_logprobs is None:
        return None
    return text_logprobs(tokenizer, ctx.prompt_ids[choice // ctx.n], out.prompt_logprobs, 0)


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


# ---- both ---------------------------------------------------------------------------------------------
class _Chunks:
    """What chat and text completions share: one SSE chunk per choice payload, a finish chunk for each
    choice that ends before the last (n > 1), and the last choice's finish with the cost, then usage
    if asked and [DONE]."""

    ping = b": ping\n\n"
    kind = ""  # the chunk's object type
    _empty: dict[str, Any] = {}  # a choice's payload with nothing in it

    def __init__(self, ctx: RenderContext, include_usage: bool, tokenizer, prefix: str):
        self.ctx, self.include_usage, self.tokenizer = ctx, include_usage, tokenizer
        self.id = new_id(prefix)
        self.created = int(time.time())
        self.num_finished = 0
        self.last: tuple[int, RequestOutput] | None = None  # the choice that finished last, and its output

    def _chunk(self, index: int | None, payload: dict[str, Any], finish: str | None = None, logprobs=None,
               extra: dict[str, Any] | None = None, use: dict[str, Any] | None = None) -> bytes:
        """One chunk: one choice's payload (a delta or text), or none with only usage (index None)."""
        body: dict[str, Any] = {"id": self.id, "object": self.kind, "created": self.created, "model": self.ctx.model,
                                "choices": [] if index is None else
                                [{"index": index, **payload, "finish_reason": finish, "logprobs": logprobs}]}
        if use is not None:
            body["usage"] = use
        if extra:
            body.update(extra)
        return f"data: {to_json(body)}\n\n".encode()

    def _finished(self, choice: int, out: RequestOutput) -> Iterable[bytes]:
        """A choice's end: its finish chunk now, unless it is the last to end (`end` sends that one)."""
        self.num_finished += 1
        self.last = choice, out
        if self.num_finished < self.ctx.num_choices:
            yield self._chunk(choice, self._empty, finish=self._finish_reason(choice, out))

    def _finish_reason(self, choice: int, out: RequestOutput) -> str:
        raise NotImplementedError

    def end(self, final: RequestOutput, cost: dict[str, Any]) -> Iterable[bytes]:
        choice, out = self.last
        yield self._chunk(choice, self._empty, finish=self._finish_reason(choice, out),
                          extra={"stratum_cost": cost} if self.ctx.meta else None)
        if self.include_usage:
            yield self._chunk(None, self._empty, use=usage(final))
        yield b"data: [DONE]\n\n"

    def error(self, e: APIError) -> bytes:
        return sse_error(e, self.ctx.request_id, self.ctx.endpoint)


# ---- chat completions ------------------------------------------------------------------------------
class Chat(_Chunks):
    """A `render.Renderer` for chat completions: the body, or one chunk per output per choice:
    content deltas, tool-call deltas (the name first, then argument fragments as they are generated; a
    custom tool's call as `custom` with `input` fragments),
    the finish reason, the cost, then usage if asked and [DONE]."""

    kind = "chat.completion.chunk"
    _empty: dict[str, Any] = {"delta": {}}

    def __init__(self, ctx: RenderContext, include_usage: bool, tokenizer):
        super().__init__(ctx, include_usage, tokenizer, "chatcmpl-")
        self.splitters = {i: answer_splitter(ctx.prompt) for i in range(ctx.num_choices)}
        self.calls = {i: -1 for i in range(ctx.num_choices)}  # the index of each choice's current tool call
        self.kinds = {i: ("function", "arguments") for i in range(ctx.num_choices)}  # its type, and its payload's key

    def _finish_reason(self, choice: int, out: RequestOutput) -> str:
        return finish_reason(out, self.calls[choice] >= 0)

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            text, calls = split_output(self.ctx.prompt, out.text)
            message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
            if out.reasoning:  # a reasoning model's thought, as vLLM, llama-server and DeepSeek's API return it
                message["reasoning_content"] = out.reasoning
            if calls:
                message["tool_calls"] = tool_calls(calls)
            choices.append({"index": i, "message": message, "finish_reason": finish_reason(out, bool(calls)),
                            "logprobs": chat_logprobs(self.tokenizer, out.token_ids, out.logprobs)})
        return {"id": self.id, "object": "chat.completion", "created": int(time.time()), "model": self.ctx.model,
                "choices": choices, "usage": usage(merge(outs, self.ctx.n))}

    def start(self, first: RequestOutput | None, admitted: dict[str, int]) -> Iterable[bytes]:
        for i in self.splitters:
            yield self._delta(i, {"role": "assistant", "content": ""})

    def _delta(self, index: int, delta: dict[str, Any], logprobs=None, extra=None) -> bytes:
        return self._chunk(index, {"delta": delta}, logprobs=logprobs, extra=extra)

    def output(self, out: RequestOutput, choice: int) -> Iterable[bytes]:
        i = choice
        pieces = self.splitters[i].feed(out.delta_text) if out.delta_text else []
        if out.finished:
            pieces += self.splitters[i].flush()
        logprobs = chat_logprobs(self.tokenizer, out.delta_token_ids, out.delta_logprobs)
        meta = {"stratum_meta": stream_meta(out)} if self.ctx.meta else None
        if out.delta_reasoning:
            yield self._delta(i, {"reasoning_content": out.delta_reasoning}, logprobs=logprobs, extra=meta)
            logprobs = None
        for event in pieces:
            match event:
                case TextPiece(text):
                    yield self._delta(i, {"content": text}, logprobs=logprobs, extra=meta)
                    logprobs = None
                case CallStart(name):
                    self.calls[i] += 1
                    kind, part = ("custom", "input") if name in self.ctx.prompt.raw_tools else ("function", "arguments")
                    self.kinds[i] = kind, part
                    yield self._delta(i, {"tool_calls": [{"index": self.calls[i], "id": new_call_id(), "type": kind,
                                                          kind: {"name": name, part: ""}}]}, extra=meta)
                case CallArguments(fragment):
                    kind, part = self.kinds[i]
                    yield self._delta(i, {"tool_calls": [{"index": self.calls[i], kind: {part: fragment}}]},
                                      logprobs=logprobs, extra=meta)
                    logprobs = None
        if logprobs is not None and logprobs["content"]:  # tokens whose text is held back or markup
            yield self._delta(i, {}, logprobs=logprobs)
        if out.finished:
            yield from self._finished(i, out)


# ---- completions -----------------------------------------------------------------------------------
class Text(_Chunks):
    """A `render.Renderer` for (legacy) completions: the body, or text chunks per choice; an echoed
    prompt (with its scores) comes first, with the choice's first output."""

    kind = "text_completion"
    _empty: dict[str, Any] = {"text": ""}

    def __init__(self, ctx: RenderContext, include_usage: bool, tokenizer, echoes: list[str]):
        super().__init__(ctx, include_usage, tokenizer, "cmpl-")
        self.echoes = echoes
        self.offsets = {i: len(echoes[i // ctx.n]) for i in range(ctx.num_choices)}
        self.started: set[int] = set()

    def _finish_reason(self, choice: int, out: RequestOutput) -> str:
        return finish_reason(out, False)

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        ctx, tokenizer = self.ctx, self.tokenizer
        choices = []
        for i, out in enumerate(outs):
            echo = self.echoes[i // ctx.n]
            logprobs = text_logprobs(tokenizer, out.token_ids, out.logprobs, len(echo))
            if echo:
                logprobs = _joined(_echo_logprobs(tokenizer, ctx, i, out), logprobs)
            choices.append({"index": i, "text": echo + out.text, "finish_reason": finish_reason(out, False),
                            "logprobs": logprobs})
        return {"id": self.id, "object": "text_completion", "created": int(time.time()), "model": ctx.model,
                "choices": choices, "usage": usage(merge(outs, ctx.n))}

    def start(self, first: RequestOutput | None, admitted: dict[str, int]) -> Iterable[bytes]:
        return ()

    def output(self, out: RequestOutput, choice: int) -> Iterable[bytes]:
        i = choice
        echo = self.echoes[i // self.ctx.n]
        if echo and i not in self.started:
            yield self._chunk(i, {"text": echo}, logprobs=_echo_logprobs(self.tokenizer, self.ctx, i, out))
        self.started.add(i)
        logprobs = text_logprobs(self.tokenizer, out.delta_token_ids, out.delta_logprobs, self.offsets[i])
        self.offsets[i] += len(out.delta_text)
        if out.delta_text or (logprobs and logprobs["tokens"]):
            yield self._chunk(i, {"text": out.delta_text}, logprobs=logprobs,
                              extra={"stratum_meta": stream_meta(out)} if self.ctx.meta else None)
        if out.finished:
            yield from self._finished(i, out)
