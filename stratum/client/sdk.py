"""`Stratum` and `AsyncStratum`: the official anthropic SDK clients plus what a Stratum server offers.

They are subclasses of `anthropic.Anthropic` / `anthropic.AsyncAnthropic`, so every call of the SDK works
unchanged. `messages.create` additionally:
  - negotiates once per client (OPTIONS /v1/messages, `X-Stratum-Negotiate: v1`); against a server that is
    not Stratum it does nothing else, silently, and the client is the plain SDK (its own max_retries included);
  - retries by reason with a RetryPolicy (the SDK's own retries are off on that path, so they do not double);
  - returns a message or stream whose `.stratum` is a StratumInfo (cost, trace, mode, final stream cost);
  - calls `event_hooks`: "stratum_meta" for every streamed `meta`, "stratum_cost" once a response's cost
    is complete, "retry" for every RetryEvent;
  - optionally standardises request fingerprints (`fingerprint=True`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping, TypeVar

import anthropic
import httpx2
from anthropic import AsyncStream, Stream
from anthropic.resources.messages import AsyncMessages, Messages
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import PrivateAttr

from stratum.client.cost import SESSION_HEADER, StratumInfo, StratumMeta
from stratum.client.fingerprint import Fingerprinter
from stratum.client.retry import Failure, RetryEvent, RetryPolicy, derive_session_id

NEGOTIATE_HEADER = "X-Stratum-Negotiate"
META_HEADER = "X-Stratum-Meta"
NEGOTIATION_VERSION = "v1"
NEGOTIATION_TIMEOUT_S = 10.0
HOOK_NAMES = frozenset({"stratum_meta", "stratum_cost", "retry"})
_RAW_RESPONSE_HEADER = "X-Stainless-Raw-Response"  # what the SDK's with_raw_response / with_streaming_response set
_T = TypeVar("_T")


class StratumMessage(Message):
    """An `anthropic.types.Message` with `.stratum` (None when the server is not Stratum)."""

    _stratum: StratumInfo | None = PrivateAttr(default=None)

    @property
    def stratum(self) -> StratumInfo | None:
        return self._stratum


def _attach(message: StratumMessage, info: StratumInfo | None) -> StratumMessage:
    if message.__pydantic_private__ is None:  # the SDK builds responses with construct(), which skips private init
        object.__setattr__(message, "__pydantic_private__", {})
    message._stratum = info
    return message


def _observe_event(info: StratumInfo, event: str | None, data: Mapping[str, Any]) -> tuple[str, Any] | None:
    """Update `info` from one SSE event. Returns the hook to call, as (name, argument), if any."""
    if event == "stratum_meta":
        m = StratumMeta.from_wire(data.get("meta") or {}, data.get("index"))
        info.metas.append(m)
        return "stratum_meta", m
    elif event == "message_start":
        info.usage.update((data.get("message") or {}).get("usage") or {})
    elif event == "message_delta":
        info.usage.update(data.get("usage") or {})
    elif event == "stratum_cost":
        info.apply_final(data)
        return "stratum_cost", info
    return None


class StratumStream(Stream[_T]):
    """An `anthropic.Stream` that watches the server's events as the SDK reads them: `meta` and the final
    `stratum_cost` go to `.stratum` and the hooks. The events the caller iterates are the SDK's, unchanged."""

    stratum: StratumInfo | None = None
    _stratum_hooks: Mapping[str, Callable] = {}
    _stratum_on_final: Callable[[StratumInfo], None] | None = None

    def _iter_events(self):
        for sse in super()._iter_events():
            if self.stratum is not None and sse.data and sse.event not in (None, "ping", "error"):
                hook = _observe_event(self.stratum, sse.event, sse.json())
                if hook is not None:
                    name, arg = hook
                    if name == "stratum_cost" and self._stratum_on_final is not None:
                        self._stratum_on_final(arg)
                    if (fn := self._stratum_hooks.get(name)) is not None:
                        fn(arg)
            yield sse


class AsyncStratumStream(AsyncStream[_T]):
    """The async StratumStream; hooks may be coroutine functions."""

    stratum: StratumInfo | None = None
    _stratum_hooks: Mapping[str, Callable] = {}
    _stratum_on_final: Callable[[StratumInfo], None] | None = None

    async def _iter_events(self):
        async for sse in super()._iter_events():
            if self.stratum is not None and sse.data and sse.event not in (None, "ping", "error"):
                hook = _observe_event(self.stratum, sse.event, sse.json())
                if hook is not None:
                    name, arg = hook
                    if name == "stratum_cost" and self._stratum_on_final is not None:
                        self._stratum_on_final(arg)
                    if (fn := self._stratum_hooks.get(name)) is not None:
                        result = fn(arg)
                        if inspect.isawaitable(result):
                            await result
            yield sse


@dataclass
class _Shared:
    """State a client shares with its copies (with_options): the negotiation result and switched sessions."""

    is_stratum: bool | None = None  # None until a negotiation got an answer
    switched_sessions: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _check_hooks(hooks: Mapping[str, Callable] | None) -> dict[str, Callable]:
    hooks = dict(hooks or {})
    unknown = set(hooks) - HOOK_NAMES
    if unknown:
        raise ValueError(f"unknown event hook(s) {sorted(unknown)}; known: {sorted(HOOK_NAMES)}")
    return hooks


class _StratumOptions:
    """The Stratum-specific constructor arguments, shared by the sync and async clients."""

    retry_policy: RetryPolicy
    event_hooks: dict[str, Callable]
    fingerprinter: Fingerprinter | None
    metrics: Any
    _negotiate: bool
    _stratum_shared: _Shared

    def _init_stratum(self, retry_policy, event_hooks, fingerprint, metrics, negotiate, shared) -> None:
        self.retry_policy = retry_policy if retry_policy is not None else RetryPolicy()
        self.event_hooks = _check_hooks(event_hooks)
        self.fingerprinter = Fingerprinter() if fingerprint is True else (fingerprint or None)
        self.metrics = metrics
        self._negotiate = negotiate
        self._stratum_shared = shared if shared is not None else _Shared(is_stratum=None if negotiate else True)

    def _stratum_copy_kwargs(self, kwargs: dict[str, Any], retry_policy, event_hooks, fingerprint,
                             metrics) -> dict[str, Any]:
        extra = dict(kwargs.pop("_extra_kwargs", None) or {})
        extra.update(
            retry_policy=retry_policy if retry_policy is not None else self.retry_policy,
            event_hooks=event_hooks if event_hooks is not None else self.event_hooks,
            fingerprint=fingerprint if fingerprint is not None else self.fingerprinter,
            metrics=metrics if metrics is not None else self.metrics,
            negotiate=self._negotiate,
            # a copy aimed elsewhere negotiates for itself
            _stratum_shared=self._stratum_shared if kwargs.get("base_url") is None else None,
        )
        kwargs["_extra_kwargs"] = extra
        return kwargs

    @property
    def _negotiation_url(self) -> str:
        return str(self.base_url).rstrip("/") + "/v1/messages"  # type: ignore[attr-defined]

    @staticmethod
    def _is_supported(response: httpx2.Response) -> bool:
        return response.headers.get("x-stratum-supported", "").strip().lower() == NEGOTIATION_VERSION


class Stratum(_StratumOptions, anthropic.Anthropic):
    """`anthropic.Anthropic` for a Stratum server.

    Args:
        retry_policy: how `messages.create` retries (RetryPolicy() by default).
        event_hooks: default hooks for every call ("stratum_meta", "stratum_cost", "retry"); a call's own
            `event_hooks` are merged over them.
        fingerprint: True or a Fingerprinter: standardise `system` and `messages` of every request.
        metrics: a ClientMetrics (stratum.client.prometheus) fed from every response's cost.
        negotiate: False skips the OPTIONS probe and treats the server as Stratum (e.g. behind a proxy
            that does not forward OPTIONS).
        **kwargs: everything `anthropic.Anthropic` takes (api_key, base_url, http_client, max_retries, ...).
            max_retries applies to every call except Stratum `messages.create`, which the policy retries.
    """

    def __init__(self, *, retry_policy: RetryPolicy | None = None, event_hooks: Mapping[str, Callable] | None = None,
                 fingerprint: bool | Fingerprinter = False, metrics: Any = None, negotiate: bool = True,
                 _stratum_shared: _Shared | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._init_stratum(retry_policy, event_hooks, fingerprint, metrics, negotiate, _stratum_shared)

    def copy(self, *, retry_policy: RetryPolicy | None = None, event_hooks: Mapping[str, Callable] | None = None,
             fingerprint: bool | Fingerprinter | None = None, metrics: Any = None, **kwargs: Any) -> "Stratum":
        return super().copy(**self._stratum_copy_kwargs(kwargs, retry_policy, event_hooks, fingerprint, metrics))

    with_options = copy

    @cached_property
    def messages(self) -> "StratumMessages":
        return StratumMessages(self)

    @cached_property
    def _policy_messages(self) -> Messages:
        """The SDK's own Messages resource on a copy without SDK retries: the policy path sends through it."""
        return Messages(self.copy(max_retries=0))

    def negotiate_stratum(self) -> bool:
        """Whether the server speaks Stratum v1: asked once (OPTIONS /v1/messages, X-Stratum-Negotiate: v1) and
        remembered by this client and its copies. An unreachable server is asked again next time (the request
        itself then reports the connection error, as the SDK would). Never raises, never logs."""
        shared = self._stratum_shared
        if shared.is_stratum is None:
            with shared.lock:
                if shared.is_stratum is None:
                    try:
                        response = self._client.request("OPTIONS", self._negotiation_url, timeout=NEGOTIATION_TIMEOUT_S,
                                                        headers={NEGOTIATE_HEADER: NEGOTIATION_VERSION})
                    except httpx2.HTTPError:
                        return False
                    shared.is_stratum = self._is_supported(response)
        return bool(shared.is_stratum)

    @property
    def is_stratum(self) -> bool:
        """negotiate_stratum(), as a property."""
        return self.negotiate_stratum()


class AsyncStratum(_StratumOptions, anthropic.AsyncAnthropic):
    """`anthropic.AsyncAnthropic` for a Stratum server; arguments as for Stratum. Hooks may be coroutine functions."""

    def __init__(self, *, retry_policy: RetryPolicy | None = None, event_hooks: Mapping[str, Callable] | None = None,
                 fingerprint: bool | Fingerprinter = False, metrics: Any = None, negotiate: bool = True,
                 _stratum_shared: _Shared | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._init_stratum(retry_policy, event_hooks, fingerprint, metrics, negotiate, _stratum_shared)

    def copy(self, *, retry_policy: RetryPolicy | None = None, event_hooks: Mapping[str, Callable] | None = None,
             fingerprint: bool | Fingerprinter | None = None, metrics: Any = None, **kwargs: Any) -> "AsyncStratum":
        return super().copy(**self._stratum_copy_kwargs(kwargs, retry_policy, event_hooks, fingerprint, metrics))

    with_options = copy

    @cached_property
    def messages(self) -> "AsyncStratumMessages":
        return AsyncStratumMessages(self)

    @cached_property
    def _policy_messages(self) -> AsyncMessages:
        return AsyncMessages(self.copy(max_retries=0))

    async def negotiate_stratum(self) -> bool:
        """As Stratum.negotiate_stratum. Concurrent first calls may each probe once; they agree on the answer."""
        shared = self._stratum_shared
        if shared.is_stratum is None:
            try:
                response = await self._client.request("OPTIONS", self._negotiation_url, timeout=NEGOTIATION_TIMEOUT_S,
                                                      headers={NEGOTIATE_HEADER: NEGOTIATION_VERSION})
            except httpx2.HTTPError:
                return False
            shared.is_stratum = self._is_supported(response)
        return bool(shared.is_stratum)


class _Call:
    """One `messages.create` call: its request as it evolves through retries, and how its result is wrapped."""

    def __init__(self, client: Stratum | AsyncStratum, params: dict[str, Any], event_hooks, session_keys,
                 is_stratum: bool):
        self.client = client
        self.is_stratum = is_stratum
        self.policy = client.retry_policy
        self.hooks = {**client.event_hooks, **_check_hooks(event_hooks)}
        self.session_keys = session_keys if session_keys is not None else self.policy.session_keys
        if client.fingerprinter is not None:
            params = client.fingerprinter.standardize_request(params)
        self.params = params
        headers = params.get("extra_headers") or {}
        self.raw_mode = headers.get(_RAW_RESPONSE_HEADER)
        self.is_stream = params.get("stream") is True
        self.attempt = 0
        self.retries: list[RetryEvent] = []
        self.hook_result: Any = None  # what the last `retry` hook returned (AsyncStratum awaits a coroutine)
        self.session_id: str | None = None
        if is_stratum and self.session_keys is not None:
            sid = derive_session_id(self.session_keys)
            if sid in client._stratum_shared.switched_sessions:  # this client already switched these keys
                self.session_id = sid

    def request(self) -> dict[str, Any]:
        """The kwargs for the SDK's create: always a raw response, so the headers can be read."""
        params = dict(self.params)
        headers = {**(params.get("extra_headers") or {}), _RAW_RESPONSE_HEADER: "raw"}
        if self.is_stratum:  # the stream's meta and cost events: a Stratum server sends them only when asked
            headers[META_HEADER] = "on"
        if self.session_id is not None:
            headers[SESSION_HEADER] = self.session_id
            params["metadata"] = {**(params.get("metadata") or {}), "user_id": self.session_id}
        params["extra_headers"] = headers
        return params

    def on_failure(self, e: anthropic.APIStatusError) -> float | None:
        """The delay before the next attempt, or None to raise `e`."""
        if not self.is_stratum:
            return None
        failure = Failure.from_response(e.status_code, e.body, e.response.headers)
        d = self.policy.next_action(failure, self.attempt, self.params, self.session_keys, self.session_id is not None)
        if d is None:
            return None
        event = RetryEvent(self.attempt, failure.status, failure.reason or "", d.action, d.delay_s, d.detail,
                           failure.request_id)
        self.retries.append(event)
        self.policy.report(event)
        if self.client.metrics is not None:
            self.client.metrics.observe_retry(event)
        if (fn := self.hooks.get("retry")) is not None:
            self.hook_result = fn(event)
        if d.action == "give_up":
            return None
        if d.action == "trim":
            self.params = d.params
        elif d.action == "session":
            self.session_id = d.session_id
            self.client._stratum_shared.switched_sessions.add(d.session_id)
        return d.delay_s

    def info(self, headers) -> StratumInfo | None:
        if not self.is_stratum:
            return None
        info = StratumInfo.from_headers(headers, is_stream=self.is_stream)
        info.session_id = self.session_id
        info.retries = list(self.retries)
        return info

    def observe_final(self, info: StratumInfo) -> None:
        if self.client.metrics is not None:
            self.client.metrics.observe(str(self.params.get("model", "")), info)

    def bind_stream(self, stream, info: StratumInfo | None):
        stream.stratum = info
        stream._stratum_hooks = self.hooks
        stream._stratum_on_final = self.observe_final
        return stream

    def finish_message(self, message: StratumMessage, info: StratumInfo | None) -> Any:
        """Attach `.stratum`, feed the metrics; returns what the stratum_cost hook returned (None without one)."""
        _attach(message, info)
        if info is None:
            return None
        info.usage = {k: v for k, v in message.usage.model_dump().items() if isinstance(v, int)}
        self.observe_final(info)
        fn = self.hooks.get("stratum_cost")
        return fn(info) if fn is not None else None

    def result(self, raw, parsed):
        if self.raw_mode == "raw":  # with_raw_response: its parse() hands back the Stratum object
            raw._parsed_by_type[raw._cast_to] = parsed
            return raw
        return parsed


class StratumMessages(Messages):
    """`client.messages` of Stratum: `create` takes `event_hooks` and `session_keys` besides the SDK's arguments."""

    def __init__(self, client: Stratum):
        super().__init__(client)
        self._stratum_client = client

    def create(self, *, event_hooks: Mapping[str, Callable] | None = None,
               session_keys: Mapping[str, Any] | list | str | None = None, **params: Any):
        """As `anthropic.Anthropic().messages.create`, plus:

        Args:
            event_hooks: {"stratum_meta": fn(StratumMeta), "stratum_cost": fn(StratumInfo), "retry": fn(RetryEvent)}.
            session_keys: keys a 418 derives the deterministic session id from (else the policy's).
        Returns:
            A StratumMessage, or a StratumStream with stream=True; both have `.stratum`.
        Raises:
            anthropic.APIStatusError and the SDK's other errors, once the policy gives up or does not apply.
        """
        client = self._stratum_client
        if (params.get("extra_headers") or {}).get(_RAW_RESPONSE_HEADER) == "stream":
            return super().create(**params)  # with_streaming_response: the SDK's own path
        is_stratum = client.negotiate_stratum()
        call = _Call(client, params, event_hooks, session_keys, is_stratum)
        send = client._policy_messages.create if is_stratum else super().create
        while True:
            call.attempt += 1
            try:
                raw = send(**call.request())
                break
            except anthropic.APIStatusError as e:
                delay = call.on_failure(e)
                if delay is None:
                    raise
                time.sleep(delay)
        info = call.info(raw.headers)
        if call.is_stream:
            return call.result(raw, call.bind_stream(raw.parse(to=StratumStream[RawMessageStreamEvent]), info))
        message = raw.parse(to=StratumMessage)
        call.finish_message(message, info)
        return call.result(raw, message)


class AsyncStratumMessages(AsyncMessages):
    """`client.messages` of AsyncStratum."""

    def __init__(self, client: AsyncStratum):
        super().__init__(client)
        self._stratum_client = client

    async def create(self, *, event_hooks: Mapping[str, Callable] | None = None,
                     session_keys: Mapping[str, Any] | list | str | None = None, **params: Any):
        """As StratumMessages.create, awaited; hooks may be coroutine functions."""
        client = self._stratum_client
        if (params.get("extra_headers") or {}).get(_RAW_RESPONSE_HEADER) == "stream":
            return await super().create(**params)
        is_stratum = await client.negotiate_stratum()
        call = _Call(client, params, event_hooks, session_keys, is_stratum)
        send = client._policy_messages.create if is_stratum else super().create
        while True:
            call.attempt += 1
            try:
                raw = await send(**call.request())
                break
            except anthropic.APIStatusError as e:
                delay = call.on_failure(e)
                if inspect.isawaitable(call.hook_result):
                    await call.hook_result
                    call.hook_result = None
                if delay is None:
                    raise
                await asyncio.sleep(delay)
        info = call.info(raw.headers)
        if call.is_stream:
            stream = await raw.parse(to=AsyncStratumStream[RawMessageStreamEvent])
            return call.result(raw, call.bind_stream(stream, info))
        message = await raw.parse(to=StratumMessage)
        pending = call.finish_message(message, info)
        if inspect.isawaitable(pending):
            await pending
        return call.result(raw, message)
