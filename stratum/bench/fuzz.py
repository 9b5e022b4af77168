"""`stratum bench fuzz`: many hostile requests, to show that none gets a 5xx or hangs.

Each request is a valid body of one of the JSON routes (Messages, count_tokens, chat and legacy
completions, Responses and its token count, Message Batches), streamed or not, with seeded mutations:
a field set to a hostile value (numbers past 64 bits, infinities, lone surrogates, wrong types, huge
lists), a field dropped, a body cut short, or invalid UTF-8 spliced into its bytes. The goal is 0 answers
of 5xx and 0 hangs (requests with no complete answer within --timeout-s); /health before and after says
whether the engine stayed alive and held no KV block once idle.
Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from stratum.bench.serve import emit
from stratum.bench.soak import spawn_server
from stratum.bench.wire import BenchError, base_url, check_url

TURN = [{"role": "user", "content": "Say something short."}]
BODIES: dict[str, dict[str, Any]] = {  # a valid body per route, the base each mutation starts from
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": TURN},
    "/v1/messages/count_tokens": {"model": "m", "messages": TURN},
    "/v1/chat/completions": {"model": "m", "max_tokens": 8, "messages": TURN},
    "/v1/completions": {"model": "m", "max_tokens": 8, "prompt": "Once upon a time"},
    "/v1/responses": {"model": "m", "max_output_tokens": 8, "input": "Say something short."},
    "/v1/responses/input_tokens": {"model": "m", "input": "Say something short."},
    "/v1/messages/batches": {"requests": [{"custom_id": "a", "params": {"model": "m", "max_tokens": 4,
                                                                         "messages": TURN}}]},
}
STREAMED = ("/v1/messages", "/v1/chat/completions", "/v1/completions", "/v1/responses")
FIELDS = ("max_tokens", "max_output_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n",
          "stop", "stop_sequences", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "logit_bias", "tools", "tool_choice", "system", "metadata", "thinking", "response_format", "messages",
          "input", "prompt", "stream_options", "echo", "best_of", "user", "model")
HOSTILE: tuple[Any, ...] = (2**64, 2**63, -(2**63) - 1, 2**31, -1, 0, 1e308, -1e308, 0.5, "x", "\ud800", "", None, True,
                            [], {}, [None], ["a"] * 100, list(range(1000)), {"5": 1e9}, {"type": "enabled"},
                            {"type": "enabled", "budget_tokens": 2**64}, [{"role": "user", "content": "\udfff"}],
                            [{"role": "user", "content": [{"type": "image"}]}], "a" * 10_000)
BAD_BYTES = (b"\xed\xa0\x80", b"\xff", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\x00")
NUM_FAILURE_SAMPLES = 10


def mutate(rng: random.Random, path: str, model: str) -> tuple[bytes, bool]:
    """A body for `path` (its bytes) and whether it asks to stream."""
    body = json.loads(json.dumps(BODIES[path]).replace('"m"', json.dumps(model)))
    target = body["requests"][0]["params"] if path.endswith("/batches") and rng.random() < 0.7 else body
    is_stream = path in STREAMED and rng.random() < 0.5
    if is_stream:
        body["stream"] = True
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.6:
            target[rng.choice(FIELDS)] = rng.choice(HOSTILE)
        elif kind < 0.75 and target:
            target.pop(rng.choice(list(target)), None)
        else:
            target[rng.choice(FIELDS)] = rng.randint(-(2**70), 2**70)
    data = json.dumps(body).encode()  # lone surrogates as escapes, as a JSON client writes them
    roll = rng.random()
    if roll < 0.1:
        at = rng.randrange(len(data))
        data = data[:at] + rng.choice(BAD_BYTES) + data[at:]
    elif roll < 0.15:
        data = data[: rng.randrange(len(data))]
    return data, is_stream


async def one(client: httpx.AsyncClient, path: str, data: bytes, is_stream: bool, timeout_s: float) -> str:
    """The request's outcome: its status, "hang" (no complete answer within timeout_s) or "connection"."""
    headers = {"content-type": "application/json"}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", path, content=data, headers=headers) as r:
                async for _ in r.aiter_bytes():  # a stream read to its end
                    pass
                return str(r.status_code)
    except TimeoutError:
        return "hang"
    except httpx.HTTPError:
        return "connection"


async def health(client: httpx.AsyncClient) -> dict[str, Any]:
    try:
        r = await client.get("/health", timeout=10)
        return r.json()
    except (httpx.HTTPError, ValueError) as e:
        return {"status": f"unreachable: {type(e).__name__}"}


async def idle_health(client: httpx.AsyncClient, wait_s: float = 30.0) -> dict[str, Any]:
    """/health once nothing runs (or after wait_s): the KV blocks still in use must be 0."""
    deadline = time.monotonic() + wait_s
    while True:
        h = await health(client)
        blocks = h.get("kv_blocks", {}).get("in_use", 0)
        if (not blocks and not h.get("running")) or time.monotonic() > deadline:
            return h
        await asyncio.sleep(0.5)


async def fuzz(args, url: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        before = await health(client)
        model = before.get("model", "default")
        jobs = [(path, *mutate(rng, path, model)) for path in rng.choices(list(BODIES), k=args.requests)]
        outcomes: Counter[str] = Counter()
        by_route: dict[str, Counter[str]] = {}
        failures: list[dict[str, Any]] = []
        queue: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        t0 = time.perf_counter()

        async def worker() -> None:
            while not queue.empty():
                path, data, is_stream = queue.get_nowait()
                outcome = await one(client, path, data, is_stream, args.timeout_s)
                outcomes[outcome] += 1
                by_route.setdefault(path, Counter())[outcome] += 1
                is_failure = outcome.startswith("5") or outcome in ("hang", "connection")
                if is_failure and len(failures) < NUM_FAILURE_SAMPLES:
                    failures.append({"path": path, "outcome": outcome, "stream": is_stream,
                                     "body": data[:300].decode("utf-8", "replace")})
                done = sum(outcomes.values())
                if not args.no_progress and done % 500 == 0:
                    print(f"{done}/{args.requests} requests, {sum(v for k, v in outcomes.items() if k[0] == '5')} 5xx",
                          file=sys.stderr)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
        after = await idle_health(client)
    num_5xx = sum(v for k, v in outcomes.items() if k.startswith("5"))
    return {
        "benchmark": "fuzz", "url": url, "requests": args.requests, "seed": args.seed,
        "concurrency": args.concurrency, "timeout_s": args.timeout_s, "elapsed_s": round(elapsed, 1),
        "num_5xx": num_5xx, "num_hangs": outcomes["hang"], "num_connection_errors": outcomes["connection"],
        "outcomes": dict(sorted(outcomes.items())),
        "by_route": {path: dict(sorted(c.items())) for path, c in sorted(by_route.items())},
        "failure_samples": failures,
        "health_before": {k: before.get(k) for k in ("status", "mode", "kv_blocks")},
        "health_after": {k: after.get(k) for k in ("status", "mode", "running", "waiting", "kv_blocks")},
        "is_ok": num_5xx == 0 and not outcomes["hang"] and not outcomes["connection"]
                 and after.get("status") == "ok" and after.get("kv_blocks", {}).get("in_use") == 0,
    }


def main(argv: list[str] | None = None) -> int:
    """`stratum bench fuzz`: run the requests and print the JSON. Returns 0 when nothing failed, 1 when
    something did, 2 on bad input."""
    p = argparse.ArgumentParser(prog="stratum bench fuzz", description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8080", help="a running server (default: %(default)s)")
    where.add_argument("--serve", default=None, metavar="ARGS", help='start `stratum serve ARGS` ("--model m ...")')
    p.add_argument("--allow-remote", action="store_true", help="allow a URL that is not a loopback address")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=60.0, help="a request with no complete answer by then hangs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="with --serve")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.timeout_s <= 0:
        p.error("--requests, --concurrency and --timeout-s must be positive")
    try:
        if args.serve is not None:
            with spawn_server(args.serve, args.startup_timeout_s) as (url, proc, log):
                doc = asyncio.run(fuzz(args, url))
            doc["server"] = {"log": str(log), "exit_code": proc.returncode}
        else:
            check_url(args.url, args.allow_remote)
            doc = asyncio.run(fuzz(args, base_url(args.url)))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit(doc, args.out)
    return 0 if doc["is_ok"] else 1
