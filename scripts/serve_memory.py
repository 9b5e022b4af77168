"""Start `stratum serve` on a model, and report what it cost: peak resident memory of the server and
its engine process (VmHWM), time until /health answers, the checkpoint cache's size, and decode
tokens/s of a few sequential streamed requests. JSON on stdout.

Run it twice on a file to see a first start (converting) and a later one (from the caches); hold
/tmp/stratum-cpu.lock for the whole run on a shared machine.

Usage: python scripts/serve_memory.py MODEL.gguf [--fresh] [--requests 4] [--max-tokens 64] [--port 8093]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil


def tree_peak(pid: int) -> dict[str, int]:
    """VmHWM (peak resident set, bytes) of the process and each of its descendants, by command name."""
    out = {}
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
            hwm = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
            name = "engine" if "stratum.engine.process" in " ".join(p.cmdline()) else "server"
            out[name] = max(out.get(name, 0), hwm)
        except (OSError, psutil.Error, StopIteration):
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--fresh", action="store_true", help="remove the file's checkpoint cache first (a first start)")
    args = parser.parse_args()
    from stratum.models.loader import _cache_dir

    cache_dir = _cache_dir(Path(args.model))
    if args.fresh and cache_dir is not None:  # a first start: the checkpoint's caches made anew
        shutil.rmtree(cache_dir, ignore_errors=True)
    cached_before = cache_dir is not None and (cache_dir / "meta.json").exists()
    cmd = [sys.executable, "-m", "stratum.cli", "serve", "--model", args.model, "--port", str(args.port),
           "--data-dir", ""]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:  # VmHWM is a running maximum; sampling only finds the processes
        while not stop.is_set():
            for k, v in tree_peak(proc.pid).items():
                peaks[k] = max(peaks.get(k, 0), v)
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    base = f"http://127.0.0.1:{args.port}"
    ready = None
    try:
        while time.perf_counter() - started < args.timeout_s:
            if proc.poll() is not None:
                raise SystemExit(f"server exited: {proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    ready = time.perf_counter() - started
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if ready is None:
            raise SystemExit("server not ready in time")
        load_peaks = dict(peaks)
        served = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        runs = []
        for i in range(args.requests):
            body = {"model": served, "prompt": f"Request {i}: the history of the printing press begins",
                    "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            t0, first, tokens = time.perf_counter(), None, 0
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if any(c.get("text") for c in chunk.get("choices") or []):
                            first = first or time.perf_counter()
                        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            end = time.perf_counter()  # decode rate: the tokens after the first, over the time after it
            runs.append({"ttft_s": round(first - t0, 3), "tokens": tokens,
                         "decode_tok_s": round((tokens - 1) / (end - first), 2) if tokens > 1 else None})
        for k, v in tree_peak(proc.pid).items():
            peaks[k] = max(peaks.get(k, 0), v)
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    size = os.path.getsize(args.model)
    cache = sum(f.stat().st_size for f in cache_dir.iterdir()) if cache_dir is not None and cache_dir.exists() else 0
    rates = sorted(r["decode_tok_s"] for r in runs if r["decode_tok_s"])
    print(json.dumps({
        "model": args.model, "file_gib": round(size / 2**30, 3), "cache_existed": cached_before,
        "cache_dir_gib": round(cache / 2**30, 3), "ready_s": round(ready, 1),
        "peak_rss_gib_at_ready": {k: round(v / 2**30, 3) for k, v in load_peaks.items()},
        "peak_rss_gib": {k: round(v / 2**30, 3) for k, v in peaks.items()},
        "requests": runs, "decode_tok_s_median": rates[len(rates) // 2] if rates else None,
        "cpu_count": os.cpu_count(),
    }, indent=1))


if __name__ == "__main__":
    main()
