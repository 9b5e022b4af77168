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
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from stratum.layers.linear import Linear
from stratum.layers import native
from stratum.layers.quant import GROUP_SIZE, Int4Weight, Q8Weight, is_packable, unpack_q4, unpack_q8_0

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
PLAN_VERSION = 3


@dataclass(frozen=True)
class KernelPlan:
    device: str
    dtype: str  # activation / dense weight dtype
    threads: int
    int4_max_tokens: int  # rows per matmul up to which packed int4 runs; 0 = never
    q8_max_rows: int = 0  # logits rows up to which the native Q8_0 output projection runs; 0 = never
    cpu: str = ""
    timings_us: dict = field(default_factory=dict, hash=False, compare=False)
    source: str = "measured"  # "measured" now, or "cache"

    def describe(self) -> dict:
        return asdict(self)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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


# HF checkpoint names that make up each fused projection of a layer.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def attach_int4(model, quantized: dict, max_tokens: int, cache_dir: Path | None = None) -> int:
    """Give every projection whose parts are all GGUF Q4 tensors a packed int4 copy.

    Packing is done once per checkpoint and kept in cache_dir/int4.pt when a cache is given.

    Returns:
        The bytes of packed weights attached (0 when nothing was packable).
    """
    if max_tokens <= 0:
        return 0
    cache = cache_dir / "int4.pt" if cache_dir is not None else None
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if cache is not None and cache.exists():
        try:
            packed = torch.load(cache, weights_only=True)
        except (OSError, RuntimeError, ValueError):
            packed = {}
    total, fresh = 0, not packed
    for i, layer in enumerate(model.layers):
        for fused, parts in _FUSED.items():
            module: Linear = layer.get_submodule(fused)
            key = f"layers.{i}.{fused}"
            if key in packed:
                module.int4 = Int4Weight.from_packed(*packed[key], module.out_features, module.in_features)
            else:
                tensors = [quantized.get(f"model.layers.{i}.{p}.weight") for p in parts]
                if any(t is None or not is_packable(t.qtype) for t in tensors):
                    continue
                unpacked = [unpack_q4(t.qtype, t.data, t.shape) for t in tensors]
                q, scale, zero = (torch.cat([u[j] for u in unpacked]) for j in range(3))
                module.int4 = Int4Weight(q, scale, zero)
                packed[key] = (module.int4.packed, module.int4.scale_zeros)
            module.int4_max_tokens = max_tokens
            total += module.int4.nbytes
    if cache is not None and fresh and packed:
        try:
            torch.save(packed, cache)
        except OSError:
            pass  # only costs the packing time on the next start
    return total


def attach_q8_head(model, quantized: dict, max_rows: int) -> int:
    """Give the model its output projection as stored when that is GGUF Q8_0 (tied or not).

    Returns:
        The bytes attached (0 when the plan never uses it or the checkpoint has no Q8_0 head).
    """
    name = "lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"
    head = quantized.get(name)
    if max_rows <= 0 or head is None or head.qtype != "Q8_0":
        return 0
    model.lm_head_q8 = Q8Weight(*unpack_q8_0(head.data, head.shape))
    model.q8_max_rows = max_rows
    return model.lm_head_q8.nbytes
