"""The engine loop: it owns an engine core, applies commands between steps and, after every step,
emits one batch of events (outputs, requests that left the queue, a fresh snapshot).

It talks to the core through `LoopEngine`, exactly the members it uses. The engine process
(`stratum.engine.process`), a thread of the serving process (`stratum.engine.thread_transport`) and a
Ray Serve replica (`stratum.cluster.replica`) run it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Callable, Protocol

from stratum.engine.outputs import OrchestrationError, RequestOutput, StepError
from stratum.engine.protocol import (
    Abort, Accepted, AddRequest, Command, EngineDied, EngineInfo, EngineSnapshot, Event, HeldKeys, KVBlocks, ListHeld,
    RequestFailed, Started,
)
from stratum.engine.reasoning import Reasoning
from stratum.engine.request import CachePolicy, Sequence, short_key
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams


class LoopEngine(Protocol):
    """What the loop asks of the engine it owns (`engine.core.EngineCore`), and nothing more."""

    mode: str  # "normal" | "basic"

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None, cache_policy: CachePolicy | None = None,
                    tool_marker: str | None = None, pin_prefixes: list[tuple[int, float]] | None = None,
                    low_latency: bool = False, fork_of: str | None = None,
                    reasoning: Reasoning | None = None, task: str = "generate") -> Sequence: ...
    def expected_cached_tokens(self, seq: Sequence) -> int: ...
    def abort(self, request_id: str) -> RequestOutput | None: ...
    def recent_cache_keys(self, max_keys: int) -> list[bytes]: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def take_started(self) -> list[str]: ...
    def request_ids(self) -> list[str]: ...
    def enter_basic_mode(self, reason: str) -> None: ...
    def switch_kernels(self) -> bool: ...
    def info(self) -> EngineInfo: ...
    def snapshot(self, rss_mb: float = 0.0, kv_blocks: KVBlocks | None = None) -> EngineSnapshot: ...

    @property
    def is_preparing(self) -> bool: ...

    @property
    def works_in_background(self) -> bool: ...


log = logging.getLogger("stratum.engine")


class EngineLoop:
    """The step loop. `submit` is thread-safe; `run` blocks until `stop` or death.

    Args:
        engine: the engine it owns; only this loop touches it.
        emit: receives one list of events (`stratum.engine.protocol`) per step, or per batch of
            commands, in order: RequestOutput, RequestFailed, Accepted, Started, HeldKeys when asked,
            then the EngineSnapshot after it; once, last, EngineDied.
    """

    RSS_EVERY_S = 0.5
    # Counting cached and in-use blocks walks the pool (milliseconds for a large GPU pool): while
    # requests run it is refreshed this often; the snapshot an idle engine leaves is always exact.
    KV_COUNT_EVERY_S = 0.05
    PREPARING_POLL_S = 0.5

    def __init__(self, engine: LoopEngine, emit: Callable[[list[Event]], None]):
        self.engine = engine
        self.emit = emit
        self._commands: deque[Command] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self.death: str | None = None  # why run() ended, if it was not stop()
        self._rss = (0.0, 0.0)  # (when measured, MiB)
        self._kv: tuple[float, KVBlocks | None] = (0.0, None)  # (when counted, the count)

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
        engine = self.engine
        with self._wake:
            while not self._commands and not engine.has_unfinished() and not self._stopped:
                # while a cold start's kernels are prepared, an idle loop looks in now and then: to
                # switch to them (`EngineCore.switch_kernels`), and to publish how far they are; and
                # while the disk tier writes, to publish its figures
                if not self._wake.wait(self.PREPARING_POLL_S if engine.works_in_background else None):
                    break
            commands = list(self._commands)
            self._commands.clear()
        events: list[Event] = []
        for command in commands:
            self._apply(command, events)
        if engine.is_preparing and engine.switch_kernels():
            events.append(engine.info())  # its configuration and kernel choices changed
        if engine.has_unfinished() and not self._stopped:
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
                        low_latency=command.low_latency, fork_of=command.fork_of,
                        reasoning=command.reasoning, task=command.task)
                except InvalidRequestError as e:
                    events.append(RequestFailed(rid, str(e), "invalid_request"))
                    return
                except Exception as e:  # a bug: this request fails, not the loop
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
                events.append(HeldKeys([short_key(k) for k in self.engine.recent_cache_keys(n)]))
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
                self._fail(engine.request_ids(), e, events)
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
        counted, kv_blocks = self._kv
        if kv_blocks is None or now - counted > self.KV_COUNT_EVERY_S or not self.engine.has_unfinished():
            kv_blocks = None
        snapshot = self.engine.snapshot(self._rss[1], kv_blocks)
        if kv_blocks is None:
            self._kv = (now, snapshot.kv_blocks)
        return snapshot


def _rss_mb() -> float:
    try:
        import psutil

        return round(psutil.Process(os.getpid()).memory_info().rss / 2**20, 1)
    except Exception:
        return 0.0
