"""Prefix-cache hit ratio of N replicas against one, at equal total KV memory, in one run.

The workload: G groups of requests, each group sharing a long system prompt of its own, the requests
of all groups interleaved at random and sent C at a time. What each configuration keeps of the
single engine's cache is the figure: the hit ratio, Σ cache_read_input_tokens ÷ Σ prompt tokens
(from each response's `usage`), and which replica served each request (`x-stratum-replica`).

`stratum bench cluster --url URL` runs the workload against one server (any server that speaks the
Anthropic API). Without --url it starts each configuration itself, one after another, on this
machine: `stratum serve --kv-cache-mb M` (one engine), then for each N in --replicas,
`--replicas N --kv-cache-mb M/N` routed by prefix and by round robin, and reports every hit ratio
as a fraction of the single engine's. Prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter

import httpx

from stratum.bench.workloads import make_question, make_text


def make_requests(groups: int, per_group: int, prefix_tokens: int, question_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    systems = [f"You are assistant {g}. " + make_text(rng, prefix_tokens) for g in range(groups)]
    requests = [{"group": g, "system": systems[g], "question": make_question(rng, question_tokens)}
                for g in range(groups) for _ in range(per_group)]
    rng.shuffle(requests)
    return requests


async def run_workload(url: str, model: str, requests: list[dict], concurrency: int, max_tokens: int,
                       api_key: str = "bench") -> dict:
    """Send the requests, `concurrency` at a time; returns the hit ratio and where each request went."""
    headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
    results: list[dict] = []
    errors: list[str] = []
    todo = iter(requests)

    async def worker(client: httpx.AsyncClient) -> None:
        for req in todo:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "system": req["system"],
                    "messages": [{"role": "user", "content": req["question"]}]}
            t0 = time.perf_counter()
            r = await client.post("/v1/messages", json=body)
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:200]}")
                continue
            usage = r.json()["usage"]
            results.append({"group": req["group"], "replica": r.headers.get("x-stratum-replica"),
                            "latency_s": time.perf_counter() - t0, **usage})

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, trust_env=False) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    prompt = sum(r["input_tokens"] + r["cache_read_input_tokens"] + r["cache_creation_input_tokens"] for r in results)
    cached = sum(r["cache_read_input_tokens"] for r in results)
    by_replica = Counter(r["replica"] for r in results if r["replica"])
    groups_per_replica = {name: len({r["group"] for r in results if r["replica"] == name}) for name in by_replica}
    return {
        "requests": len(results), "errors": len(errors), "first_errors": errors[:3],
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "requests_per_replica": dict(sorted(by_replica.items())),
        "groups_per_replica": dict(sorted(groups_per_replica.items())),
        "wall_s": round(wall, 2),
        "latency_p50_ms": round(1e3 * statistics.median(r["latency_s"] for r in results), 1) if results else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stratum bench cluster", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="run the workload against this server only")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--replicas", default="2,3", help="replica counts to compare with one engine (without --url)")
    p.add_argument("--kv-cache-mb", type=int, default=160, help="total KV memory of each configuration")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=400)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more `stratum serve` arguments for every configuration")
    args = p.parse_args(argv)
    requests = make_requests(args.groups, args.per_group, args.prefix_tokens, args.question_tokens, args.seed)
    workload = {k: getattr(args, k) for k in ("groups", "per_group", "prefix_tokens", "question_tokens",
                                               "max_tokens", "concurrency", "seed")}

    def run(url: str) -> dict:
        return asyncio.run(run_workload(url, args.model, requests, args.concurrency, args.max_tokens))

    if args.url:
        print(json.dumps({"workload": workload, "url": args.url, "result": run(args.url)}, indent=2))
        return 0

    from stratum.bench.soak import spawn_server

    base = f"--model {args.model} --data-dir '' {args.serve_args}"
    configs = [("single", 1, "prefix")]
    for n in (int(x) for x in args.replicas.split(",") if x):
        configs += [(f"{n}x prefix", n, "prefix"), (f"{n}x round-robin", n, "round-robin")]
    report: dict = {"workload": workload, "kv_cache_mb_total": args.kv_cache_mb, "configs": {}}
    for name, n, routing in configs:
        serve = f"{base} --kv-cache-mb {args.kv_cache_mb // n}"
        if n > 1:
            serve += f" --replicas {n} --routing {routing}"
        print(f"bench cluster: {name}: stratum serve {serve}", file=sys.stderr, flush=True)
        with spawn_server(serve, timeout_s=600) as (url, _, _):
            warm = [{"group": -1, "system": f"Warm-up {i}.", "question": "Hello?"} for i in range(2 * n)]
            asyncio.run(run_workload(url, args.model, warm, n, 2))  # a short prompt per replica: code paths warm
            result = run(url)
        result.update(replicas=n, routing=routing if n > 1 else None, kv_cache_mb_each=args.kv_cache_mb // n)
        report["configs"][name] = result
        print(f"bench cluster: {name}: hit ratio {result['hit_ratio']}", file=sys.stderr, flush=True)
    single = report["configs"]["single"]["hit_ratio"]
    report["vs_single"] = {name: round(c["hit_ratio"] / single, 3) if single else None
                           for name, c in report["configs"].items() if name != "single"}
    print(json.dumps(report, indent=2))
    return 0
