"""The native step of two checkouts side by side, as ratios: decode at 1 and 8 rows and a prefill (--context tokens).

Each checkout runs in its own process (both libraries register the same op names), alternately, for a
few rounds; each figure is the median of its calls, each side's the best of its rounds, and the output
is JSON with B / A time ratios (below 1: B is faster). Only the step's forward is timed (the packed
layers, attention, the final norm), not the output projection or sampling. Run it under the CPU lock:

    flock /tmp/stratum-cpu.lock python scripts/bench_step_ab.py --a /path/to/before --b . --march native haswell
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORKER = r"""
import json, statistics, sys, time, torch
from stratum.engine import LLM
from stratum.layers.attention import AttentionMetadata

model_name, calls, threads, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
engine = LLM(model_name, native_step=True, dtype="float32", int4_max_tokens=0, num_kv_blocks=512,
             enable_prefix_cache=False, num_threads=threads or None).engine
assert engine.kernel_choices["step"].startswith("native"), engine.kernel_choices
model, caches, bs = engine.model, engine.runner.kv_caches, engine.config.block_size
per_seq = (context + 128) // bs
tables = torch.arange(8 * per_seq).view(8, per_seq)
g = torch.Generator().manual_seed(0)

def forward(rows):  # rows: (sequence, position) pairs
    seq = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([p for _, p in rows])
    ids = torch.randint(0, model.config.vocab_size, (len(rows),), generator=g)
    meta = AttentionMetadata(slot_mapping=tables[seq, pos // bs] * bs + pos % bs, block_size=bs, row_tables=tables,
                             row_seq=seq)
    t = time.perf_counter()
    with torch.inference_mode():
        model.forward(ids, pos, meta, caches)
    return time.perf_counter() - t

if calls == 0:  # a warm-up: the library built and loaded, the weights read once
    forward([(0, p) for p in range(16)])
    print(json.dumps({}))
    sys.exit(0)
prefill = [forward([(s, p) for p in range(context)]) for s in range(8)]  # also fills every context
results = {"simd": torch.ops.stratum.packed_simd(), "threads": torch.get_num_threads(),
           "prefill_ms": statistics.median(prefill[2:]) * 1e3,
           "decode_1_ms": statistics.median(forward([(0, context)]) for _ in range(calls)) * 1e3,
           "decode_8_ms": statistics.median(forward([(s, context) for s in range(8)])
                                            for _ in range(max(1, calls // 4))) * 1e3}
print(json.dumps(results))
"""


def run_worker(tree: str, march: str, model: str, calls: int, threads: int, context: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "STRATUM_MARCH": march}
    proc = subprocess.run([sys.executable, "-c", WORKER, model, str(calls), str(threads), str(context)], env=env,
                          capture_output=True, text=True,
                          timeout=1800, cwd=os.path.abspath(tree))
    if proc.returncode != 0:
        raise SystemExit(f"{tree} (-march={march}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="the reference checkout")
    p.add_argument("--b", required=True, help="the checkout measured against it")
    p.add_argument("--march", nargs="+", default=["native"], help="STRATUM_MARCH values to build and run")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=200, help="decode calls per round (8-row decode: a quarter)")
    p.add_argument("--threads", type=int, default=0, help="the step's threads (0: the engine's default)")
    p.add_argument("--context", type=int, default=512,
                   help="tokens per prefill, and the context the decodes attend over")
    args = p.parse_args(argv)
    for march in args.march:  # build both (and warm the caches) before anything is timed
        for tree in (args.a, args.b):
            run_worker(tree, march, args.model, 0, args.threads, args.context)
    out: dict = {"model": args.model, "rounds": args.rounds, "context": args.context,
                 "threads": args.threads or "default", "a": os.path.abspath(args.a), "b": os.path.abspath(args.b),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    for march in args.march:
        runs: dict[str, list[dict]] = {"a": [], "b": []}
        for _ in range(args.rounds):
            for side in ("a", "b"):
                runs[side].append(run_worker(getattr(args, side), march, args.model, args.calls, args.threads,
                                             args.context))
        row: dict = {"simd": {side: runs[side][0]["simd"] for side in runs}}
        for metric in ("decode_1_ms", "decode_8_ms", "prefill_ms"):
            best = {side: min(r[metric] for r in runs[side]) for side in runs}
            row[metric] = {"a": round(best["a"], 3), "b": round(best["b"], 3),
                           "b_over_a": round(best["b"] / best["a"], 4),
                           "all": {side: [round(r[metric], 3) for r in runs[side]] for side in runs}}
        out["results"][march] = row
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
