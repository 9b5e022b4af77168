"""Fault injection for tests, from $STRATUM_FAULT_INJECT: "scheduler" or "cache" make that logic raise
(the engine degrades to basic mode), "engine_death:N" kills the engine loop after N steps,
"start_death:K" kills every engine process from the K-th restart on as it starts (a crash loop), "route" makes
the generating routes raise an unhandled error once a body is read (the server's own bug, a 500)."""

from __future__ import annotations

import os
from dataclasses import dataclass


class EngineKilled(BaseException):
    """The engine loop dies outright (STRATUM_FAULT_INJECT=engine_death:N).

    A BaseException, like the failures it stands for, so no handler meant for request errors keeps
    the loop alive."""


@dataclass(frozen=True, slots=True)
class Faults:
    orchestration: str | None = None  # "scheduler" | "cache": that logic raises; "route": the routes do
    death_after: int | None = None  # the loop dies after this many steps
    start_death_from: int | None = None  # engine processes of this start number on die as they start

    @classmethod
    def from_env(cls) -> "Faults":
        spec = os.environ.get("STRATUM_FAULT_INJECT")
        if not spec:
            return cls()
        if spec.startswith("start_death"):
            _, _, k = spec.partition(":")
            return cls(start_death_from=int(k or 1))
        if spec.startswith("engine_death"):
            _, _, n = spec.partition(":")
            return cls(death_after=int(n or 0))
        return cls(orchestration=spec)

    @property
    def is_route_error(self) -> bool:
        return self.orchestration == "route"

    def check_death(self, num_steps: int) -> None:
        """Raises EngineKilled once num_steps reaches the injected death."""
        if self.death_after is not None and num_steps >= self.death_after:
            raise EngineKilled(f"injected engine death after {num_steps} steps (STRATUM_FAULT_INJECT)")

    def check_start(self, start_number: int) -> None:
        """Raises EngineKilled in an engine process whose start number (0 first, n the n-th restart)
        reaches the injected start death."""
        if self.start_death_from is not None and start_number >= self.start_death_from:
            raise EngineKilled(f"injected death at the start of engine process {start_number} (STRATUM_FAULT_INJECT)")
