"""One stream of Stratum and of llama-server against the same moment's bandwidth floor.

Both servers are up at once on the same GGUF (one idles while the other runs); rounds alternate them,
each run (`stratum bench compare`, one stream, greedy, ignore_eos) between two reads of the memory
bandwidth (a sum over 512 MB on the memory Stratum's weights are on: `stratum bench roofline`'s
`read_buffer` and `read_bandwidth`), the faster of which is the bandwidth then. Per run: floor = the
bytes a decode step reads / that bandwidth, and floor ÷ TPOT (p50).
Both engines read the same weights a token (the roofline's decode_weight_bytes, given), so the ratio
of their TPOTs is bounded by how far the slower one is from the floor: a goal of k times the peer at
one stream needs the peer's floor ÷ TPOT below 1/k of ours.

Usage: python scripts/perf/one_stream_floor.py GGUF LLAMA_SERVER WEIGHT_BYTES [ROUNDS] > out.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from stratum.bench.roofline import read_bandwidth, read_buffer
from stratum.bench.speculative import Server, start, stop

ROOT = Path(__file__).parents[2]
STRATUM = str(ROOT / ".venv" / "bin" / "stratum")


def one_stream(url: str, label: str, seed: int, requests: int) -> dict:
    out = subprocess.run([STRATUM, "bench", "compare", "--api", "openai", "--model", "m", "--url", url,
                          "--label", label, "--workload", "unique", "--concurrency", "1", "--max-tokens", "128",
                          "--num-requests", str(requests), "--ignore-eos", "--seed", str(seed)],
                         capture_output=True, text=True, check=True)
    target = json.loads(out.stdout)["targets"][0]
    return {"tpot_ms_p50": target["tpot_ms"]["p50"], "output_tok_s": target["output_tok_s"]}


def main() -> int:
    gguf, llama, weight_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    work = Path(tempfile.mkdtemp())
    servers = [Server("stratum", (STRATUM, "serve", "--model", gguf, "--served-model-name", "m",
                                  "--activations", "int8",
                                  "--kv-disk-dir", str(work / "kv"))),
               Server("llama-server", (llama, "-m", gguf, "-t", "2", "--parallel", "1", "-c", "4096", "-fa", "off"),
                      is_stratum=False)]
    procs, urls = [], {}
    try:
        for server in servers:  # each up (a Stratum start's kernels prepared), or an error naming its log
            proc, urls[server.label] = start(server, work / f"{server.label}.log")
            procs.append(proc)
        a = read_buffer(512)
        read_bandwidth(a)  # the buffer read once before the figures
        runs = {name: [] for name in urls}
        before = read_bandwidth(a) / 1e9
        for r in range(rounds):
            for name in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                result = one_stream(urls[name], name, seed=100 + r, requests=4)
                after = read_bandwidth(a) / 1e9
                bw, before = max(before, after), after
                floor_ms = weight_bytes / (bw * 1e9) * 1e3
                runs[name].append({**result, "read_gb_s": round(bw, 2), "floor_ms": round(floor_ms, 2),
                                   "floor_over_tpot": round(floor_ms / result["tpot_ms_p50"], 3)})
        summary = {name: {"floor_over_tpot_median": statistics.median(x["floor_over_tpot"] for x in v),
                          "tpot_ms_p50_median": statistics.median(x["tpot_ms_p50"] for x in v)}
                   for name, v in runs.items()}
        pairs = [ll["tpot_ms_p50"] / s["tpot_ms_p50"] for s, ll in zip(runs["stratum"], runs["llama-server"])]
        print(json.dumps({"gguf": gguf, "weight_bytes": weight_bytes, "rounds": rounds, "summary": summary,
                          "tpot_ratio_llama_over_stratum_by_round": [round(p, 3) for p in pairs],
                          "most_ratio_at_the_floor": round(1 / summary["llama-server"]["floor_over_tpot_median"], 3),
                          "runs": runs}, indent=1))
    finally:
        for proc in procs:
            stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
