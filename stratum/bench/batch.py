"""Interactive latency while a Message Batch runs, against none, in one run on one server.

Phase 1 sends `--probes` interactive streaming requests one after another and records each one's
time to first token. Phase 2 creates a batch of `--batch-size` requests, then sends the same probes
while it runs. It reports TTFT percentiles of both phases, their ratio, and how far the batch got
(results per second while the probes ran, and until it ended). Run as
`stratum bench batch --url URL`; prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx


def _ttft(client: httpx.Client, model: str, i: int, max_tokens: int) -> float:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": f"Probe {i}: name three cities in Japan."}]}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/messages", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to the end: the probe's decode is part of the load
            if first is None and line.startswith("data:") and '"text_delta"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the probe produced no text")
    return first


def _summary(values: list[float]) -> dict:
    ms = sorted(1e3 * v for v in values)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 1), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1),
            "mean_ms": round(statistics.fmean(ms), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stratum bench batch", description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key", default="bench")
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--probe-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--batch-tokens", type=int, default=32)
    args = p.parse_args(argv)
    headers = {"x-api-key": args.api_key, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        _ttft(client, args.model, -1, args.probe_tokens)  # warm
        alone = [_ttft(client, args.model, i, args.probe_tokens) for i in range(args.probes)]
        requests = [{"custom_id": f"b{i}", "params": {
            "model": args.model, "max_tokens": args.batch_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Item {i}: write one sentence about the sea."}]}}
            for i in range(args.batch_size)]
        t0 = time.perf_counter()
        batch = client.post("/v1/messages/batches", json={"requests": requests}).json()
        during = [_ttft(client, args.model, i, args.probe_tokens) for i in range(args.probes)]
        probes_s = time.perf_counter() - t0
        done_during = client.get(f"/v1/messages/batches/{batch['id']}").json()["request_counts"]
        while (state := client.get(f"/v1/messages/batches/{batch['id']}").json())["processing_status"] != "ended":
            time.sleep(0.5)
        batch_s = time.perf_counter() - t0
    finished = sum(state["request_counts"][k] for k in ("succeeded", "errored"))
    result = {
        "benchmark": "batch", "url": args.url, "model": args.model, "probes": args.probes,
        "probe_tokens": args.probe_tokens, "batch_size": args.batch_size, "batch_tokens": args.batch_tokens,
        "ttft_without_batch": _summary(alone), "ttft_with_batch": _summary(during),
        "ttft_p50_ratio": round(statistics.median(during) / statistics.median(alone), 3),
        "batch_done_while_probing": done_during["succeeded"] + done_during["errored"],
        "batch_results_per_s_while_probing": round((done_during["succeeded"] + done_during["errored"]) / probes_s, 2),
        "batch_seconds": round(batch_s, 1), "batch_results_per_s": round(finished / batch_s, 2),
        "batch_counts": state["request_counts"],
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
