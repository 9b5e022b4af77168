"""`stratum bench roofline`: how close single-stream decode runs to this machine's memory bandwidth.

Decode at batch 1 must read every weight once per token, so bytes read ÷ bandwidth is the floor of
the step time. Reports the measured bandwidth (copy and read), the bytes one decode step reads with
the kernels the engine chose, the measured step time, and floor ÷ step time.

On a machine whose bandwidth moves from second to second (a shared host, a VM), a floor read before
the steps compares two moments: `paired` reads the bandwidth again between every few steps and gives
floor ÷ step per round, so each ratio compares one moment, and their median.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import time

import numpy as np
import torch


def read_buffer(megabytes: int) -> torch.Tensor:
    """fp32 ones on the memory the engine's weights are on: anonymous memory advised for huge pages
    where the kernel offers them (engine/weight_cache.py moves the weights onto such memory), else the
    allocator's pages; the floor is that memory's bandwidth."""
    from stratum.engine.weight_cache import huge_pages_offered

    n = megabytes * 2**20 // 4
    if not huge_pages_offered():
        return torch.ones(n)
    buf = mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused: 4 KB pages, as the weights' move would be refused too
        pass
    a = torch.from_numpy(np.frombuffer(buf, dtype=np.float32))  # holds buf
    a.fill_(1.0)
    return a


def read_bandwidth(a: torch.Tensor) -> float:
    """Bytes a second of one sum over `a`: a read of all of it."""
    t = time.perf_counter()
    a.sum()
    return a.numel() * a.element_size() / (time.perf_counter() - t)


def measure_bandwidth(megabytes: int = 512, reps: int = 5) -> dict[str, float]:
    """Best-of-reps GB/s for a tensor copy (read + write) and a sum (read only), on `read_buffer`'s memory."""
    n = megabytes * 2**20 // 4
    a = read_buffer(megabytes)
    b = torch.empty(n)
    best_copy = best_read = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        best_copy = min(best_copy, time.perf_counter() - t)
        t = time.perf_counter()
        a.sum()
        best_read = min(best_read, time.perf_counter() - t)
    size = n * 4
    return {"copy_gb_s": round(2 * size / best_copy / 1e9, 2), "read_gb_s": round(size / best_read / 1e9, 2)}


def decode_bytes(engine) -> int:
    """Bytes of weights one batch-1 decode step reads, with the engine's kernels."""
    from stratum.layers.linear import Linear

    model = engine.model
    if model.packed is not None:  # the native step: the packed blocks, the norms, the packed head
        head = model.packed_head.nbytes if model.packed_head is not None else (
            model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size())
        return model.packed.nbytes + sum(w.numel() * w.element_size() for w in model.packed.weights[:3]) + head
    total = 0
    for module in engine.model.modules():
        if isinstance(module, Linear):
            if module.quantized is not None:
                total += module.quantized.nbytes
            else:
                total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, torch.nn.Module) and hasattr(module, "eps"):  # RMSNorm
            total += module.weight.numel() * module.weight.element_size()
    if model.packed_head is not None:
        return total + model.packed_head.nbytes
    lm_head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    return total + lm_head.numel() * lm_head.element_size()


def _start_decode(engine, num_steps: int) -> None:
    """One greedy request, prefilled and warmed, with num_steps decode steps left to run."""
    from stratum.engine.sampling_params import SamplingParams

    ids = engine.tokenizer.encode("Write a long story about a dragon who learns to bake bread.")
    engine.add_request(ids, SamplingParams(max_tokens=num_steps + 4, temperature=0.0, ignore_eos=True),
                       request_id="roofline")
    for _ in range(4):  # prefill and warm-up
        engine.step()


def _time_steps(engine, n: int) -> list[float]:
    times = []
    while engine.has_unfinished() and len(times) < n:
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def measure_decode_step(engine, num_steps: int = 64) -> float:
    """Median wall time of a batch-1 decode step (the whole engine step: schedule, forward, sampling)."""
    _start_decode(engine, num_steps)
    return statistics.median(_time_steps(engine, num_steps))


def measure_paired(engine, weight_bytes: int, rounds: int = 12, steps: int = 8, megabytes: int = 512) -> dict:
    """floor ÷ step per round: `steps` decode steps (their median) between two reads of `megabytes`,
    the faster of which is the bandwidth then (the floor it gives is the lower); the rounds' median
    ratio, and the median bandwidth and step they came from."""
    a = read_buffer(megabytes)
    read_bandwidth(a)
    _start_decode(engine, rounds * steps)
    bws, step_s, ratios = [], [], []
    before = read_bandwidth(a)
    for _ in range(rounds):
        step = statistics.median(_time_steps(engine, steps))
        after = read_bandwidth(a)
        bw, before = max(before, after), after
        bws.append(bw)
        step_s.append(step)
        ratios.append(weight_bytes / bw / step)
    _time_steps(engine, 1 << 30)  # what is left of the request
    return {"rounds": rounds, "steps_per_round": steps, "read_gb_s_median": round(statistics.median(bws) / 1e9, 2),
            "decode_step_ms_median": round(statistics.median(step_s) * 1e3, 3),
            "floor_over_step_median": round(statistics.median(ratios), 3),
            "floor_over_step_by_round": [round(r, 3) for r in ratios]}


def run(model: str, dtype: str = "auto", activations: str = "int16") -> dict:
    from stratum.engine import EngineCore
    from stratum.engine.config import EngineConfig
    from stratum.engine.weight_cache import wait_moves

    engine = EngineCore(EngineConfig(model=model, dtype=dtype, activations=activations, kv_disk_gb=0))
    wait_moves()  # the weights on the memory they serve from
    bw = measure_bandwidth()
    weight_bytes = decode_bytes(engine)
    step_s = measure_decode_step(engine)
    floor_s = weight_bytes / (bw["read_gb_s"] * 1e9)
    return {
        "model": model, "kernels": engine.kernel_choices, "bandwidth": bw,
        "decode_weight_bytes": weight_bytes, "decode_weight_mib": round(weight_bytes / 2**20, 1),
        "decode_step_ms": round(step_s * 1e3, 3), "decode_tokens_per_s": round(1 / step_s, 1),
        "bandwidth_floor_ms": round(floor_s * 1e3, 3), "floor_over_step": round(floor_s / step_s, 3),
        "paired": measure_paired(engine, weight_bytes),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stratum bench roofline", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--activations", default="int16", choices=["int16", "int8"], help="as `stratum serve --activations`")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    result = run(args.model, args.dtype, args.activations)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
