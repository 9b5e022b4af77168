"""The hardware-adaptive substrate below the model's layers: CPU detection, weight formats, the
native kernels and the kernel plan.

`KernelPlan` lives here, free of torch, because the serving process reads it in the engine's
resolved configuration without loading the model's stack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class KernelPlan:
    device: str
    dtype: str  # activation / dense weight dtype
    threads: int
    int4_max_tokens: int  # rows per matmul up to which packed int4 runs; 0 = never
    q8_max_rows: int = 0  # logits rows up to which the native Q8_0 output projection runs; 0 = never
    packed_step: bool = False  # the whole forward as one native call on the packed blocks (kernels.packed)
    cpu: str = ""
    timings_us: dict = field(default_factory=dict, hash=False, compare=False)
    source: str = "measured"  # "measured" now, or "cache"
    quiet: bool = True  # measured while no other process kept the cores busy (else measured again later)
    runs: int = 0  # measurement runs behind the figures
    other_load: list = field(default_factory=list, hash=False, compare=False)  # cores others used, per run
    remeasured: int = 0  # starts that measured a busy plan again

    @property
    def decision(self) -> tuple[str, int, int, bool]:
        """What the plan decides (dtype, packed int4 rows, Q8_0 head rows, native step), without its figures."""
        return (self.dtype, self.int4_max_tokens, self.q8_max_rows, self.packed_step)

    def describe(self) -> dict:
        return asdict(self)
