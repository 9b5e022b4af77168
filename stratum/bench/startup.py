"""`stratum bench startup`: how long `stratum serve` takes to answer, cold and warm.

Launches the server as a user would and records, from the launch: the port accepting connections,
/health answering 200, the first streamed token of a request sent at that moment, and that request's
end; on a cold start also when the prepared kernels took over (/health's `step` turns native and
`preparing` goes away). Cold is a fresh $STRATUM_HOME holding only a link to the model file (nothing
converted, built or measured); warm is that same home after `stratum pull` prepared it. The user's
own $STRATUM_HOME is never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from stratum.home import stratum_home
from stratum.kernels.cpu import cpu_name

PROMPT = [{"role": "user", "content": "Name three primary colors."}]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratum.cli", *args]


def launch(home: Path, model: str, max_tokens: int, wait_native_s: float) -> dict:
    """One start of `stratum serve` on home: the times, in seconds from the launch."""
    port = _port()
    env = {**os.environ, "STRATUM_HOME": str(home)}
    env.pop("STRATUM_PLAN_DIR", None)  # the plan goes where a user's would: under this home
    t0 = time.perf_counter()
    proc = subprocess.Popen(_cli("serve", "--model", model, "--port", str(port), "--data-dir", ""), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: dict = {}
    url = f"http://127.0.0.1:{port}"
    try:
        while "port_open_s" not in out:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                out["port_open_s"] = round(time.perf_counter() - t0, 3)
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited: {proc.stdout.read()[-2000:]}")
                time.sleep(0.02)
        stages = []
        with httpx.Client(base_url=url, timeout=120) as http:
            while True:
                r = http.get("/health")
                body = r.json()
                if r.status_code == 200:
                    out["health_200_s"] = round(time.perf_counter() - t0, 3)
                    out["step_at_ready"] = body.get("step")
                    out["preparing_at_ready"] = body.get("preparing")
                    break
                if body.get("stage") not in stages:
                    stages.append(body.get("stage"))
                time.sleep(0.02)
            out["loading_stages"] = stages
            request = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=request) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if "first_token_s" not in out and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                        out["first_token_s"] = round(time.perf_counter() - t0, 3)
            out["first_request_done_s"] = round(time.perf_counter() - t0, 3)
            deadline = time.perf_counter() + wait_native_s
            while time.perf_counter() < deadline:
                body = http.get("/health").json()
                if not body.get("preparing"):
                    out["step_final"] = body.get("step")
                    if out["preparing_at_ready"]:
                        out["prepared_switch_s"] = round(time.perf_counter() - t0, 3)
                    break
                time.sleep(0.25)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def run(model: str, warm_runs: int, max_tokens: int, wait_native_s: float) -> dict:
    source = stratum_home() / "models" / model
    if not source.is_dir():
        raise SystemExit(f"{source} is missing: `stratum pull {model}` first")
    home = Path(tempfile.mkdtemp(prefix="stratum-startup-"))
    try:
        (home / "models").mkdir()
        (home / "models" / model).symlink_to(source.resolve())
        cold = launch(home, model, max_tokens, wait_native_s)
        t = time.perf_counter()
        subprocess.run(_cli("pull", model), env={**os.environ, "STRATUM_HOME": str(home)}, check=True,
                       stdout=subprocess.DEVNULL)
        pull_s = round(time.perf_counter() - t, 1)
        warm = [launch(home, model, max_tokens, wait_native_s) for _ in range(warm_runs)]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return {"model": model, "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                                        "march": os.environ.get("STRATUM_MARCH") or "native"},
            "max_tokens": max_tokens, "cold": cold, "pull_after_cold_s": pull_s, "warm": warm}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stratum bench startup", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--wait-native-s", type=float, default=300.0, help="how long to wait for a cold start's switch")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    text = json.dumps(run(args.model, args.warm_runs, args.max_tokens, args.wait_native_s), indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
