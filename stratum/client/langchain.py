"""LangChain: a thin chat model on top of langchain-anthropic that keeps what its default streaming drops.

`ChatStratum` is `ChatAnthropic` with a Stratum client underneath. Every streamed `stratum_meta` event
becomes a chunk with it in `response_metadata["stratum_meta"]` (a list, so merged chunks keep them all, in order), and
the final cost arrives as a chunk with `response_metadata["stratum"]`; a non-streaming answer has
`response_metadata["stratum"]` from the headers. `StratumCallbackHandler` turns these into `on_meta` /
`on_cost` calls for the application, whichever way the model was run (invoke, stream, astream, events).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Callable, Mapping
from uuid import UUID

from langchain_anthropic import ChatAnthropic
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessageChunk
from langchain_core.outputs import ChatResult, LLMResult
from pydantic import Field

from stratum.client.sdk import AsyncStratum, Stratum

META_KEY = "stratum_meta"
COST_KEY = "stratum"


class ChatStratum(ChatAnthropic):
    """`ChatAnthropic` against a Stratum server (`base_url=`, `api_key=`, `model=` as for ChatAnthropic).

    Args (besides ChatAnthropic's):
        retry_policy: the Stratum client's RetryPolicy (it replaces max_retries for messages).
    """

    retry_policy: Any = Field(default=None, exclude=True)  # a RetryPolicy (Any: pydantic cannot schema it)

    @property
    def _llm_type(self) -> str:
        return "stratum-chat"

    @cached_property
    def _client(self) -> Stratum:
        plain = ChatAnthropic._client.func(self)  # the SDK client ChatAnthropic would build (proxy, timeouts)
        return Stratum(**self._client_params, http_client=plain._client, retry_policy=self.retry_policy)

    @cached_property
    def _async_client(self) -> AsyncStratum:
        plain = ChatAnthropic._async_client.func(self)
        return AsyncStratum(**self._client_params, http_client=plain._client, retry_policy=self.retry_policy)

    def _format_output(self, data: Any, **kwargs: Any) -> ChatResult:
        result = super()._format_output(data, **kwargs)
        info = getattr(data, "stratum", None)
        if info is not None:
            result.generations[0].message.response_metadata[COST_KEY] = info.as_dict()
        return result

    def _make_message_chunk_from_anthropic_event(self, event, *, stream_usage: bool = True,
                                                 coerce_content_to_string: bool, block_start_event=None):
        if event.type == "stratum_cost":  # the final cost: one chunk, kept by the merged message
            data = event.model_extra or {}
            cost = {k: data[k] for k in ("cost", "header", "final_cost_estimate", "mode", "trace") if k in data}
            return AIMessageChunk(content="" if coerce_content_to_string else [],
                                  response_metadata={COST_KEY: cost}), block_start_event
        if event.type == "stratum_meta":  # the state at the delta before it: one chunk, kept by the merged message
            data = event.model_extra or {}
            # no "index" key: LangChain merges list items that have one, and these must all be kept
            entry = {**(data.get("meta") or {}), "block": data.get("index")}
            return AIMessageChunk(content="" if coerce_content_to_string else [],
                                  response_metadata={META_KEY: [entry]}), block_start_event
        return super()._make_message_chunk_from_anthropic_event(
            event, stream_usage=stream_usage, coerce_content_to_string=coerce_content_to_string,
            block_start_event=block_start_event)


class StratumCallbackHandler(BaseCallbackHandler):
    """Delivers ChatStratum's `meta` and cost to the application.

    Args:
        on_meta: called with each meta ({"stratum_state", "kv_cache_efficiency", "block"}) as it streams.
        on_cost: called once per model run with its cost dict: the `stratum_cost` event's body for a stream
            (cost, header, final_cost_estimate, mode), StratumInfo.as_dict() for a non-streaming call.

    `metas` and `costs` keep everything received; `runs[run_id]` the same per run.
    """

    def __init__(self, on_meta: Callable[[dict], None] | None = None, on_cost: Callable[[dict], None] | None = None):
        self.on_meta = on_meta
        self.on_cost = on_cost
        self.metas: list[dict[str, Any]] = []
        self.costs: list[dict[str, Any]] = []
        self.runs: dict[UUID, dict[str, list]] = {}

    def _run(self, run_id: UUID) -> dict[str, list]:
        return self.runs.setdefault(run_id, {"metas": [], "costs": []})

    def _cost(self, run_id: UUID, cost: dict[str, Any]) -> None:
        run = self._run(run_id)
        if run["costs"]:  # a stream's cost came with its chunk already
            return
        run["costs"].append(cost)
        self.costs.append(cost)
        if self.on_cost is not None:
            self.on_cost(cost)

    def on_llm_new_token(self, token: str, *, chunk=None, run_id: UUID, **kwargs: Any) -> None:
        message = getattr(chunk, "message", None)
        if message is None:
            return
        for meta in message.response_metadata.get(META_KEY, ()):
            self.metas.append(meta)
            self._run(run_id)["metas"].append(meta)
            if self.on_meta is not None:
                self.on_meta(meta)
        if COST_KEY in message.response_metadata:
            self._cost(run_id, message.response_metadata[COST_KEY])

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        for generations in response.generations:
            for g in generations:
                message = getattr(g, "message", None)
                if message is not None and COST_KEY in message.response_metadata:
                    self._cost(run_id, message.response_metadata[COST_KEY])

    @property
    def last_cost(self) -> Mapping[str, Any] | None:
        return self.costs[-1] if self.costs else None
