"""Fault injection for tests, from $STRATUM_FAULT_INJECT: "scheduler" or "cache" make that logic raise
(the engine degrades to basic mode), "engine_death:N" kills the engine loop after N steps, "route" makes
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

    @classmethod
    def from_env(cls) -> "Faults":
        spec = os.environ.get("STRATUM_FAULT_INJECT")
        if not spec:
            return cls()
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
