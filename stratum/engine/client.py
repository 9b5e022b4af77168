"""The boundary between the engine and whoever serves it.

The engine side is `EngineLoop`: it owns an `LLMEngine`, applies commands between steps and, after
every step, emits one batch of events (outputs, requests that left the queue, a fresh snapshot). The
serving side is `EngineClient`: submit, abort, stream outputs, and a read-only `EngineSnapshot`. The
server talks to the engine through the client alone; nothing on the serving side reads the
scheduler or the KV pool, and nothing there waits for a step.

Commands and events are the typed records of `stratum.engine.protocol`. How they travel is the
client's `Transport`: a thread of this process (`ThreadTransport`, here), a process of its own
(`stratum.engine.process`) or a set of Ray Serve replicas (`stratum.cluster`), behind the same client.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from itertools import islice
from typing import Callable

from stratum.engine.outputs import EngineDeadError, OrchestrationError, RequestOutput, StepError
from stratum.engine.protocol import (
    Abort, Accepted, AddRequest, Command, EngineDied, EngineInfo, EngineSnapshot, Event, HeldKeys, KVBlocks, ListHeld,
    RequestFailed, Routed, Started,
)
from stratum.engine.request import short_key
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams

log = logging.getLogger("stratum.engine")


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
    in_flight: int  # requests routed to it that have not completed
    held_blocks: int  # cached block keys it reported
    reported_at: float  # wall-clock time of that report


def count_kv_blocks(engine) -> KVBlocks:
    bm = engine.block_manager
    return KVBlocks(bm.num_blocks, bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks)


def take_snapshot(engine, rss_mb: float, kv_blocks: KVBlocks) -> EngineSnapshot:
    import torch

    sched = engine.scheduler
    steps = list(islice(reversed(engine.step_stats), 64))  # the latest, not a copy of all 1,024 (every step)
    total = sum(s.step_s for s in steps)
    gpu = round(torch.cuda.memory_allocated(engine.device) / 2**20, 1) if engine.device.type == "cuda" else None
    return EngineSnapshot(
        alive=True, mode=engine.mode, degraded_reason=engine.degraded_reason,
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        kv_blocks=kv_blocks,
        num_preemptions=sched.num_preemptions, num_steps=engine.num_steps,
        overhead_ratio=(total - sum(s.forward_s for s in steps)) / total if total > 0 else 0.0,
        mean_step_s=total / len(steps) if steps else 0.0, threads=torch.get_num_threads(), rss_mb=rss_mb,
        gpu_memory_allocated_mb=gpu, step="native" if engine.model.packed is not None else "pytorch",
        preparing=engine.upgrade.stage if engine.upgrade is not None else None,
        kv_tiers=engine.tier.report(),
    )


class EngineLoop:
    """The step loop. `submit` is thread-safe; `run` blocks until `stop` or death.

    Args:
        engine: the LLMEngine it owns; only this loop touches it.
        emit: receives one list of events (`stratum.engine.protocol`) per step, or per batch of
            commands, in order: RequestOutput, RequestFailed, Accepted, Started, HeldKeys when asked,
            then the EngineSnapshot after it; once, last, EngineDied.
    """

    RSS_EVERY_S = 0.5
    # Counting cached and in-use blocks walks the pool (milliseconds for a large GPU pool): while
    # requests run it is refreshed this often; the snapshot an idle engine leaves is always exact.
    KV_COUNT_EVERY_S = 0.05
    PREPARING_POLL_S = 0.5

    def __init__(self, engine, emit: Callable[[list[Event]], None]):
        self.engine = engine
        self.emit = emit
        self._commands: deque[Command] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self.death: str | None = None  # why run() ended, if it was not stop()
        self._rss = (0.0, 0.0)  # (when measured, MiB)
        self._kv: tuple[float, KVBlocks | None] = (0.0, None)

    def submit(self, command: Command) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def stop(self) -> None:
        self._stopped = True
        with self._wake:
            self._wake.notify()

    def run(self) -> None:
        try:
            self.emit([self._snapshot()])
            while not self._stopped:
                self._once()
        except BaseException as e:  # the loop is gone: every request in it must hear so, now
            self.death = f"{type(e).__name__}: {e}"
            log.critical("engine loop died: %s", self.death, exc_info=not isinstance(e, KeyboardInterrupt))
            self.emit([EngineDied(self.death)])
            if not isinstance(e, Exception):
                return  # the loop's own death (injected, or the interpreter stopping): nothing more to raise
            raise

    def _once(self) -> None:
        with self._wake:
            while not self._commands and not self.engine.has_unfinished() and not self._stopped:
                # while a cold start's kernels are prepared, an idle loop looks in now and then: to
                # switch to them (`LLMEngine.switch_kernels`), and to publish how far they are; and
                # while the disk tier writes, to publish its figures
                poll = self.engine.upgrade is not None or not self.engine.tier.is_settled
                if not self._wake.wait(self.PREPARING_POLL_S if poll else None):
                    break
            commands = list(self._commands)
            self._commands.clear()
        events: list[Event] = []
        for command in commands:
            self._apply(command, events)
        if self.engine.upgrade is not None and self.engine.switch_kernels():
            events.append(EngineInfo.of(self.engine))  # its configuration and kernel choices changed
        if self.engine.has_unfinished() and not self._stopped:
            self._step(events)
        events.append(self._snapshot())
        self.emit(events)

    def _apply(self, command: Command, events: list[Event]) -> None:
        match command:
            case AddRequest(request_id=rid):
                try:
                    seq = self.engine.add_request(
                        command.prompt_token_ids, command.sampling, request_id=rid, priority=command.priority,
                        cache_salt=command.cache_salt, cache_policy=command.cache_policy,
                        tool_marker=command.tool_marker, pin_prefixes=command.pin_prefixes,
                        low_latency=command.low_latency, fork_of=command.fork_of)
                except InvalidRequestError as e:
                    events.append(RequestFailed(rid, str(e), "invalid_request"))
                    return
                except Exception as e:  # the admission hook's refusal, or a bug: this request fails, not the loop
                    log.exception("add_request failed")
                    events.append(RequestFailed(rid, f"{type(e).__name__}: {e}", "internal"))
                    return
                try:  # what its cache hit will be, for usage reported before prefill ends; a broken cache only loses it
                    events.append(Accepted(rid, self.engine.expected_cached_tokens(seq)))
                except Exception:
                    log.debug("no expected cache hit for %s", rid, exc_info=True)
            case Abort(request_id=rid):
                out = self.engine.abort(rid)
                if out is not None:  # its last output: whoever assembles deltas can forget the request
                    events.append(out)
            case ListHeld(max_keys=n):  # what the prefix cache holds, most recent first, for a router to follow
                bm = self.engine.block_manager
                keys = bm.cache.recent_keys(n) if bm.enable_prefix_cache else []
                events.append(HeldKeys([short_key(k) for k in keys]))
            case _:  # a bug on the serving side: said, and the loop goes on
                log.error("not an engine-loop command: %r", command)

    def _step(self, events: list[Event]) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except StepError as e:  # fail the requests of that step, keep serving the rest
            log.exception("model step failed")
            self._fail(e.request_ids, e, events)
            return
        except OrchestrationError as e:
            log.exception("orchestration failed")
            if engine.mode == "normal":  # degrade, keep every request, and go on serving
                engine.enter_basic_mode(str(e))
            else:  # already basic: fail the requests in flight, never the process
                self._fail(list(engine.requests), e, events)
            return
        started = engine.take_started()
        if started:
            events.append(Started(started))
        events.extend(outputs)

    def _fail(self, request_ids: list[str], error: Exception, events: list[Event]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
            events.append(RequestFailed(rid, f"engine step failed: {error}", "internal"))

    def _snapshot(self) -> EngineSnapshot:
        now = time.monotonic()
        if now - self._rss[0] > self.RSS_EVERY_S:
            self._rss = (now, _rss_mb())
        if self._kv[1] is None or now - self._kv[0] > self.KV_COUNT_EVERY_S or not self.engine.has_unfinished():
            self._kv = (now, count_kv_blocks(self.engine))
        return take_snapshot(self.engine, self._rss[1], self._kv[1])


def _rss_mb() -> float:
    try:
        import psutil

        return round(psutil.Process(os.getpid()).memory_info().rss / 2**20, 1)
    except Exception:
        return 0.0


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

    def cancel(self, error: BaseException) -> None:
        for m in self.members.values():
            if not m.done:
                m.client.abort(m.request_id)
        self.queue.put_nowait(error)


class Transport:
    """How an `EngineClient` reaches its engine: commands go out through `send`; events come back
    through `client.deliver` (from any thread) or `client.receive` (on the client's event loop).

    This base reaches one engine loop, which publishes its own snapshots. `ThreadTransport` (below)
    and `EngineProcess` (`stratum.engine.process`) are one loop each; the cluster's transport
    (`stratum.cluster.client`) reaches a set of replicas and overrides `snapshot` and `replicas`.
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

    def snapshot(self, published: EngineSnapshot) -> EngineSnapshot:
        """The engine's state as the client reports it: here what the loop published last."""
        return published

    def replicas(self) -> list[ReplicaView]:
        """The replicas behind the client, when the engine is several; else none."""
        return []

    def shutdown(self) -> None:
        pass


class ThreadTransport(Transport):
    """The engine loop in a thread of this process: commands and events cross as the records themselves."""

    def __init__(self, engine):
        self.engine = engine
        self.loop: EngineLoop | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.loop = EngineLoop(self.engine, self.client.deliver)
        self.thread = threading.Thread(target=self.loop.run, name="stratum-engine", daemon=True)
        self.thread.start()

    def send(self, commands: list[Command]) -> None:
        for command in commands:
            self.loop.submit(command)

    def shutdown(self) -> None:
        self.loop.stop()
        self.thread.join(timeout=10)


class EngineClient:
    """The serving side's one handle on the engine.

    Args:
        info: the engine's resolved configuration and kernel choices (`info` and `config` follow a switch
            of kernels: `LLMEngine.switch_kernels`).
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
        self._published = EngineSnapshot(alive=True)  # the loop's last snapshot
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

    def is_open(self, request_id: str) -> bool:
        """Whether the request's stream is still read."""
        return request_id in self._streams

    # ---- the serving side (one event loop) ----------------------------------------------------------
    @property
    def snapshot(self) -> EngineSnapshot:
        """What the engine looked like after its last step (the replicas' sum, for a replica set)."""
        return self.transport.snapshot(self._published)

    @property
    def is_alive(self) -> bool:
        return self.snapshot.alive

    @property
    def width(self) -> int:
        """Engines behind this client (their queues and batches add up): the live replicas, or 1."""
        return max(1, sum(v.snapshot.alive for v in self.replicas()))

    def replicas(self) -> list[ReplicaView]:
        """The replicas behind this client, when the engine is several (`stratum.cluster`); else none."""
        return self.transport.replicas()

    @property
    def num_queued(self) -> int:
        """Admitted requests that have not started running (what --max-waiting bounds)."""
        return len(self._queued)

    def admit(self, request_id: str) -> None:
        """Count a request against the waiting queue from this moment on.

        Raises:
            EngineDeadError: the engine loop is gone.
            QueueFull: --max-waiting requests are admitted and waiting already.
        """
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running ({self.snapshot.error or 'stopped'})")
        limit = self.config.scheduler.max_waiting * self.width
        if len(self._queued) >= limit:
            raise QueueFull(limit, self._retry_after_s())
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
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running ({self.snapshot.error or 'stopped'})")
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

    def _retry_after_s(self) -> int:
        """Seconds until a queue slot is likely free: recent request time x queued / batch size, with
        jitter so that rejected clients do not all come back at once."""
        typical = sum(self._recent_e2e) / len(self._recent_e2e) if self._recent_e2e else 1.0
        batches = (len(self._queued) + self.snapshot.num_running) / max(1, self.config.scheduler.max_num_seqs * self.width)
        return max(1, math.ceil(typical * max(1.0, batches) * random.uniform(0.5, 1.5)))


def start_thread_engine(engine) -> EngineClient:
    """Run engine's loop in a thread of this process, behind an EngineClient."""
    transport = ThreadTransport(engine)
    client = EngineClient(EngineInfo.of(engine), engine.tokenizer, engine.chat_template, transport)
    transport.start()
    return client
