"""What the API renderers share, so that none imports another: the frozen `RenderContext` of a request,
the `Renderer` protocol the lifecycle drives, and the helpers every wire format uses."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from stratum.engine.outputs import RequestOutput
from stratum.server.chat import Prompt
from stratum.server.errors import APIError
from stratum.server.reasoning import ThoughtSigner
from stratum.server.tools import AnswerSplitter, parse_tool_calls


@dataclass(frozen=True, slots=True)
class RenderContext:
    """What a renderer knows of its request, fixed once the request is prepared."""

    request_id: str
    endpoint: str  # the route: which error shape a failed stream ends with
    model: str  # the model name the client sent, echoed in the answer
    prompt: Prompt  # the (first) prompt: its tools, tool-call format and forced start
    prompt_ids: tuple[list[int], ...]  # every prompt queued (several on /v1/completions)
    n: int  # samples per prompt: choice i answers prompt i // n
    cache_breakpoint: int  # prompt tokens up to the last cache_control breakpoint (0: none), for usage
    is_context_capped: bool  # max_tokens was lowered to the room the context leaves
    thoughts: ThoughtSigner | None = None  # signs a thinking block (the Messages API's)
    meta: bool = False  # the client reads Stratum's own stream events (`controls.asks_for_meta`)

    @property
    def num_choices(self) -> int:
        return len(self.prompt_ids) * self.n


class Renderer(Protocol):
    """One API's wire format for one request (`anthropic_api`, `openai_api`, `responses_api`)."""

    ping: bytes  # the keep-alive sent when ping_interval_s passes without an output

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        """The response body of a request read to its end: the finished output of each choice, in order."""

    def start(self, first: RequestOutput | None, admitted: dict[str, int]) -> Iterable[bytes]:
        """The events before any output (`first`: the prefill's output, when it came before the headers;
        `admitted`: the usage known at admission, for when it did not)."""

    def output(self, out: RequestOutput, choice: int) -> Iterable[bytes]:
        """The events of one output of one choice."""

    def end(self, final: RequestOutput, cost: dict[str, Any]) -> Iterable[bytes]:
        """The closing events, the cost among them (`final`: every choice's finished output merged)."""

    def error(self, e: APIError) -> bytes:
        """The one event that ends a stream failing after its 200 (`errors.sse_error`)."""


def _forced(prompt: Prompt) -> str:
    """What the prompt itself began of the answer: a forced tool call's opening (tool_choice any / tool)."""
    return prompt.prefill if prompt.is_forced_tool else ""


def split_output(prompt: Prompt, text: str) -> tuple[str, list[tuple[str, dict | str]]]:
    """A whole answer: its text and its tool calls (a custom tool's input is its raw text)."""
    full = _forced(prompt) + text
    if not prompt.tool_names:
        return full, []
    return parse_tool_calls(full, prompt.tool_names, prompt.tool_format, prompt.raw_tools)


def answer_splitter(prompt: Prompt) -> AnswerSplitter:
    """An answer as it streams: its text and its tool calls' pieces (`tools.AnswerEvent`s)."""
    return AnswerSplitter(prompt.tool_names, _forced(prompt), prompt.tool_format, prompt.raw_tools)


def new_call_id() -> str:
    """An OpenAI tool call's id (chat completions' `id`, a Responses function call's `call_id`)."""
    return "call_" + uuid.uuid4().hex[:24]


def new_id(prefix: str) -> str:
    """An object's id: `prefix` then 24 hex digits (msg, chatcmpl-, resp, fc...)."""
    return prefix + uuid.uuid4().hex[:24]


def to_json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)


def stream_meta(out: RequestOutput) -> dict[str, Any]:
    """The runtime's state at a streamed delta, for a client that asked for it: the meta-token state and the
    KV efficiency."""
    return {"stratum_state": out.state_label, "kv_cache_efficiency": round(out.kv_cache_efficiency, 4)}
