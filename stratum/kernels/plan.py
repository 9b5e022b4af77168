"""Hardware-adaptive kernels (the brief's "Substrate").

At start-up the candidate kernels are timed on this machine, at this model's layer shapes and at
the batch sizes a server sees, once; the choice is cached under $STRATUM_HOME/kernels and reused:

- activations: fp32 or bf16 (bf16 runs on AMX / AVX-512-BF16 where the CPU has them);
- 4-bit weights kept packed (GGUF Q4_0/Q4_1 as int4 group-wise) vs dense, and the batch size up to
  which the packed kernel wins (decode is bound by reading weights, large batches by compute);
- the thread count.

`stratum info` prints the plan and the measured times.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from stratum.kernels import KernelPlan, native
from stratum.kernels.cpu import cpu_name
from stratum.kernels.quant import GROUP_SIZE, Int4Weight, Q8Weight

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
PLAN_VERSION = 3


def _time_us(fn, reps: int) -> float:
    """The fastest of `reps` timed calls: robust to other processes sharing the cores."""
    fn()
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return round(best * 1e6, 1)


def measure_plan(hidden: int, intermediate: int, threads: int, can_pack: bool, dtype: str = "auto") -> KernelPlan:
    """Time dense fp32, dense bf16 and packed int4 on an [intermediate*2, hidden] projection."""
    torch.set_num_threads(threads)
    n, k = 2 * intermediate, hidden
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(n, k, generator=g) * 0.02
    wbf = w32.bfloat16()
    int4 = None
    if can_pack and k % GROUP_SIZE == 0:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        scale = torch.rand(n, k // GROUP_SIZE, generator=g) * 0.01
        int4 = Int4Weight(q, scale, torch.zeros_like(scale))
    q8 = None
    if k % GROUP_SIZE == 0 and native.available():  # the Q8_0 kernel, timed on the same shape
        q8 = Q8Weight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, k // GROUP_SIZE, generator=g) * 0.01)
    timings: dict[str, dict[int, float]] = {"dense_float32": {}, "dense_bfloat16": {}, "int4_bfloat16": {}, "q8_float32": {}}
    for m in BATCH_SIZES:
        x = torch.randn(m, k, generator=g)
        xb = x.bfloat16()
        reps = max(5, 96 // m)
        timings["dense_float32"][m] = _time_us(lambda: F.linear(x, w32), reps)
        timings["dense_bfloat16"][m] = _time_us(lambda: F.linear(xb, wbf), reps)
        if int4 is not None:
            timings["int4_bfloat16"][m] = _time_us(lambda: int4.matmul(xb), reps)
        if q8 is not None and m <= 16:
            timings["q8_float32"][m] = _time_us(lambda: q8.matmul(x), reps)
    for name in ("int4_bfloat16", "q8_float32"):
        if not timings[name]:
            del timings[name]
    if dtype == "auto":
        # bf16 only where it wins at the batch sizes that dominate serving (decode 1..64)
        wins = sum(timings["dense_bfloat16"][m] < timings["dense_float32"][m] for m in BATCH_SIZES if m <= 64)
        dtype = "bfloat16" if wins > len([m for m in BATCH_SIZES if m <= 64]) // 2 else "float32"
    max_tokens = 0
    if dtype == "bfloat16" and "int4_bfloat16" in timings:
        for m in BATCH_SIZES:
            if timings["int4_bfloat16"][m] < timings["dense_bfloat16"][m]:
                max_tokens = m
            else:
                break
    q8_rows = 0
    if dtype == "bfloat16":
        for m, t in timings.get("q8_float32", {}).items():
            if t < timings["dense_bfloat16"][m]:
                q8_rows = m
            else:
                break
    return KernelPlan("cpu", dtype, threads, max_tokens, q8_rows, cpu_name(), timings)


def plan_cache_path(home: Path, hidden: int, intermediate: int, threads: int, dtype: str) -> Path:
    key = json.dumps([PLAN_VERSION, cpu_name(), torch.__version__, hidden, intermediate, threads, dtype])
    return home / "kernels" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def select_plan(home: Path, hidden: int, intermediate: int, threads: int, can_pack: bool, dtype: str = "auto") -> KernelPlan:
    """The cached plan for this machine and shape, or a freshly measured one (then cached)."""
    path = plan_cache_path(home, hidden, intermediate, threads, dtype)
    if path.exists():
        try:
            data = json.loads(path.read_text())
            data["timings_us"] = {k: {int(m): t for m, t in v.items()} for k, v in data["timings_us"].items()}
            plan = KernelPlan(**{**data, "source": "cache"})
            if can_pack or plan.int4_max_tokens == 0:
                return plan
        except (ValueError, TypeError, KeyError):
            pass  # a stale or corrupt cache entry is measured again
    plan = measure_plan(hidden, intermediate, threads, can_pack, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan.describe(), indent=1))
    os.replace(tmp, path)
    return plan
