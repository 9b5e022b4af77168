"""Ollama's API: its two renderers (`OllamaChat` for /api/chat, `OllamaGenerate` for /api/generate),
NDJSON streams (one JSON object a line, the last with `done` and the request's figures) or one body;
and what /api/tags, /api/ps and /api/show say of the served model (`ModelCard`).

The final object's durations are nanoseconds, measured by the engine (`RequestStats`):
prompt_eval_duration is its prefill (first scheduled chunk to first sampled token), eval_duration
the first sampled token to the last, total_duration the request's wall time in the API process, and
load_duration 0 (the model is loaded once, at start, not per request).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable

from stratum.engine.outputs import RequestOutput
from stratum.server.errors import APIError
from stratum.server.render import RenderContext, answer_splitter, split_output, stream_meta, to_json
from stratum.server.tools import CallArguments, CallEnd, CallStart, TextPiece

MEDIA_TYPE = "application/x-ndjson"
# The Ollama release whose API these routes follow: clients decide from it which fields they may send
# (`think` needs 0.9, schema `format` 0.5, /api/ps `context_length` 0.6).
OLLAMA_VERSION = "0.12.0"


def created_at() -> str:
    """Now, as Ollama writes `created_at` (RFC 3339, UTC)."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return max(0, round(seconds * 1e9)) if seconds else 0


def final_fields(final: RequestOutput, wall0: float) -> dict[str, Any]:
    """The last object's `done`, `done_reason` and figures (a tool call ends as "stop", as Ollama's does)."""
    s = final.stats
    eval_s = s.finish_time - s.first_token_time if s and s.finish_time and s.first_token_time else None
    return {"done": True, "done_reason": "length" if final.finish_reason == "length" else "stop",
            "total_duration": _ns(time.perf_counter() - wall0), "load_duration": 0,
            "prompt_eval_count": s.num_prompt_tokens if s else 0,
            "prompt_eval_duration": _ns(s.prefill_s if s else None),
            "eval_count": s.num_output_tokens if s else 0, "eval_duration": _ns(eval_s)}


def loaded(model: str, is_chat: bool, unload: bool) -> dict[str, Any]:
    """The answer to a request with nothing to generate (Ollama's way to load or unload a model): done at once."""
    body: dict[str, Any] = {"model": model, "created_at": created_at()}
    body.update({"message": {"role": "assistant", "content": ""}} if is_chat else {"response": ""})
    return {**body, "done": True, "done_reason": "unload" if unload else "load"}


def error_line(e: APIError) -> bytes:
    """The line a stream that fails after its 200 ends with: Ollama's `{"error": ...}` (its client raises it)."""
    return (to_json({"error": e.message}) + "\n").encode()


def logprobs(tokenizer, token_ids: list[int], entries: list | None) -> list[dict[str, Any]] | None:
    """Ollama's `logprobs`: per token its text and log-probability, and its top alternatives, best first."""
    if entries is None:
        return None

    def text(token_id: int) -> str:
        return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    return [{"token": text(t), "logprob": lp, "top_logprobs": [{"token": text(a), "logprob": alp} for a, alp in top]}
            for t, (lp, top) in zip(token_ids, entries)]


class _Lines:
    """What both renderers share: a line per object, the output's log-probabilities (where asked) on
    the first object of its tokens; `meta` (negotiated: `X-Stratum-Negotiate: v1` or
    `X-Stratum-Meta: on`) adds `stratum_meta` to each object and `stratum_cost` to the last."""

    def __init__(self, ctx: RenderContext, wall0: float, meta: bool = False, tokenizer=None):
        self.ctx, self.wall0, self.meta, self.tokenizer = ctx, wall0, meta, tokenizer

    def _bodies(self, out: RequestOutput) -> Iterable[dict[str, Any]]:
        raise NotImplementedError

    def output(self, out: RequestOutput, choice: int) -> Iterable[bytes]:
        bodies = list(self._bodies(out))
        scores = logprobs(self.tokenizer, out.delta_token_ids, out.delta_logprobs)
        if scores:
            if not bodies:  # tokens whose text is held back (a marker that may yet begin), or markup
                bodies = [{**self._empty(), "done": False}]
            bodies[0] = {**bodies[0], "logprobs": scores}
        for body in bodies:
            yield self._line(body, out)

    def _scored(self, body: dict[str, Any], out: RequestOutput) -> dict[str, Any]:
        """A whole body, with its output's log-probabilities where they were asked for."""
        scores = logprobs(self.tokenizer, out.token_ids, out.logprobs)
        return body if scores is None else {**body, "logprobs": scores}

    def _empty(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def ping(self) -> bytes:
        """A keep-alive that is an object like the others, with nothing in it (a blank line would not parse)."""
        return self._line({"done": False, **self._empty()})

    def _line(self, body: dict[str, Any], out: RequestOutput | None = None) -> bytes:
        head = {"model": self.ctx.model, "created_at": created_at()}
        if self.meta and out is not None:
            body = {**body, "stratum_meta": stream_meta(out)}
        return (to_json({**head, **body}) + "\n").encode()

    def start(self, first: RequestOutput | None, admitted: dict[str, int]) -> Iterable[bytes]:
        return ()

    def _final(self, final: RequestOutput, cost: dict[str, Any] | None) -> dict[str, Any]:
        body = final_fields(final, self.wall0)
        if self.meta and cost is not None:
            body["stratum_cost"] = cost
        return body

    def error(self, e: APIError) -> bytes:
        return error_line(e)


class OllamaChat(_Lines):
    """A `render.Renderer` for /api/chat: `message` pieces (its `thinking`, its `content`, and each tool
    call whole, with its arguments as an object, once they are complete, as Ollama sends them)."""

    def __init__(self, ctx: RenderContext, wall0: float, meta: bool = False, tokenizer=None):
        super().__init__(ctx, wall0, meta, tokenizer)
        self.splitter = answer_splitter(ctx.prompt)
        self.call: tuple[str, list[str]] | None = None  # the open call: its name and argument fragments
        self.num_calls = 0

    def _empty(self) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": ""}}

    def _message(self, **fields: Any) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": "", **fields}, "done": False}

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        out = outs[0]
        text, calls = split_output(self.ctx.prompt, out.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if out.reasoning:
            message["thinking"] = out.reasoning
        if calls:
            message["tool_calls"] = [_tool_call(name, args, i) for i, (name, args) in enumerate(calls)]
        return self._scored({"model": self.ctx.model, "created_at": created_at(), "message": message,
                             **final_fields(out, self.wall0)}, out)

    def _bodies(self, out: RequestOutput) -> Iterable[dict[str, Any]]:
        if out.delta_reasoning:
            yield self._message(thinking=out.delta_reasoning)
        events = self.splitter.feed(out.delta_text) if out.delta_text else []
        if out.finished:
            events += self.splitter.flush()
        for event in events:
            match event:
                case TextPiece(text):
                    yield self._message(content=text)
                case CallStart(name):
                    self.call = name, []
                case CallArguments(fragment):
                    self.call[1].append(fragment)
                case CallEnd():
                    name, fragments = self.call
                    self.call = None
                    yield self._message(tool_calls=[_tool_call(name, _arguments(fragments), self.num_calls)])
                    self.num_calls += 1

    def end(self, final: RequestOutput, cost: dict[str, Any]) -> Iterable[bytes]:
        yield self._line({**self._empty(), **self._final(final, cost)})


class OllamaGenerate(_Lines):
    """A `render.Renderer` for /api/generate: `response` pieces (and `thinking`), and on the last object
    `context`, the conversation's tokens so far (the prompt's and the answer's), which a next request
    may send back to continue it."""

    def _empty(self) -> dict[str, Any]:
        return {"response": ""}

    def _context(self, out: RequestOutput) -> list[int]:
        return [*self.ctx.prompt_ids[0], *out.token_ids]

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        out = outs[0]
        body: dict[str, Any] = {"model": self.ctx.model, "created_at": created_at(), "response": out.text}
        if out.reasoning:
            body["thinking"] = out.reasoning
        return self._scored({**body, **final_fields(out, self.wall0), "context": self._context(out)}, out)

    def _bodies(self, out: RequestOutput) -> Iterable[dict[str, Any]]:
        if out.delta_reasoning:
            yield {"response": "", "thinking": out.delta_reasoning, "done": False}
        if out.delta_text:
            yield {"response": out.delta_text, "done": False}

    def end(self, final: RequestOutput, cost: dict[str, Any]) -> Iterable[bytes]:
        yield self._line({"response": "", **self._final(final, cost), "context": self._context(final)})


def _arguments(fragments: list[str]) -> dict[str, Any]:
    """A streamed call's arguments, joined and read as the object they are (the grammar held them to it)."""
    try:
        value = json.loads("".join(fragments))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_call(name: str, arguments: dict[str, Any] | str, index: int) -> dict[str, Any]:
    """One call as Ollama's `tool_calls` hold it: arguments as an object, never a JSON string."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    return {"function": {"index": index, "name": name, "arguments": arguments if isinstance(arguments, dict) else {}}}


# ---- the served model, as /api/tags, /api/ps and /api/show describe it --------------------------------
@dataclass(frozen=True, slots=True)
class ModelCard:
    """The served model in Ollama's terms, from the engine's `EngineInfo.model_facts`.

    name: the served name with Ollama's tag ("smollm2-135m:latest"); digest: SHA-256 of the file's
    identity (its path, size and modification time: `models.loader.file_identity`), not of its content.
    """

    name: str
    facts: dict[str, Any]
    digest: str
    context_length: int  # what the server serves (`--max-model-len`), not the trained context
    device: str

    @classmethod
    def of(cls, served_name: str, info) -> "ModelCard":
        facts = info.model_facts or {}
        name = served_name if ":" in served_name else served_name + ":latest"
        digest = hashlib.sha256(info.config.numerics.model.encode()).hexdigest()
        return cls(name, facts, digest, info.config.max_model_len, info.config.device)

    @classmethod
    def of_file(cls, served_name: str, path: str, facts: dict[str, Any]) -> "ModelCard":
        """A model not loaded yet, from its files alone (its shape is known once it has loaded)."""
        name = served_name if ":" in served_name else served_name + ":latest"
        return cls(name, facts, hashlib.sha256(path.encode()).hexdigest(), 0, "cpu")

    @property
    def family(self) -> str:
        return self.facts.get("architecture", "unknown")

    @property
    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": self.facts.get("format", "gguf"), "family": self.family,
                "families": [self.family], "parameter_size": parameter_size(self.facts.get("num_parameters", 0)),
                "quantization_level": self.facts.get("quantization", "unknown")}

    @property
    def size(self) -> int:
        return self.facts.get("file_bytes", 0)

    def tag(self, modified_at: str) -> dict[str, Any]:
        """An entry of /api/tags."""
        return {"name": self.name, "model": self.name, "modified_at": modified_at, "size": self.size,
                "digest": self.digest, "details": self.details}

    def running(self, expires_at: float | None = None) -> dict[str, Any]:
        """An entry of /api/ps: `expires_at` when its keep-alive runs out (monotonic seconds; None: it
        stays loaded, and none is given); `size` is its weights."""
        entry = {"name": self.name, "model": self.name, "size": self.size,
                 "size_vram": self.size if self.device.startswith("cuda") else 0, "digest": self.digest,
                 "details": self.details, "context_length": self.context_length}
        if expires_at is not None:
            at = datetime.now(timezone.utc) + timedelta(seconds=max(0.0, expires_at - time.monotonic()))
            entry["expires_at"] = at.isoformat().replace("+00:00", "Z")
        return entry

    def model_info(self) -> dict[str, Any]:
        """/api/show's `model_info`, keyed as a GGUF's metadata is (what clients read a context length from)."""
        f, arch = self.facts, self.family
        info: dict[str, Any] = {"general.architecture": arch, "general.basename": f.get("name", ""),
                                "general.parameter_count": f.get("num_parameters", 0)}
        keys = {"context_length": "context_length", "embedding_length": "embedding_length",
                "block_count": "block_count", "feed_forward_length": "feed_forward_length",
                "attention.head_count": "head_count", "attention.head_count_kv": "head_count_kv",
                "attention.layer_norm_rms_epsilon": "layer_norm_rms_epsilon", "rope.freq_base": "rope_freq_base",
                "vocab_size": "vocab_size"}
        info.update({f"{arch}.{key}": f[fact] for key, fact in keys.items() if fact in f})
        return info

    def show(self, template: str, parameters: dict[str, Any], capabilities: list[str],
             modified_at: str) -> dict[str, Any]:
        """The body of /api/show: `template` is the model's chat template (Jinja, not Ollama's Go
        templates), `parameters` the sampling a request that sets none gets."""
        lines = "\n".join(f"{k:<15}{v}" for k, v in parameters.items())
        return {"license": "", "modelfile": f"# the model served by Stratum\nFROM {self.name}\n", "parameters": lines,
                "template": template, "details": self.details, "model_info": self.model_info(),
                "capabilities": capabilities, "modified_at": modified_at}


def parameter_size(n: int) -> str:
    """A parameter count as Ollama writes it: "134.52M", "8.0B"."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.2f}K" if n >= 1e3 else str(n)
