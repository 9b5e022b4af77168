"""What an operator expects of a server they restart: the same answers and the same plan on a busy
machine, /health 200 only once a request would run, and a new file's first start costing at most
1.5x its blocks in memory (no dense copy of the weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from stratum.bench.startup import PeakMemory, busy
from tests.conftest import ServerProcess, home_with_kernels
from tests.factories import make_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compiled():
    from stratum.kernels import native

    if not native.available():
        pytest.skip(f"native kernels: {native.status()}")


def serve(model: Path, home: Path) -> ServerProcess:
    # the plan where a user's goes (under home) and threads as it says: nothing pinned by the suite
    env = {"STRATUM_HOME": str(home), "STRATUM_PLAN_DIR": "", "STRATUM_NUM_THREADS": ""}
    return ServerProcess(str(model), "--served-model-name", "tiny", "--kv-cache-mb", "8", env=env)


def info(model: Path, home: Path) -> dict:
    env = {**os.environ, "STRATUM_HOME": str(home), "STRATUM_PLAN_DIR": "", "STRATUM_NUM_THREADS": ""}
    out = subprocess.run([sys.executable, "-m", "stratum.cli", "info", str(model)], env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    doc = json.loads(out)
    return {"numerics": doc["numerics"], "kernel_plan": doc["kernel_plan"]}


def test_five_restarts_on_busy_cores_give_the_same_answers_and_the_same_plan(tmp_path, compiled):
    """Both cores kept busy by other processes: the first start measures the plan (and, disturbed,
    takes the CPU family's defaults), the others read it; every start answers with the same tokens
    and the same log-probabilities, bit for bit, and `stratum info` says the same rule and plan."""
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    home = home_with_kernels(tmp_path / "home")
    from stratum.telemetry.trace import decode_trace

    answers, kernels, reports = [], [], []
    request = {"model": "tiny", "prompt": "The capital of Japan is", "max_tokens": 16, "temperature": 0,
               "logprobs": 1}
    with busy(2):
        for start in range(5):
            server = serve(model, home)
            try:
                server.wait_ready(timeout=300)
                r = httpx.post(server.url + "/v1/completions", json=request, headers={"x-stratum-debug": "full"},
                               timeout=300)
                choice = r.json()["choices"][0]
                answers.append((choice["text"], choice["logprobs"]["token_logprobs"]))
                used = decode_trace(r.headers["x-stratum-trace"])["hardware"]["kernels"]
                kernels.append({k: used[k] for k in ("numerics", "step", "dtype", "kv_dtype", "threads", "step_simd")})
            finally:
                server.stop()
            if start in (0, 4):  # what `stratum info` says after the first start and after the last
                reports.append(info(model, home))
    assert all(a == answers[0] for a in answers), answers
    assert all(k == kernels[0] for k in kernels), kernels
    assert reports[0] == reports[1], reports
    assert reports[0]["numerics"]["result"]["key"] == kernels[0]["numerics"]
    assert reports[0]["numerics"]["result"]["step"] == "native" and reports[0]["kernel_plan"]["source"] == "cache"


def test_health_is_200_only_once_a_request_would_run(tmp_path, compiled):
    """/health polled as fast as it answers through a new file's first start (its blocks repacked,
    its plan measured): every answer before the first 200 is 503 with a stage, every 200 names the
    step and a KV pool, and a request sent at the first 200 runs at once."""
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    server = serve(model, home_with_kernels(tmp_path / "home"))
    seen: list[tuple[int, dict]] = []
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            deadline = time.monotonic() + 300
            while not seen or seen[-1][0] != 200:
                assert time.monotonic() < deadline and server.proc.poll() is None, server.output()
                try:
                    r = http.get("/health")
                except httpx.TransportError:  # the port is not open yet
                    continue
                seen.append((r.status_code, r.json()))
            reply = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
            assert reply.status_code == 200, reply.text
            for _ in range(20):
                r = http.get("/health")
                seen.append((r.status_code, r.json()))
    finally:
        server.stop()
    first = next(i for i, (status, _) in enumerate(seen) if status == 200)
    assert first > 0 and all(status == 503 and body["stage"] for status, body in seen[:first])
    assert all(status == 200 and body["kv_blocks"]["total"] > 0 and body["step"] in ("native", "pytorch")
               for status, body in seen[first:]), seen[first:]


def _peaks(model: Path, home: Path) -> dict:
    """Peak memory of a start of `model` on home (server, engine and any child), after one request."""
    server = serve(model, home)
    memory = PeakMemory(server.proc.pid)
    try:
        server.wait_ready(timeout=600)
        reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4},
                           timeout=300)
        assert reply.status_code == 200, reply.text
    finally:
        peaks = memory.stop()
        server.stop()
    return peaks


def test_a_first_start_of_a_larger_file_grows_by_its_blocks_not_a_dense_copy(tmp_path, compiled):
    """Two Qwen2.5-1.5B-shaped Q4_K_M files, 1 and 3 layers, each at its first start (its blocks
    repacked, its plan measured) and serving a request: the server and engine processes' peaks
    (VmHWM) together differ by at most 1.5x the files' difference in size. The runtime's own memory
    (Python, torch, the tokenizer) is the same in both, so this is what each byte of weights costs
    at a cold start: a dense fp32 copy of Q4_K blocks would cost 7x."""
    files = {layers: tmp_path / f"q4km-{layers}.gguf" for layers in (1, 3)}
    writers = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "synthetic_gguf.py"), str(path),
                                 "--shape", "qwen2.5-1.5b", "--layers", str(layers)], stdout=subprocess.DEVNULL)
               for layers, path in files.items()]  # side by side: each is one core's numpy
    assert all(w.wait(timeout=900) == 0 for w in writers)
    peaks = {layers: _peaks(path, home_with_kernels(tmp_path / f"home-{layers}")) for layers, path in files.items()}
    size_mb = (files[3].stat().st_size - files[1].stat().st_size) / 2**20
    growth = peaks[3]["sum_mb"] - peaks[1]["sum_mb"]
    assert growth <= 1.5 * size_mb, (peaks, size_mb)
