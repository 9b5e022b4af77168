"""The serving side of the engine boundary: `EngineClient` submits and aborts requests, streams their
outputs (`RequestStream`, `RequestGroup`) and holds the `EngineSnapshot` the engine published last.
The server talks to the engine through the client alone; nothing on the serving side reads the
scheduler or the KV pool, and nothing there waits for a step.

Commands and events are the typed records of `stratum.engine.protocol`. How they travel is the
client's `Transport`: the engine loop (`stratum.engine.loop`) in a thread of this process
(`stratum.engine.thread_transport`), in a process of its own (`stratum.engine.process`) or in each of a
set of Ray Serve replicas (`stratum.cluster`), behind the same client.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import uuid
from collections import deque
from dataclasses import dataclass, replace

from stratum.engine.outputs import EngineDeadError, RequestOutput
from stratum.engine.protocol import (
    Abort, Accepted, AddRequest, Command, EngineDied, EngineInfo, EngineSnapshot, Event, RequestFailed, Routed, Started,
)
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams
from stratum.engine.supervisor import Supervision


class QueueFull(RuntimeError):
    """The waiting queue holds --max-waiting admitted requests already."""

    def __init__(self, max_waiting: int, retry_after_s: int):
        super().__init__(f"the waiting queue is full ({max_waiting} requests)")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ReplicaView:
    """One engine replica of several, as its last report showed it (/health, /metrics)."""

    name: str
    pid: int | None
    snapshot: EngineSnapshot
    in_flight: int  # requests routed to it that had not completed, as the router counted at that report
    held_blocks: int  # cached block keys it reported
    reported_at: float  # wall-clock time of that report


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _take(queue: asyncio.Queue, timeout: float | None):
    """The next item, or None when timeout passes first. (asyncio.timeout, not wait_for: wait_for
    wraps every get in a task of its own, a cost paid per streamed token.)"""
    if not queue.empty():
        return queue.get_nowait()
    if not timeout:
        return await queue.get()
    try:
        async with asyncio.timeout(timeout):
            return await queue.get()
    except TimeoutError:
        return None


class RequestStream:
    """One request's outputs, as the serving side reads them: `next(timeout)`, or `async for`.

    Closing it before the last output aborts the request in the engine and frees its blocks (client
    disconnects end up here)."""

    def __init__(self, client: "EngineClient", request_id: str):
        self.client = client
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.expected_cached_tokens: int | None = None  # what the prefix cache will serve, once the engine has it
        self.replica: str | None = None  # the replica serving it, when the engine is a set of replicas

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output; None on timeout; raises the engine's error; StopAsyncIteration after the last."""
        if self.done:
            raise StopAsyncIteration
        item = await _take(self.queue, timeout)
        if item is None:
            return None
        if isinstance(item, BaseException):
            self.end()
            raise item
        if item.finished:
            self.end()
        return item

    def end(self) -> None:
        """Its last output (or its error) is read: the client forgets it."""
        self.done = True
        self.client._forget(self.request_id)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        out = None
        while out is None:
            out = await self.next()
        return out

    async def close(self) -> None:
        if not self.done:
            self.done = True
            self.client.abort(self.request_id)

    def stop(self, request_id: str | None = None) -> None:
        """Abort the request in the engine (its blocks are freed) but keep reading: its last output,
        finish_reason "abort", still comes with what it generated (a content policy's block bills it)."""
        if not self.done:
            self.client.transport.abort(self.request_id)

    def cancel(self, error: BaseException) -> None:
        """End the request now: the engine aborts it (its blocks are freed), and the reader gets `error`
        after whatever outputs it has not read yet."""
        if not self.done:
            self.client.abort(self.request_id)
            self.queue.put_nowait(error)


class RequestGroup:
    """Several requests read as one stream (n samples of one prompt): the outputs of all of them in
    the order they arrive, `done` once every member has finished. Same interface as RequestStream."""

    def __init__(self, members: list[RequestStream]):
        self.members = {m.request_id: m for m in members}
        self.request_id = members[0].request_id
        self.queue = members[0].queue  # shared by every member

    @property
    def expected_cached_tokens(self) -> int | None:
        return self.members[self.request_id].expected_cached_tokens

    @property
    def replica(self) -> str | None:
        return self.members[self.request_id].replica

    @property
    def done(self) -> bool:
        return all(m.done for m in self.members.values())

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        if self.done:
            raise StopAsyncIteration
        item = await _take(self.queue, timeout)
        if item is None:
            return None
        if isinstance(item, BaseException):
            await self.close()
            raise item
        if item.finished:
            self.members[item.request_id].end()
        return item

    async def close(self) -> None:
        for m in self.members.values():
            await m.close()

    def stop(self, request_id: str | None = None) -> None:
        """`RequestStream.stop` of one member (the first without `request_id`)."""
        self.members[request_id or self.request_id].stop()

    def cancel(self, error: BaseException) -> None:
        for m in self.members.values():
            if not m.done:
                m.client.abort(m.request_id)
        self.queue.put_nowait(error)


class Transport:
    """How an `EngineClient` reaches its engine: commands go out through `send`; events come back
    through `client.deliver` (from any thread) or `client.receive` (on the client's event loop).

    `ThreadTransport` (`stratum.engine.thread_transport`) and `EngineProcess` (`stratum.engine.process`) reach one
    engine loop, which publishes its own snapshots; the cluster's transport (`stratum.cluster.client`)
    reaches a set of replicas, publishes their summed snapshot as they report, and lists them
    (`replicas`).
    """

    client: "EngineClient"

    def bind(self, client: "EngineClient") -> None:
        """The client whose events this transport delivers (set once, by the client)."""
        self.client = client

    def send(self, commands: list[Command]) -> None:
        """Hand commands to the engine, in order (thread-safe). A group of requests read as one
        stream arrives as one list."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """The client stopped reading the request (its stream is forgotten already)."""
        if self.client.is_alive:
            self.send([Abort(request_id)])

    def replicas(self) -> list[ReplicaView]:
        """The replicas behind the client, when the engine is several; else none."""
        return []

    def supervision(self) -> Supervision | None:
        """Where the supervisor of a restartable engine stands (`EngineProcess` with restarts); else None."""
        return None

    def shutdown(self) -> None:
        pass


class EngineClient:
    """The serving side's one handle on the engine.

    Args:
        info: the engine's resolved configuration and kernel choices (`info` and `config` follow a switch
            of kernels: `EngineCore.switch_kernels`).
        tokenizer, chat_template: the model's, for the serving side's own tokenization.
        transport: how commands reach the engine and its events come back; bound to this client.
        engine_pid: the process that runs the engine loop (default: this one).
    """

    def __init__(self, info: EngineInfo, tokenizer, chat_template, transport: Transport, engine_pid: int | None = None):
        self.info = info
        self.engine_pid = engine_pid or os.getpid()
        self.config = info.config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.transport = transport
        self._published = EngineSnapshot(alive=True)  # the engine's last snapshot (a replica set's sum)
        self._streams: dict[str, RequestStream] = {}
        self._queued: set[str] = set()  # admitted, not yet scheduled: what --max-waiting counts
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recent_e2e: deque[float] = deque(maxlen=32)
        transport.bind(self)

    # ---- the transport calls these ------------------------------------------------------------------
    def deliver(self, events: list[Event]) -> None:
        """Events from the engine, from whatever thread reads them: applied to the requests at once
        when that is the thread of the client's event loop, else handed to that loop."""
        for event in events:  # the snapshot is a plain reference swap: readable at once, from any thread
            match event:
                case EngineSnapshot():
                    self._published = event
                case EngineInfo():  # the engine switched kernels: every report follows
                    self.info, self.config = event, event.config
                case EngineDied(reason=reason):
                    self._published = replace(self._published, alive=False, error=reason)
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _running_loop() is loop:
            self.receive(events)
            return
        try:
            loop.call_soon_threadsafe(self.receive, events)
        except RuntimeError:  # the loop closed in between
            pass

    def receive(self, events: list[Event]) -> None:
        """Events applied to the requests they concern, on the client's event loop."""
        for event in events:
            match event:
                case RequestOutput():
                    stream = self._streams.get(event.request_id)
                    if stream is not None:
                        stream.queue.put_nowait(event)
                    stats = event.stats
                    if (event.finished and event.finish_reason != "abort" and stats is not None
                            and stats.finish_time is not None):
                        self._recent_e2e.append(stats.finish_time - stats.arrival_time)
                case Accepted(request_id=rid):
                    if (stream := self._streams.get(rid)) is not None:
                        stream.expected_cached_tokens = event.expected_cached_tokens
                case Routed(request_id=rid):
                    if (stream := self._streams.get(rid)) is not None:
                        stream.replica = event.replica
                case Started(request_ids=rids):
                    self._queued.difference_update(rids)
                case RequestFailed(request_id=rid):
                    if (stream := self._streams.get(rid)) is not None:
                        stream.queue.put_nowait(event.exception())
                case EngineDied(reason=reason):
                    error = EngineDeadError(f"the engine stopped: {reason}")
                    for stream in list(self._streams.values()):
                        stream.queue.put_nowait(error)
                    self._streams.clear()
                    self._queued.clear()

    def restarted(self, info: EngineInfo, engine_pid: int) -> None:
        """A new engine behind the same transport, after the last one died (its supervisor started it):
        its configuration and process, and a live placeholder snapshot until its first report."""
        self.info, self.config, self.engine_pid = info, info.config, engine_pid
        self._published = EngineSnapshot(alive=True)

    def is_open(self, request_id: str) -> bool:
        """Whether the request's stream is still read."""
        return request_id in self._streams

    # ---- the serving side (one event loop) ----------------------------------------------------------
    @property
    def snapshot(self) -> EngineSnapshot:
        """What the engine looked like after its last step (the replicas' sum, for a replica set)."""
        return self._published

    @property
    def is_alive(self) -> bool:
        return self._published.alive

    @property
    def width(self) -> int:
        """Engines behind this client (their queues and batches add up): the live replicas, or 1."""
        return max(1, self._published.num_engines)

    def replicas(self) -> list[ReplicaView]:
        """The replicas behind this client, when the engine is several (`stratum.cluster`); else none."""
        return self.transport.replicas()

    @property
    def supervision(self) -> Supervision | None:
        """Where the engine's supervisor stands (restarting, how often it restarted); None when unsupervised."""
        return self.transport.supervision()

    @property
    def num_queued(self) -> int:
        """Admitted requests that have not started running (what --max-waiting bounds)."""
        return len(self._queued)

    def take_queue_slot(self, request_id: str) -> None:
        """Count a request against the waiting queue from this moment on (`release` gives it back).

        Raises:
            EngineDeadError: the engine loop is gone.
            QueueFull: --max-waiting requests are admitted and waiting already.
        """
        snapshot = self._published
        if not snapshot.alive:
            raise EngineDeadError(f"the engine is not running ({snapshot.error or 'stopped'})")
        width = max(1, snapshot.num_engines)
        limit = self.config.scheduler.max_waiting * width
        if len(self._queued) >= limit:
            raise QueueFull(limit, self._retry_after_s(snapshot.num_running, width))
        self._queued.add(request_id)

    def release(self, request_id: str) -> None:
        """An admitted request that will not run after all (refused, failed before submission)."""
        self._queued.discard(request_id)

    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """Raises InvalidRequestError when the request can never run on this engine."""
        self.config.check_request(num_prompt_tokens, sampling)

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
               **options) -> RequestStream:
        """Queue a request in the engine now; its outputs (or its error) arrive on the stream.

        options: `AddRequest`'s fields after `sampling` (priority, cache_salt, cache_policy, ...).
        """
        stream = self._open(request_id or uuid.uuid4().hex)
        self.transport.send([AddRequest(stream.request_id, list(prompt_token_ids), sampling, **options)])
        return stream

    def submit_group(self, prompts: list[list[int]], samplings: list[SamplingParams], request_ids: list[str],
                     forks: list[str | None], **options) -> RequestGroup:
        """Queue several requests read as one stream: n samples of a prompt (each with its own sampling),
        or several prompts. A member with a fork (the id of an earlier member with the same prompt)
        starts from that member's computed prompt instead of computing it again."""
        members: list[RequestStream] = []
        try:
            for rid in request_ids:
                members.append(self._open(rid))
            for stream in members[1:]:
                stream.queue = members[0].queue
            self.transport.send([AddRequest(rid, list(ids), sampling, **options, fork_of=fork)
                                 for ids, sampling, rid, fork in zip(prompts, samplings, request_ids, forks)])
        except BaseException:  # none of them was queued: none stays open
            for stream in members:
                self._forget(stream.request_id)
            raise
        return RequestGroup(members)

    def _open(self, request_id: str) -> RequestStream:
        if not self._published.alive:
            raise EngineDeadError(f"the engine is not running ({self._published.error or 'stopped'})")
        self._loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        stream = self._streams[request_id] = RequestStream(self, request_id)
        return stream

    def abort(self, request_id: str) -> None:
        if self._forget(request_id):
            self.transport.abort(request_id)

    def shutdown(self) -> None:
        self.transport.shutdown()

    def _forget(self, request_id: str) -> bool:
        self._queued.discard(request_id)
        return self._streams.pop(request_id, None) is not None

    def _retry_after_s(self, num_running: int, width: int) -> int:
        """Seconds until a queue slot is likely free: recent request time x queued / batch size, with
        jitter so that rejected clients do not all come back at once."""
        typical = sum(self._recent_e2e) / len(self._recent_e2e) if self._recent_e2e else 1.0
        batches = (len(self._queued) + num_running) / max(1, self.config.scheduler.max_num_seqs * width)
        return max(1, math.ceil(typical * max(1.0, batches) * random.uniform(0.5, 1.5)))
