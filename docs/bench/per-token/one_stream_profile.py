"""One-stream per-token profile of `stratum serve`: client TPOT, engine ITL (metrics), CPU per token of
the server and engine processes; optional py-spy of the server process.
usage: [TEMPERATURE=1.0] python one_stream_profile.py TREE PORT N MAX_TOKENS [pyspy-out]
(TREE: a checkout of Stratum, served with PYTHONPATH=TREE; py-spy at /tmp/pyspy/bin/py-spy)"""
import json, os, re, subprocess, sys, time
import httpx, psutil

tree, port, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
spy = sys.argv[5] if len(sys.argv) > 5 else None
env = {**os.environ, "PYTHONPATH": tree}
url = f"http://127.0.0.1:{port}"
srv = subprocess.Popen(["/work/main/.venv/bin/stratum", "serve", "--model", "smollm2-135m", "--port", str(port)],
                       env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
try:
    while True:
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200 and "preparing" not in r.json():
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    ps = psutil.Process(srv.pid)
    eng = ps.children()[0]
    body = {"model": "smollm2-135m", "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": float(os.environ.get("TEMPERATURE", "1.0")),
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}
    client = httpx.Client(timeout=120)

    def one():
        t0 = time.perf_counter(); times = []
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    times.append(time.perf_counter())
        return t0, times

    def itl():
        m = client.get(url + "/metrics").text
        g = lambda k: float(re.search(rf"^{k} (\S+)$", m, re.M).group(1))
        return g("stratum_inter_token_latency_seconds_sum"), g("stratum_inter_token_latency_seconds_count")

    for _ in range(2):
        one()
    cpu = lambda p: sum(p.cpu_times()[:2])
    s0, e0, (i0s, i0c) = cpu(ps), cpu(eng), itl()
    spyp = None
    if spy:
        spyp = subprocess.Popen(["/tmp/pyspy/bin/py-spy", "record", "-p", str(srv.pid), "-r", "200", "-f", "raw", "-o", spy, "--nonblocking"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
    w0 = time.perf_counter()
    tpots, toks = [], 0
    for _ in range(n):
        t0, times = one()
        toks += len(times)
        tpots.append((times[-1] - times[0]) / (len(times) - 1))
    wall = time.perf_counter() - w0
    if spyp:
        spyp.send_signal(2); spyp.wait()
    s1, e1, (i1s, i1c) = cpu(ps), cpu(eng), itl()
    tpots.sort()
    print(json.dumps({"tree": tree, "temperature": body["temperature"], "march": os.environ.get("STRATUM_MARCH", "native"), "requests": n, "tokens": toks,
                      "client_tpot_ms_p50": round(tpots[len(tpots) // 2] * 1e3, 3), "client_tpot_ms_min": round(tpots[0] * 1e3, 3),
                      "engine_itl_ms_mean": round((i1s - i0s) / (i1c - i0c) * 1e3, 3),
                      "server_cpu_ms_per_token": round((s1 - s0) / toks * 1e3, 3),
                      "engine_cpu_ms_per_token": round((e1 - e0) / toks * 1e3, 3),
                      "out_tok_s": round(toks / wall, 1)}))
finally:
    srv.terminate(); srv.wait(timeout=30)
