"""Texts per second of /v1/embeddings over HTTP on an encoder, beside sentence-transformers' own `encode`
in-process on the same texts and weights; prints one JSON document.

    python scripts/bench_embeddings.py [--model all-minilm-l6-v2] [--texts 256] [--batch 32] [--threads N]

The texts are seeded (~60 words each); the server is a real `stratum serve` subprocess, asked for one
batch at a time (`--concurrency` at a time), after one warm-up request; sentence-transformers runs after
it stops, with the same batch size and torch's threads set to the server engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

WORDS = ("the a cache request token model server block prefix memory batch scheduler query document vector "
         "retrieval answer question embedding latency throughput kernel thread engine process pool sequence "
         "attention layer weight tensor budget tenant cost stream decode prefill chunk search passage").split()


def texts_of(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "." for _ in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_rate(model: str, texts: list[str], batch: int, threads: int, concurrency: int) -> dict:
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "stratum.cli", "serve", "--model", model, "--port", str(port),
                             "--threads", str(threads), "--max-batched-tokens", "4096"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = httpx.Client(timeout=300)
        batches = [texts[i : i + batch] for i in range(0, len(texts), batch)]
        client.post(url + "/v1/embeddings", json={"model": model, "input": batches[0]}).raise_for_status()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            bodies = list(pool.map(lambda b: client.post(url + "/v1/embeddings", json={"model": model, "input": b}),
                                   batches))
        seconds = time.perf_counter() - t0
        for r in bodies:
            r.raise_for_status()
        tokens = sum(r.json()["usage"]["prompt_tokens"] for r in bodies)
        return {"texts_per_s": round(len(texts) / seconds, 1), "seconds": round(seconds, 3), "tokens": tokens,
                "cost_header": bodies[0].headers.get("x-stratum-cost")}
    finally:
        proc.terminate()
        proc.wait(15)


def st_rate(folder: str, texts: list[str], batch: int, threads: int) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(folder, device="cpu")
    model.encode(texts[:batch], batch_size=batch)
    t0 = time.perf_counter()
    model.encode(texts, batch_size=batch)
    seconds = time.perf_counter() - t0
    return {"texts_per_s": round(len(texts) / seconds, 1), "seconds": round(seconds, 3)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="all-minilm-l6-v2", help="a registered name (pulled) or a folder")
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from stratum.models.registry import REGISTRY, model_path

    folder = str(model_path(args.model)) if args.model in REGISTRY else args.model
    texts = texts_of(args.texts, args.words, args.seed)
    result = {"model": args.model, "texts": args.texts, "words": args.words, "batch": args.batch,
              "concurrency": args.concurrency, "threads": args.threads, "cpu_count": os.cpu_count(),
              "stratum_http": serve_rate(args.model, texts, args.batch, args.threads, args.concurrency),
              "sentence_transformers": st_rate(folder, texts, args.batch, args.threads)}
    result["ratio"] = round(result["stratum_http"]["texts_per_s"] / result["sentence_transformers"]["texts_per_s"], 3)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
