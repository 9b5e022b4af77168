"""The kernel plan: the speed choices that leave the numerics as they are (the native step's threads),
measured once within a time budget and cached; on a busy machine, the CPU family's defaults."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stratum.kernels import KernelPlan, PlanSource, native
from stratum.kernels.cpu import cpu_family, cpu_flags, cpu_name
from stratum.kernels.packed import FUSED, PACKED_QTYPES, PackedWeight
from stratum.kernels.packed import pack as packed_weight
from stratum.kernels.quant import GROUP_SIZE

PLAN_VERSION = 7  # 7: the native step's threads only; the numerics follow a rule (kernels/numerics.py)
MARGIN = 0.95  # another thread count replaces the default only where it is at least 5% faster
BUSY_CORES = 0.25  # a run during which other processes used more CPU than this is not trusted
MAX_RUNS = 4  # measurement runs per plan; it stops once two quiet runs agree
# wall seconds all runs may take together: a quiet run of a 1 B Q4_K_M file's layer takes ~0.2 s, while
# on cores other processes hold, one 2-thread call waits 100x longer (65 ms, measured), so a start
# would otherwise wait minutes for figures it cannot trust anyway
MAX_SECONDS = 3.0
ROWS = (1, 16)  # rows per step timed: one decode, a batch of decodes
STAND_IN_ROWS = 1024  # a stand-in's rows at most: enough to show the thread scaling, quick to build
STAND_IN = "Q4_1"  # the stand-in format where the checkpoint's are not given (a test's bare shapes)


@dataclass(frozen=True)
class Shapes:
    """The projections of one decoder layer as [out, in] weights, and the formats the file stores
    them in: per projection, its segments' (format, rows), each such layout with the number of
    layers stored so (Q4_K_M keeps some layers' attn_v and ffn_down in Q6_K)."""

    layer: dict[str, tuple[int, int]]
    formats: dict[str, dict[tuple[tuple[str, int], ...], int]] = field(default_factory=dict)

    @classmethod
    def of(cls, mc, quantized: dict | None = None) -> "Shapes":
        """From a ModelConfig and, where given, the checkpoint's quantized tensors (HF names)."""
        q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
        layer = {"qkv": (q + 2 * kv, mc.hidden_size), "o": (mc.hidden_size, q),
                 "gate_up": (2 * mc.intermediate_size, mc.hidden_size), "down": (mc.hidden_size, mc.intermediate_size)}
        formats: dict[str, dict] = {}
        for name, names in zip(layer, FUSED.values()):  # the same projections, in the same order
            for i in range(mc.num_layers if quantized else 0):
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
        return cls(layer, formats)

    def segments(self, name: str) -> dict[tuple[tuple[str, int], ...], int]:
        """Projection `name`'s layouts (segments of (format, rows)) and how many layers have each;
        the stand-in format where the file's are not known."""
        return self.formats.get(name) or {((STAND_IN, self.layer[name][0]),): 1}

    def key(self) -> list:
        formats = sorted((n, sorted([list(map(list, seg)), c] for seg, c in v.items()))
                         for n, v in self.formats.items())
        return [sorted((n, list(s)) for n, s in self.layer.items()), formats]


class OutOfTime(Exception):
    """The measurement's budget (MAX_SECONDS) ran out before its run ended."""


def _time_us(fn, reps: int, deadline: float) -> float:
    """The fastest of `reps` timed calls: robust to other processes sharing the cores.

    Raises:
        OutOfTime: `deadline` (perf_counter) passed; checked after each call.
    """
    best = float("inf")
    for i in range(reps + 2):  # two warm-up calls
        t = time.perf_counter()
        fn()
        now = time.perf_counter()
        if now > deadline:
            raise OutOfTime
        if i >= 2:
            best = min(best, now - t)
    return best * 1e6


class OtherLoad:
    """How many cores other processes kept busy while the block ran (Linux /proc/stat, less this
    process's own CPU time); 0.0 where it cannot be read. /proc/stat counts in ticks of 10 ms, so a
    block shorter than MIN_WINDOW_S is followed by a wait up to it: over a 13 ms run (a small model's
    layer) one tick either way read a core kept busy by a spinning process as 0.0 or 2.0 (measured)."""

    MIN_WINDOW_S = 0.2  # 20 ticks: the reading within ~0.1 core

    def __enter__(self) -> "OtherLoad":
        self._start = (_busy_seconds(), time.process_time(), time.perf_counter())
        self.cores = 0.0
        return self

    def __exit__(self, *exc) -> None:
        busy0, cpu0, wall0 = self._start
        wait = self.MIN_WINDOW_S - (time.perf_counter() - wall0)
        if wait > 0:  # this process idle: what is busy now is other processes
            time.sleep(wait)
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
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,)}


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


def thread_counts(cores: int) -> list[int]:
    """The candidates: 1, the powers of two below the cores, and every core."""
    return sorted({1, cores} | {2**i for i in range(cores.bit_length()) if 2**i <= cores})


def _stand_ins(shapes: Shapes, g: torch.Generator) -> list[tuple[float, list[PackedWeight]]]:
    """Per projection layout, (its share of the layers, its segments as stand-ins of at most
    STAND_IN_ROWS rows each); empty where the native kernels are not built."""
    out = []
    for name, (_, k) in shapes.layer.items():
        layouts = shapes.segments(name)
        total = sum(layouts.values())
        for layout, count in layouts.items():
            ws = [stand_in(f, min(rows, STAND_IN_ROWS), k, g) for f, rows in layout]
            if any(w is None for w in ws):
                return []
            out.append((count / total, ws))
    return out


def _measure_once(steps: list, candidates: list[int], deadline: float) -> dict[str, dict[int, float]]:
    """One run: the layer's projections at each of ROWS, at each thread count, in microseconds
    (OutOfTime past `deadline`)."""
    g = torch.Generator().manual_seed(0)
    xs = {m: {k: torch.randn(m, k, generator=g) for k in {w.in_features for _, ws in steps for w in ws}} for m in ROWS}
    timings: dict[str, dict[int, float]] = {}
    for threads in candidates:
        torch.set_num_threads(threads)
        for m in ROWS:
            reps = max(5, 48 // m)
            t = sum(share * _time_us(lambda ws=ws: [w.matmul(xs[m][w.in_features]) for w in ws], reps, deadline)
                    for share, ws in steps)
            timings.setdefault(f"native_{threads}_threads", {})[m] = round(t, 1)
    return timings


def choose_threads(timings: dict[str, dict[int, float]], default: int) -> int:
    """The thread count: the fastest over ROWS where it beats `default` by MARGIN, else `default`,
    so a near tie goes the same way however the noise falls."""
    totals = {int(name.split("_")[1]): sum(v.values()) for name, v in timings.items()}
    best = min(totals, key=totals.get)
    return best if default not in totals or totals[best] < MARGIN * totals[default] else default


def defaults(threads: int, why: str) -> KernelPlan:
    """The plan known good for this CPU family without a measurement: the native step on every core
    (measured on 2-core machines, Intel and AMD: 1.3-1.7x the tokens/s of one thread)."""
    return KernelPlan("cpu", threads, cpu_name(), source=PlanSource.DEFAULTS, quiet=False,
                      basis=f"defaults for {cpu_family()}: {why}")


def measure_plan(shapes: Shapes, cores: int, max_runs: int = MAX_RUNS, busy_cores: float = BUSY_CORES,
                 budget_s: float = MAX_SECONDS) -> KernelPlan:
    """Measure until two quiet runs agree (at most max_runs, within budget_s wall seconds), each figure
    the fastest over the quiet runs. A run during which other processes kept more than `busy_cores`
    cores busy is not trusted, nor one the budget cut short; with no quiet run, the plan is the CPU
    family's defaults (`quiet=False`), its figures kept to show why."""
    steps = _stand_ins(shapes, torch.Generator().manual_seed(0))
    if not steps:
        return defaults(cores, "the native kernels are not built")
    threads_before = torch.get_num_threads()
    candidates = thread_counts(cores)
    quiet: list[dict] = []
    every: list[dict] = []
    loads: list[float] = []
    deadline = time.perf_counter() + budget_s
    out_of_time = False
    try:
        for _ in range(max_runs):
            with OtherLoad() as load:
                try:
                    run = _measure_once(steps, candidates, deadline)
                except OutOfTime:
                    run, out_of_time = None, True
            loads.append(round(load.cores, 2))
            if run is None:
                break
            every.append(run)
            if load.cores <= busy_cores:
                quiet.append(run)
                if len(quiet) >= 2 and choose_threads(quiet[-1], cores) == choose_threads(quiet[-2], cores):
                    break
    finally:
        torch.set_num_threads(threads_before)
    timings = _fastest(quiet or every)
    if not quiet:
        why = (f"the measurement ran past its {budget_s:g} s with other processes keeping {max(loads)} cores busy"
               if out_of_time else f"other processes kept {min(loads)}+ cores busy in every run of the measurement")
        plan = defaults(cores, why)
        return KernelPlan(**{**plan.describe(), "timings_us": timings, "runs": len(every), "other_load": loads})
    return KernelPlan("cpu", choose_threads(timings, cores), cpu_name(), timings, runs=len(every), other_load=loads,
                      basis=f"measured: {len(quiet)} quiet runs of {len(every)}")


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


def plan_cache_path(home: Path, shapes: Shapes, cores: int) -> Path:
    """Keyed on what makes a measurement stale: the CPU and its features, torch, the native step's
    build (its source, flags and instructions), the cores and the model's shapes and formats."""
    key = json.dumps([PLAN_VERSION, cpu_name(), sorted(cpu_flags()), torch.__version__,
                      native.build_dir(home, native.STEP).name, cores, shapes.key()])
    return plan_dir(home) / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def select_plan(home: Path, shapes: Shapes, cores: int, remeasure: bool = False, measure: bool = True) -> KernelPlan:
    """The cached plan for this machine, build and model (measured quietly or not: never measured
    again here), or a fresh measurement, then cached; with `measure` False and nothing cached, the
    CPU family's defaults, uncached (the next start that may measure does)."""
    path = plan_cache_path(home, shapes, cores)
    cached = None if remeasure else _read(path)
    if cached is not None:
        return cached
    if not measure:
        return defaults(cores, "not measured yet")
    plan = measure_plan(shapes, cores)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(plan.describe(), indent=1))
    os.replace(tmp, path)
    return plan


def _read(path: Path) -> KernelPlan | None:
    try:
        data = json.loads(path.read_text())
        data["timings_us"] = {k: {int(m): t for m, t in v.items()} for k, v in data["timings_us"].items()}
        return KernelPlan(**{**data, "source": PlanSource.CACHE})
    except (OSError, ValueError, TypeError, KeyError):
        return None  # missing, stale or corrupt: measured again
