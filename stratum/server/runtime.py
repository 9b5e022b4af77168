"""The state every request of the server shares (`Runtime`), and the drain that ends it gracefully.

Nothing here holds a request: `lifecycle.RequestLifecycle` runs each one, and is in `active` while it does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from stratum.engine.client import EngineClient
from stratum.engine.protocol import EngineSnapshot
from stratum.server.budget import BudgetStore, CostAdmission
from stratum.server.compression import CompressionSettings
from stratum.server.errors import APIError, EngineUnavailable
from stratum.home import stratum_home
from stratum.server.models import ModelSet
from stratum.server.policy import PolicyStore
from stratum.server.pollution import PollutionDetector
from stratum.server.reasoning import ThoughtSigner
from stratum.server.response_store import ResponseStore
from stratum.telemetry.cost import PricingModel
from stratum.telemetry.metrics import Metrics

log = logging.getLogger("stratum.server")


class Held(Protocol):
    """An admitted request, as the server sees it from outside (`lifecycle.RequestLifecycle`)."""

    is_batch: bool  # a Message Batches request

    def cancel(self, error: APIError) -> None:
        """End it from the server's side (a drain out of time)."""


@dataclass
class Runtime:
    """The server's in-process orchestration state: the models served (`models`; each request runs on
    the engine of the one it names, `lifecycle.RequestLifecycle.engine`) and what their requests share."""

    models: ModelSet
    admission: CostAdmission
    pollution: PollutionDetector
    pricing: PricingModel
    metrics: Metrics
    isolate_tenants: bool = False  # each tenant's prefix-cache blocks are salted with it
    header_wait_s: float = 2.0  # a stream waits this long for prefill before sending headers without its figures
    ping_interval_s: float = 5.0  # a stream sends a keep-alive after this long without an output
    draining: bool = False  # shutting down: new requests get 503
    restart_wait_s: float = 5.0  # a request arriving while the engine restarts waits this long, then gets 503
    active: dict[str, Held] = field(default_factory=dict)  # admitted and not yet ended, by request id
    aggressive_ttl_s: float = 600.0
    warmup_ttl_s: float = 300.0
    compression: CompressionSettings = CompressionSettings()
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(RESPONSES_STORE_BYTES))
    # what signs a thinking block, and checks the signature it comes back with
    thoughts: ThoughtSigner = field(default_factory=lambda: ThoughtSigner(stratum_home()))
    parse_thought: bool = True  # a reasoning model's thought returned apart (`--reasoning-format auto`)
    reasoning_budget: int | None = None  # for requests that set none (`--reasoning-budget`)
    policy: PolicyStore | None = None  # the content policy (`--content-policy`), reloaded as its file changes

    @property
    def engine(self) -> EngineClient | None:
        """The default (first) model's engine, while it is loaded."""
        return self.models.default.engine

    @property
    def model_name(self) -> str:
        return self.models.default.name

    def thought_signer(self, engine: EngineClient) -> ThoughtSigner | None:
        """What checks the thinking blocks sent back, where the model reads them (its template reasons)."""
        return self.thoughts if engine.chat_template.thought_markers is not None else None

    def snapshot(self) -> EngineSnapshot:
        """The default model's engine's last snapshot (an idle placeholder while it is unloaded)."""
        engine = self.engine
        return engine.snapshot if engine is not None else _UNLOADED


_UNLOADED = EngineSnapshot(alive=True)


RESPONSES_STORE_BYTES = 64 * 2**20  # stored Responses API responses, in memory (`--responses-store-mb`)


def make_runtime(models: ModelSet, pricing: PricingModel, budget_tokens: int | None,
                 window_s: float, pollution_policy: str, isolate_tenants: bool = False, header_wait_s: float = 2.0,
                 ping_interval_s: float = 5.0, responses_store_bytes: int = RESPONSES_STORE_BYTES,
                 budget_store: BudgetStore | None = None) -> Runtime:
    active: dict[str, Held] = {}
    default = models.default
    metrics = Metrics(lambda: rt.snapshot(), lambda: default.engine.replicas() if default.engine else [],
                      lambda: len(active), models=models)
    admission = CostAdmission(budget_tokens, window_s, store=budget_store)
    rt = Runtime(models, admission, PollutionDetector(pollution_policy), pricing, metrics,
                 isolate_tenants=isolate_tenants, header_wait_s=header_wait_s, ping_interval_s=ping_interval_s,
                 active=active, responses=ResponseStore(responses_store_bytes))
    return rt


async def drain(rt: Runtime, timeout_s: float, grace_s: float = 2.0) -> int:
    """Shut down gracefully: refuse new requests (503), let the admitted ones finish for up to
    timeout_s, then end the rest with an error (an error event on a stream, an error body otherwise)
    and give them grace_s to send it.

    Returns:
        how many requests were ended by the drain rather than finishing.
    """
    rt.draining = True
    deadline = time.monotonic() + timeout_s
    while rt.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = list(rt.active.values())
    for held in left:
        held.cancel(EngineUnavailable(f"the server is shutting down; the request did not finish within the "
                                      f"{timeout_s:g}s drain timeout"))
    deadline = time.monotonic() + grace_s
    while rt.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if rt.active:  # each ended request is released as it ends: one still held is a fault
        log.error("drain: %d requests still held after %gs of grace: %s", len(rt.active), grace_s, ", ".join(rt.active))
    return len(left)
