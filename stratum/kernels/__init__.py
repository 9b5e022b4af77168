"""The hardware-adaptive substrate below the model's layers: CPU detection, weight formats, the
native kernels, the numerics rule and the kernel plan.

`KernelPlan` lives here, free of torch, because the serving process reads it in the engine's
resolved configuration without loading the model's stack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class KernelPlan:
    """The speed choices that keep the numerics (kernels/plan.py): measured once, or defaults."""

    device: str
    threads: int  # engine threads for decode steps
    cpu: str = ""
    timings_us: dict = field(default_factory=dict, hash=False, compare=False)
    source: str = "measured"  # "measured" now, "cache", "defaults" (the CPU family's), "rule" (nothing to measure)
    quiet: bool = True  # measured while no other process kept the cores busy (else the defaults hold)
    runs: int = 0  # measurement runs behind the figures
    other_load: list = field(default_factory=list, hash=False, compare=False)  # cores others used, per run
    basis: str = ""  # what the choice rests on: the measurement, or why the defaults

    def describe(self) -> dict:
        return asdict(self)
