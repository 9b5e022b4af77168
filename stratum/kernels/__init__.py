"""The hardware-adaptive substrate below the model's layers: CPU detection, weight formats, the
native kernels, the numerics rule and the kernel plan.

`KernelPlan` lives here, free of torch, because the serving process reads it in the engine's
resolved configuration without loading the model's stack.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field


class PlanSource(enum.StrEnum):
    """Where a kernel plan's thread count came from. A str, shown and cached as its value: the plan
    travels inside the engine's kernel choices and resolved configuration as plain data."""

    MEASURED = "measured"  # measured by this start, in quiet runs
    CACHE = "cache"  # an earlier start's plan, read from the plan cache
    DEFAULTS = "defaults"  # the CPU family's: no quiet run (a busy machine), not measured yet, or no native kernels
    RULE = "rule"  # nothing to measure (the PyTorch step, a cold start's provisional step): config.default_threads
    CONFIGURED = "configured"  # set by the user: --threads, or $STRATUM_NUM_THREADS


@dataclass(frozen=True)
class KernelPlan:
    """The speed choices that keep the numerics (kernels/plan.py): measured once, or defaults."""

    device: str
    threads: int  # engine threads for decode steps
    cpu: str = ""
    timings_us: dict = field(default_factory=dict, hash=False, compare=False)
    source: PlanSource = PlanSource.MEASURED
    quiet: bool = True  # measured while no other process kept the cores busy (else the defaults hold)
    runs: int = 0  # measurement runs behind the figures
    other_load: list = field(default_factory=list, hash=False, compare=False)  # cores others used, per run
    basis: str = ""  # what the choice rests on: the measurement, or why the defaults

    def __post_init__(self):
        # from plain data (the plan cache's file, another process's copy) the source is its value
        object.__setattr__(self, "source", PlanSource(self.source))

    def describe(self) -> dict:
        """As plain data (the plan cache's file, `stratum info`)."""
        return {**asdict(self), "source": self.source.value}
