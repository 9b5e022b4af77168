"""Hardware-adaptive kernels (the brief's "Substrate").

At the first start the candidate kernels are timed on this machine, at the shapes they are applied
to — each projection of a decoder layer, and the output projection — and at the batch sizes a
server sees; the choice is cached under $STRATUM_HOME/kernels and reused:

- activations: fp32 or bf16 (bf16 runs on AMX / AVX-512-BF16 where the CPU has them);
- 4-bit weights kept packed (GGUF Q4_0/Q4_1 as int4 group-wise) vs dense, and the batch size up to
  which the packed kernel wins (decode is bound by reading weights, large batches by compute);
- the output projection on the checkpoint's own Q8_0 weights vs dense, and up to how many rows;
- the native step (every layer in one native call on the GGUF blocks, kernels/packed.py) vs the
  PyTorch layers, compared on a layer's projections at one row, where decode spends its time; timed
  on stand-ins in the checkpoint's own formats (a Q4_K_M file's Q4_K and Q6_K segments, a Q8_0 or
  F16 file's blocks), so the choice holds for what the file stores.

A measurement can be fooled by a busy machine, so each figure is the fastest over repeated runs,
a run during which other processes used the cores is not trusted, and a plan that had no quiet run
is measured again at the next starts. `stratum info` prints the plan and the measured times;
`stratum info --remeasure` measures it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from stratum.kernels import KernelPlan, native
from stratum.kernels.cpu import cpu_flags, cpu_name
from stratum.kernels.packed import FUSED, PACKED_QTYPES, PackedWeight
from stratum.kernels.packed import pack as packed_weight
from stratum.kernels.quant import GROUP_SIZE, Int4Weight, Q8Weight, is_packable

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
HEAD_BATCH_SIZES = (1, 2, 4, 8, 16)  # the rows the Q8_0 output projection may take (logits rows per step)
PLAN_VERSION = 6  # 6: the native step timed on the file's own formats
MARGIN = 0.95  # a candidate replaces the plain kernel only where it is at least 5% faster
BUSY_CORES = 0.25  # a run during which other processes used more CPU than this is not trusted
MAX_RUNS = 4  # measurement runs per plan; it stops once two quiet runs agree
MAX_REMEASURES = 3  # starts that may measure again a plan that was measured on a busy machine


# the native step's stand-in format where the checkpoint's are not given (a test's bare shapes)
STAND_IN = "Q4_1"


@dataclass(frozen=True)
class Shapes:
    """The matmuls one decode step of the model runs, as [out, in] weights, and the formats the file
    stores them in: per projection, its segments' (format, rows) for the native step, each such
    layout with the number of layers stored so (Q4_K_M keeps some layers' attn_v and ffn_down in Q6_K)."""

    layer: dict[str, tuple[int, int]]  # the projections of one decoder layer
    head: tuple[int, int] | None  # the output projection (vocab x hidden)
    formats: dict[str, dict[tuple[tuple[str, int], ...], int]] = field(default_factory=dict)
    head_format: str = "Q8_0"

    @classmethod
    def of(cls, mc, quantized: dict | None = None) -> "Shapes":
        """From a ModelConfig and, where given, the checkpoint's quantized tensors (HF names)."""
        q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
        layer = {"qkv": (q + 2 * kv, mc.hidden_size), "o": (mc.hidden_size, q),
                 "gate_up": (2 * mc.intermediate_size, mc.hidden_size), "down": (mc.hidden_size, mc.intermediate_size)}
        formats: dict[str, dict] = {}
        head_format = "Q8_0"
        if quantized:
            for name, names in zip(layer, FUSED.values()):  # the same projections, in the same order
                for i in range(mc.num_layers):
                    tensors = [quantized.get(f"model.layers.{i}.{p}.weight") for p in names]
                    if any(t is None for t in tensors):
                        continue
                    segments: list[list] = []
                    for t in tensors:  # consecutive parts of one format run as one segment
                        if segments and segments[-1][0] == t.qtype:
                            segments[-1][1] += t.shape[0]
                        else:
                            segments.append([t.qtype, t.shape[0]])
                    key = tuple((f, r) for f, r in segments)
                    formats.setdefault(name, {})[key] = formats.get(name, {}).get(key, 0) + 1
            head = quantized.get("lm_head.weight" if not mc.tie_word_embeddings else "model.embed_tokens.weight")
            head_format = head.qtype if head is not None else head_format
        return cls(layer, (mc.vocab_size, mc.hidden_size), formats, head_format)

    def segments(self, name: str) -> dict[tuple[tuple[str, int], ...], int]:
        """Projection `name`'s layouts (segments of (format, rows)) and how many layers have each;
        the stand-in format where the file's are not known."""
        return self.formats.get(name) or {((STAND_IN, self.layer[name][0]),): 1}

    def key(self) -> list:
        formats = sorted((n, sorted([list(map(list, seg)), c] for seg, c in v.items())) for n, v in self.formats.items())
        return [sorted((n, list(s)) for n, s in self.layer.items()), list(self.head) if self.head else None,
                formats, self.head_format]


def _time_us(fn, reps: int) -> float:
    """The fastest of `reps` timed calls: robust to other processes sharing the cores."""
    fn()
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


class OtherLoad:
    """How many cores other processes kept busy while the block ran (Linux /proc/stat, less this
    process's own CPU time); 0.0 where it cannot be read."""

    def __enter__(self) -> "OtherLoad":
        self._start = (_busy_seconds(), time.process_time(), time.perf_counter())
        self.cores = 0.0
        return self

    def __exit__(self, *exc) -> None:
        busy0, cpu0, wall0 = self._start
        busy1 = _busy_seconds()
        wall = time.perf_counter() - wall0
        if busy0 is not None and busy1 is not None and wall > 0:
            self.cores = max(0.0, (busy1 - busy0) - (time.process_time() - cpu0)) / wall


def _busy_seconds() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


# where each block format keeps its fp16 scales (llama.cpp ggml-common.h): set to a normal number in a
# stand-in of random bytes, so that its weights are finite
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                "Q6_K": (208,)}


def stand_in(qtype: str, n: int, k: int, g: torch.Generator) -> PackedWeight | None:
    """A random [n, k] weight stored as GGUF `qtype`, packed for the native step as the file's own
    would be; None where the native kernels are not built or k does not fit the format's blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    if qtype not in PACKED_QTYPES or k % max(block, GROUP_SIZE) or not native.available():
        return None
    if qtype in ("F16", "BF16"):
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.float16 if qtype == "F16" else torch.bfloat16)
        return packed_weight(qtype, w.view(torch.uint8).numpy(), (n, k))
    raw = torch.randint(0, 256, (n, k // block, block_bytes), generator=g, dtype=torch.uint8)
    for at in _FP16_FIELDS[qtype]:
        raw[..., at : at + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    return packed_weight(qtype, raw.numpy().reshape(n, -1), (n, k))


def _weights(n: int, k: int, g: torch.Generator, int4: bool = False, q8: bool = False):
    """Random [n, k] weights dense in fp32 and bf16, and packed as asked (None where the shape or the
    native kernels do not allow it): int4 for PyTorch's kernel, q8 the Q8_0 output projection."""
    w32 = torch.randn(n, k, generator=g) * 0.02
    packed = quantized = None
    if int4 and k % GROUP_SIZE == 0:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        scale = torch.rand(n, k // GROUP_SIZE, generator=g) * 0.01
        packed = Int4Weight(q, scale, torch.zeros_like(scale))
    if q8 and k % GROUP_SIZE == 0 and native.available():
        quantized = Q8Weight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                             torch.rand(n, k // GROUP_SIZE, generator=g) * 0.01)
    return w32, w32.bfloat16(), packed, quantized


def _measure_once(shapes: Shapes, can_pack: bool) -> dict[str, dict[int, float]]:
    """One run: each kernel at each batch size, summed over the layer's projections at their own
    shapes; the output projection on its own shape (dense in either dtype, and the Q8_0 kernel).

    The native step ("packed") runs stand-ins of the file's own formats, segment by segment, each
    layout weighted by the share of layers stored so; PyTorch's int4 kernel ("int4_bfloat16") takes
    the layouts whose every part it can hold (Q4_0, Q4_1, Q4_K), the others count at dense bf16."""
    g = torch.Generator().manual_seed(0)
    timings: dict[str, dict[int, float]] = {"dense_float32": {}, "dense_bfloat16": {}, "int4_bfloat16": {}, "packed": {}}
    for name, (n, k) in shapes.layer.items():
        w32, wbf, int4, _ = _weights(n, k, g, int4=can_pack)
        layouts = shapes.segments(name)
        total = sum(layouts.values())
        steps = [(count / total, [stand_in(f, rows, k, g) for f, rows in layout]) for layout, count in layouts.items()] if can_pack else []
        if any(w is None for _, ws in steps for w in ws):  # no native kernels, or a width no format takes
            steps = []
        int4_share = sum(c for layout, c in layouts.items() if all(is_packable(f) for f, _ in layout)) / total
        for m in BATCH_SIZES:
            x = torch.randn(m, k, generator=g)
            xb = x.bfloat16()
            reps = max(5, 96 // m)
            dense = {"dense_float32": _time_us(lambda: F.linear(x, w32), reps),
                     "dense_bfloat16": _time_us(lambda: F.linear(xb, wbf), reps)}
            for kind, t in dense.items():
                timings[kind][m] = timings[kind].get(m, 0.0) + t
            if int4 is not None:
                t = _time_us(lambda: int4.matmul(xb), reps) if int4_share else 0.0
                timings["int4_bfloat16"][m] = timings["int4_bfloat16"].get(m, 0.0) + int4_share * t + (
                    1 - int4_share) * dense["dense_bfloat16"]
            if steps:
                t = sum(share * _time_us(lambda ws=ws: [w.matmul(x) for w in ws], reps) for share, ws in steps)
                timings["packed"][m] = timings["packed"].get(m, 0.0) + t
    if shapes.head is not None:
        n, k = shapes.head
        w32, wbf, _, q8 = _weights(n, k, g, q8=True)
        step = stand_in(shapes.head_format, n, k, g) if shapes.head_format in PACKED_QTYPES else None
        timings.update({"head_float32": {}, "head_bfloat16": {}, "head_q8": {}, "head_packed": {}})
        for m in HEAD_BATCH_SIZES:
            x = torch.randn(m, k, generator=g)
            xb = x.bfloat16()
            reps = max(3, 24 // m)
            timings["head_float32"][m] = _time_us(lambda: F.linear(x, w32), reps)
            timings["head_bfloat16"][m] = _time_us(lambda: F.linear(xb, wbf), reps)
            if q8 is not None:
                timings["head_q8"][m] = _time_us(lambda: q8.matmul(x), reps)
            if step is not None:
                timings["head_packed"][m] = _time_us(lambda: step.matmul(x), reps)
        del w32, wbf, q8, step
    return {name: {m: round(t, 1) for m, t in v.items()} for name, v in timings.items() if v}


def decide(timings: dict[str, dict[int, float]], dtype: str = "auto") -> tuple[str, int, int, bool]:
    """(dtype, int4 rows, Q8_0 head rows, native step) from the timings. A candidate must win by
    MARGIN, so a near tie goes the same way however the noise falls."""
    if dtype == "auto":  # bf16 only where it wins at the batch sizes that dominate serving (decode 1..64)
        sizes = [m for m in BATCH_SIZES if m <= 64]
        wins = sum(timings["dense_bfloat16"][m] < MARGIN * timings["dense_float32"][m] for m in sizes)
        dtype = "bfloat16" if wins > len(sizes) // 2 else "float32"
    int4_rows = 0
    if dtype == "bfloat16" and "int4_bfloat16" in timings:
        for m in BATCH_SIZES:
            if timings["int4_bfloat16"][m] >= MARGIN * timings["dense_bfloat16"][m]:
                break
            int4_rows = m
    q8_rows = 0
    if dtype == "bfloat16" and timings.get("head_q8"):
        for m in HEAD_BATCH_SIZES:
            if m not in timings["head_q8"] or timings["head_q8"][m] >= MARGIN * timings["head_bfloat16"][m]:
                break
            q8_rows = m
    step = False
    if timings.get("packed", {}).get(1) is not None:  # against the best PyTorch layer at one decode row
        best = min(timings[name][1] for name in ("dense_float32", "dense_bfloat16", "int4_bfloat16") if 1 in timings.get(name, {}))
        step = timings["packed"][1] < MARGIN * best
    return dtype, int4_rows, q8_rows, step


def is_plausible(timings: dict[str, dict[int, float]]) -> bool:
    """No kernel takes less than half as long for twice the rows: a run that says so was disturbed
    at the smaller size. (A library switching kernels between sizes does speed up, but not 2x: seen
    here, 0.73x from 8 to 16 rows of the fp32 output projection.)"""
    for v in timings.values():
        sizes = sorted(v)
        if any(v[b] < 0.5 * v[a] for a, b in zip(sizes, sizes[1:])):
            return False
    return True


def measure_plan(shapes: Shapes, threads: int, can_pack: bool, dtype: str = "auto", max_runs: int = MAX_RUNS,
                 busy_cores: float = BUSY_CORES) -> KernelPlan:
    """Measure until two quiet runs agree (at most max_runs), each figure the fastest over the quiet
    runs. A run during which other processes kept more than `busy_cores` cores busy is not trusted;
    if no run was quiet, the plan is marked so (`quiet=False`) and measured again at a later start."""
    torch.set_num_threads(threads)
    quiet: list[dict] = []
    every: list[dict] = []
    loads: list[float] = []
    for _ in range(max_runs):
        with OtherLoad() as load:
            run = _measure_once(shapes, can_pack)
        every.append(run)
        loads.append(round(load.cores, 2))
        if load.cores <= busy_cores and is_plausible(run):
            quiet.append(run)
            if len(quiet) >= 2 and decide(quiet[-1], dtype) == decide(quiet[-2], dtype):
                break
    timings = _fastest(quiet or every)
    chosen, int4_rows, q8_rows, step = decide(timings, dtype)
    return KernelPlan("cpu", chosen, threads, int4_rows, q8_rows, step, cpu_name(), timings,
                      quiet=bool(quiet) and is_plausible(timings), runs=len(every), other_load=loads)


def _fastest(runs: list[dict]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for run in runs:
        for name, v in run.items():
            for m, t in v.items():
                out.setdefault(name, {})[m] = min(t, out.get(name, {}).get(m, float("inf")))
    return out


def plan_dir(home: Path) -> Path:
    """$STRATUM_PLAN_DIR, else $STRATUM_HOME/kernels. The test suite points it at a directory of its
    own, so no test writes the plan a server on the machine uses."""
    return Path(os.environ.get("STRATUM_PLAN_DIR") or home / "kernels")


def plan_cache_path(home: Path, shapes: Shapes, threads: int, dtype: str, can_pack: bool) -> Path:
    """Keyed on everything that changes the answer: the CPU and its features, torch, the native
    kernels (and the instructions they were built for), the threads, the model's shapes and what may be asked of the plan."""
    key = json.dumps([PLAN_VERSION, cpu_name(), sorted(cpu_flags()), torch.__version__, native.status(),
                      threads, shapes.key(), dtype, can_pack])
    return plan_dir(home) / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def select_plan(home: Path, shapes: Shapes, threads: int, can_pack: bool, dtype: str = "auto",
                remeasure: bool = False, measure: bool = True, take_busy: bool = False) -> KernelPlan | None:
    """The cached plan for this machine and model, or a freshly measured one (then cached).

    A cached plan measured on a busy machine is measured again (its figures merged with the new
    ones, fastest first) at up to MAX_REMEASURES starts; `remeasure` forces a new measurement.
    With `measure` False nothing is measured: None where a measurement would be due. With
    `take_busy`, a cached plan is taken as it is, measured on a busy machine or not."""
    path = plan_cache_path(home, shapes, threads, dtype, can_pack)
    cached = None if remeasure else _read(path)
    if cached is not None and (cached.quiet or cached.remeasured >= MAX_REMEASURES or take_busy):
        return cached
    if not measure:
        return None
    plan = measure_plan(shapes, threads, can_pack, dtype)
    if cached is not None:  # a busy plan measured again: the fastest figure of either is the truer one
        timings = _fastest([cached.timings_us, plan.timings_us])
        chosen, int4_rows, q8_rows, step = decide(timings, dtype)
        plan = replace(plan, dtype=chosen, int4_max_tokens=int4_rows, q8_max_rows=q8_rows, packed_step=step, timings_us=timings,
                       remeasured=cached.remeasured + 1, runs=cached.runs + plan.runs,
                       other_load=cached.other_load + plan.other_load)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(plan.describe(), indent=1))
    os.replace(tmp, path)
    return plan


def _read(path: Path) -> KernelPlan | None:
    try:
        data = json.loads(path.read_text())
        data["timings_us"] = {k: {int(m): t for m, t in v.items()} for k, v in data["timings_us"].items()}
        return KernelPlan(**{**data, "source": "cache"})
    except (OSError, ValueError, TypeError, KeyError):
        return None  # missing, stale or corrupt: measured again
