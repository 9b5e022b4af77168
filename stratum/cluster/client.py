"""The ingress's engine client when the engine is N replicas behind Ray Serve.

`connect` returns a plain `EngineClient` built on a `ReplicaSetTransport`: the server, its pipeline
and its telemetry use it unchanged. What the transport changes is where a request goes — one
streamed `generate` call on the replicas' deployment handle, routed by `router.StratumRouter` on the
prompt's block keys, its commands and events in `stratum.engine.protocol`'s codec — and where the
snapshot comes from: each time the replicas report to the router, the transport publishes the sum
of their snapshots to the client. A replica that dies mid-request ends that request with an error;
the ones after it are routed to the replicas left, and Serve starts a replacement.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from stratum.engine.client import EngineClient, ReplicaView, Transport
from stratum.engine.protocol import (
    AddRequest, EngineSnapshot, ReplicaDescription, RequestFailed, StreamDecoder, encode,
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


def connect(handle, description: ReplicaDescription, deployment: str, on_shutdown=None) -> EngineClient:
    """The client of a running deployment.

    Args:
        handle: the replicas' DeploymentHandle.
        description: a replica's `describe()`, decoded (configuration, tokenizer, chat template, snapshot).
        deployment: the deployment's name (which router in this process routes it).
        on_shutdown: stops the deployment.
    """
    tokenizer, template = description.tokenizer.build()
    transport = ReplicaSetTransport(handle, deployment, on_shutdown)
    client = EngineClient(description.info, tokenizer, template, transport, engine_pid=description.pid)
    client.deliver([description.snapshot])  # what a replica described itself with, until they report
    transport.start()
    return client


class ReplicaSetTransport(Transport):
    """Args:
        handle: the replicas' DeploymentHandle.
        deployment: the deployment's name.
        on_shutdown: stops the deployment.
    """

    def __init__(self, handle, deployment: str, on_shutdown=None):
        self._generate = handle.options(stream=True, method_name="generate")
        self.deployment = deployment
        self._on_shutdown = on_shutdown
        self._calls: dict[str, _Call] = {}
        self._replicas: list[ReplicaView] = []

    def start(self) -> None:
        """Follow the replicas' reports from now on (the router's, in this process)."""
        from stratum.cluster import router

        router.listen(self.deployment, self._reported)

    # ---- the state of the replica set ---------------------------------------------------------------
    def replicas(self) -> list[ReplicaView]:
        """The replicas the router knows, as each last reported (in name order)."""
        return self._replicas

    def _reported(self, views: list[ReplicaView]) -> None:
        """The replicas reported (the router's thread): their snapshots' sum is the client's now."""
        if views:
            summed = EngineSnapshot.summed({v.name: v.snapshot for v in views})
        else:
            summed = EngineSnapshot(alive=False, error="no replica is running (Serve starts replacements)")
        self._replicas = views
        self.client.deliver([summed])

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
