"""One engine replica: the body of the Ray Serve deployment that `stratum serve --replicas N` runs.

A replica owns an `EngineCore` and runs its `EngineLoop` in a thread, exactly as `--engine thread`
does; instead of an `EngineClient` it hands each request's events (outputs, `Accepted`, `Started`,
`RequestFailed`: `stratum.engine.protocol`'s records, in its codec) back to the caller as the items
of one streamed call, so the ingress's client applies them as it would the events of a local
engine. Serve's hooks: `record_routing_stats` tells the router what this replica's cache holds and
how loaded it is; `check_health` fails once the engine loop is gone, and Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import replace

from stratum.engine.config import EngineConfig, SchedulerConfig
from stratum.engine.loop import EngineLoop
from stratum.engine.outputs import RequestOutput
from stratum.engine.protocol import (
    ROUTING_STATS_KEY, Abort, Accepted, EngineDied, EngineSnapshot, Event, HeldKeys, ListHeld, ReplicaDescription,
    ReplicaReport, RequestFailed, Routed, Started, TokenizerData, decode, encode,
)

# Block keys a replica reports: the most recently used first. 4096 keys of 16-token blocks cover
# 64k tokens of hot prefixes, about 40 KB per report.
MAX_HELD_KEYS = 4096


class EngineReplica:
    """Args: config: an `EngineConfig` as a dict (what crosses to the replica's process)."""

    def __init__(self, config: dict):
        from stratum.engine.core import EngineCore

        settings = dict(config, scheduler=SchedulerConfig(**config["scheduler"]))
        engine = EngineCore(EngineConfig(**settings))
        self.name = _replica_name()
        self.info = engine.info()
        self.tokenizer = TokenizerData.of(engine.tokenizer, engine.chat_template.source)
        self.snapshot = EngineSnapshot(alive=True)
        self.held: tuple[list[int], float] = ([], 0.0)  # the cache's recent keys, and when the loop listed them
        self.calls = 0  # generate calls being served
        self._requests: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self.loop = EngineLoop(engine, self._deliver)
        threading.Thread(target=self.loop.run, name="stratum-engine", daemon=True).start()

    # ---- Serve calls these --------------------------------------------------------------------------
    def describe(self) -> list:
        """What the ingress needs before its first request: an encoded `ReplicaDescription`."""
        return encode(ReplicaDescription(os.getpid(), self.info, self.tokenizer, self.snapshot))

    async def generate(self, payload: dict):
        """Run one request, or one group (n samples forked from a prompt), streaming lists of encoded events.

        payload: {"keys": the prompt's block keys (read by the router), "requests": [encoded AddRequest,
        ...]}. The first item names this replica (`Routed`). Cancelling the call (the client went away)
        aborts whatever has not finished.
        """
        commands = [decode(c) for c in payload["requests"]]
        rids = [c.request_id for c in commands]
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            for rid in rids:
                self._requests[rid] = (loop, queue)
        open_ = set(rids)
        self.calls += 1
        try:
            yield [encode(Routed(rid, self.name)) for rid in rids]
            if not self.snapshot.alive:
                error = f"the engine stopped: {self.snapshot.error}"
                yield [encode(RequestFailed(rid, error, "unavailable")) for rid in rids]
                return
            for command in commands:
                self.loop.submit(command)
            while open_:
                events = [await queue.get()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                for event in events:
                    match event:
                        case RequestOutput(finished=True, request_id=rid) | RequestFailed(request_id=rid):
                            open_.discard(rid)
                yield [encode(e) for e in events]
        finally:
            self.calls -= 1
            with self._lock:
                for rid in rids:
                    if self._requests.get(rid, (None, None))[1] is queue:
                        del self._requests[rid]
            for rid in open_:
                self.loop.submit(Abort(rid))

    def record_routing_stats(self) -> dict[str, list]:
        """This replica's `ReplicaReport`, encoded, as Serve's routing stats: what its cache holds (listed
        by the loop since the last report), how many calls it serves, and its engine's snapshot."""
        self.loop.submit(ListHeld(MAX_HELD_KEYS))  # fresh for the next report
        keys, held_at = self.held
        report = ReplicaReport(os.getpid(), time.time(), self.calls, self.snapshot, keys, held_at)
        return {ROUTING_STATS_KEY: encode(report)}

    def check_health(self) -> None:
        if not self.snapshot.alive:
            raise RuntimeError(f"the engine loop stopped: {self.snapshot.error}")

    def __del__(self):
        self.loop.stop()

    # ---- the engine thread calls this ---------------------------------------------------------------
    def _deliver(self, events: list[Event]) -> None:
        by_request: dict[str, list[Event]] = {}
        for event in events:
            match event:
                case EngineSnapshot():
                    self.snapshot = event
                case HeldKeys(keys=keys):
                    self.held = (keys, time.time())
                case EngineDied(reason=reason):
                    self.snapshot = replace(self.snapshot, alive=False, error=reason)
                    with self._lock:
                        for rid in self._requests:
                            by_request.setdefault(rid, []).append(
                                RequestFailed(rid, f"the engine stopped: {reason}", "unavailable"))
                case RequestOutput(request_id=rid) | RequestFailed(request_id=rid) | Accepted(request_id=rid):
                    by_request.setdefault(rid, []).append(event)
                case Started(request_ids=rids):
                    for rid in rids:
                        by_request.setdefault(rid, []).append(Started([rid]))
        with self._lock:
            targets = [(self._requests.get(rid), evs) for rid, evs in by_request.items()]
        for target, evs in targets:
            if target is not None:
                loop, queue = target
                for event in evs:
                    loop.call_soon_threadsafe(queue.put_nowait, event)


def _replica_name() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests of the class itself)
        return f"pid{os.getpid()}"
