"""How long a server takes to replace its engine process after kill -9: `stratum serve` on a model, one
request, then --kills times: kill -9 of the idle engine process (the pid /health reports), the time
until /health is 200 again with a new pid, and until a request is answered. JSON on stdout.

    python scripts/engine_restart_time.py --model smollm2-135m --kills 5

Each kill is the first death within the restart window (1 s, kills 1.5 s apart), so every restart waits
the first backoff (0.5 s) and the figures are comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str, old_pid: int | None, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200 and r.json()["engine_pid"] != old_pid:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    raise TimeoutError(f"/health not 200 within {timeout}s")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kills", type=int, default=5)
    args = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "stratum.cli", "serve", "--model", args.model, "--port", str(port),
                               "--served-model-name", "m", "--engine-restarts", str(args.kills + 1),
                               "--engine-restart-window-s", "1", "--data-dir", ""],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi"}]}
    runs = []
    try:
        t0 = time.monotonic()
        health = _ready(url, None, 600)
        cold_s = time.monotonic() - t0
        httpx.post(url + "/v1/messages", json=body, timeout=120).raise_for_status()
        for _ in range(args.kills):
            pid = health["engine_pid"]
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            health = _ready(url, pid, 120)
            t1 = time.monotonic()
            httpx.post(url + "/v1/messages", json=body, timeout=120).raise_for_status()
            runs.append({"health_200_s": round(t1 - t0, 3), "first_answer_s": round(time.monotonic() - t0, 3),
                         "server_last_restart_s": health["last_restart_s"]})
            time.sleep(1.5)
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps({"model": args.model, "cold_start_to_health_200_s": round(cold_s, 3),
                      "load_average_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "runs": runs,
                      "median_health_200_s": statistics.median(r["health_200_s"] for r in runs),
                      "median_first_answer_s": statistics.median(r["first_answer_s"] for r in runs)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
