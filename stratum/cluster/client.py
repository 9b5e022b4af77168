"""The ingress's engine client when the engine is N replicas behind Ray Serve.

`connect` returns a plain `EngineClient` built on a `ReplicaSetTransport`: the server, its pipeline
and its telemetry use it unchanged. What the transport changes is where a request goes — one
streamed `generate` call on the replicas' deployment handle, routed by `router.StratumRouter` on the
prompt's block keys, its commands and events in `stratum.engine.protocol`'s codec — and where the
snapshot comes from: the sum of the replicas' routing stats. A replica that dies mid-request ends
that request with an error; the ones after it are routed to the replicas left, and Serve starts a
replacement.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from stratum.engine.client import EngineClient, ReplicaView, Transport
from stratum.engine.protocol import (
    AddRequest, EngineSnapshot, KVBlocks, RequestFailed, StreamDecoder, decode, decode_info, decode_tokenizer, encode,
)
from stratum.engine.request import prompt_block_keys

log = logging.getLogger("stratum.cluster")


@dataclass
class _Call:
    """One `generate` call: the requests it carries and the response streaming their events."""

    request_ids: list[str]
    response: object = None
    task: asyncio.Task | None = None
    cancelled: bool = False
    decoder: StreamDecoder = field(default_factory=StreamDecoder)


def connect(handle, description: dict, deployment: str, on_shutdown=None) -> EngineClient:
    """The client of a running deployment.

    Args:
        handle: the replicas' DeploymentHandle.
        description: a replica's `describe()` (configuration, tokenizer, chat template, snapshot).
        deployment: the deployment's name (which router in this process routes it).
        on_shutdown: stops the deployment.
    """
    tokenizer, template = decode_tokenizer(description["tokenizer"])
    transport = ReplicaSetTransport(handle, decode(description["snapshot"]), deployment, on_shutdown)
    return EngineClient(decode_info(description["info"]), tokenizer, template, transport, engine_pid=description["pid"])


class ReplicaSetTransport(Transport):
    """Args:
        handle: the replicas' DeploymentHandle.
        first: the snapshot a replica described itself with (reported until the router exists).
        deployment: the deployment's name.
        on_shutdown: stops the deployment.
    """

    def __init__(self, handle, first: EngineSnapshot, deployment: str, on_shutdown=None):
        self._generate = handle.options(stream=True, method_name="generate")
        self._first = first
        self.deployment = deployment
        self._on_shutdown = on_shutdown
        self._calls: dict[str, _Call] = {}

    # ---- the state of the replica set ---------------------------------------------------------------
    def replicas(self) -> list[ReplicaView]:
        """The replicas the router knows, with what each last reported (in name order)."""
        from stratum.cluster.router import ROUTERS

        router = ROUTERS.get(self.deployment)
        if router is None:
            return []
        views = []
        for name, stats in sorted(router.stats().items()):
            state = router.policy.replicas.get(name)
            snap = decode(stats["snapshot"]) if "snapshot" in stats else EngineSnapshot(alive=True)
            views.append(ReplicaView(name, stats.get("pid"), snap, state.load if state else 0,
                                     len(stats.get("held", ())), stats.get("at", 0.0)))
        return views

    def snapshot(self, published: EngineSnapshot) -> EngineSnapshot:
        """The replicas' snapshots summed (alive while any replica is); before the router exists, the
        first replica's own. (No engine loop publishes to the client itself: `published` is unused.)"""
        from stratum.cluster.router import ROUTERS

        views = self.replicas()
        if not views:
            if self.deployment not in ROUTERS:
                return self._first
            return EngineSnapshot(alive=False, error="no replica is running (Serve starts replacements)")
        snaps = [v.snapshot for v in views]
        alive = [s for s in snaps if s.alive]
        steps = sum(s.num_steps for s in snaps)
        return EngineSnapshot(
            alive=bool(alive),
            mode="normal" if all(s.mode == "normal" for s in alive) else "basic",
            degraded_reason="; ".join(f"{v.name}: {v.snapshot.degraded_reason}" for v in views
                                      if v.snapshot.degraded_reason) or None,
            error=None if alive else "; ".join(f"{v.name}: {v.snapshot.error}" for v in views),
            num_running=sum(s.num_running for s in snaps), num_waiting=sum(s.num_waiting for s in snaps),
            kv_blocks=KVBlocks(*(sum(getattr(s.kv_blocks, f) for s in snaps) for f in ("total", "free", "cached", "in_use"))),
            num_preemptions=sum(s.num_preemptions for s in snaps), num_steps=steps,
            overhead_ratio=sum(s.overhead_ratio * s.num_steps for s in snaps) / steps if steps else 0.0,
            mean_step_s=max(s.mean_step_s for s in snaps), threads=sum(s.threads for s in snaps),
            rss_mb=sum(s.rss_mb for s in snaps), step="+".join(sorted({s.step for s in alive if s.step})),
            preparing="; ".join(f"{v.name}: {v.snapshot.preparing}" for v in views if v.snapshot.preparing) or None,
            published_at=min(s.published_at for s in snaps), kv_tiers=_summed_tiers(snaps))

    # ---- requests -----------------------------------------------------------------------------------
    def send(self, commands: list[AddRequest]) -> None:
        """One `generate` call for the lot (the members of a group share the prompt that forks them).
        Only requests cross here: an abort is the call's cancellation (`abort`)."""
        first = commands[0]
        keys = prompt_block_keys(first.prompt_token_ids, self.client.config.block_size, first.cache_salt)
        call = _Call([c.request_id for c in commands])
        call.response = self._generate.remote({"keys": keys, "requests": [encode(c) for c in commands]})
        for rid in call.request_ids:
            self._calls[rid] = call
        call.task = asyncio.get_running_loop().create_task(self._pump(call))

    async def _pump(self, call: _Call) -> None:
        try:
            async for items in call.response:
                self.client.receive([call.decoder.decode(item) for item in items])
        except BaseException as e:
            if not call.cancelled:  # the replica died, or the call failed: its requests end with that error
                log.warning("a replica call failed: %s: %s", type(e).__name__, e)
                error = f"the replica serving this request failed: {type(e).__name__}: {e}"
                self.client.receive([RequestFailed(rid, error, "unavailable") for rid in call.request_ids])
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            for rid in call.request_ids:
                self._calls.pop(rid, None)

    def abort(self, request_id: str) -> None:
        """The call is cancelled (the replica aborts what has not finished) once none of its requests
        is read any more."""
        call = self._calls.get(request_id)
        if call is not None and not any(self.client.is_open(r) for r in call.request_ids):
            call.cancelled = True
            call.response.cancel()

    def shutdown(self) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()


def _summed_tiers(snaps: list[EngineSnapshot]) -> dict:
    """The replicas' tier figures added up, except the disk tier's size and bound: one tier on the
    machine, which every replica reports whole."""
    out: dict[str, dict] = {}
    for snap in snaps:
        for tier, figures in snap.kv_tiers.items():
            into = out.setdefault(tier, {})
            for name, value in figures.items():
                shared = tier == "disk" and name in ("size_bytes", "blocks", "limit_bytes", "enabled")
                into[name] = max(into.get(name, 0), value) if shared else into.get(name, 0) + value
    return out
