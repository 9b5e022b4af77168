"""`stratum bench serve`: a load generator for any Anthropic- or OpenAI-compatible streaming server.

Streams seeded workloads (stratum.bench.workloads) under closed-loop concurrency or open-loop Poisson arrivals
and measures per request TTFT, inter-token gaps, TPOT, end-to-end latency and the token usage the server reports.
Prints one JSON document on stdout; progress goes to stderr. Each request is `bench.wire`'s
`send_request`; `--plot` draws with `bench.charts`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from stratum.bench.charts import plot_throughput, plot_ttft_cdf
from stratum.bench.wire import (
    API_PATHS, BenchError, RequestResult, Target, base_url, check_url, discover_model, send_request,
)
from stratum.bench.workloads import WORKLOADS, Conversation, Workload, WorkloadConfig, make_workload

PERCENTILES = (50, 90, 99)
NUM_ERROR_SAMPLES = 5
WARMUP_SEED = 1_000_003  # offset of the warm-up prompts' seed from --seed


# ---- what is measured ----------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default).

    Raises:
        ValueError: values is empty.
    """
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90 and p99 in milliseconds (None for no values)."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [1000 * v for v in values_s]
    return {"mean": round(sum(ms) / len(ms), 3), **{f"p{q}": round(percentile(ms, q), 3) for q in PERCENTILES}}


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A completed request within both SLOs; a one-token reply has no TPOT and passes that one."""
    if not r.is_ok or r.ttft_s is None:
        return False
    if slo_ttft_ms is not None and 1000 * r.ttft_s > slo_ttft_ms:
        return False
    tpot = r.tpot_s
    return slo_tpot_ms is None or tpot is None or 1000 * tpot <= slo_tpot_ms


def summarize(results: Sequence[RequestResult], duration_s: float, num_requests: int,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              num_cancelled: int = 0) -> dict[str, Any]:
    """The JSON figures of one level.

    Args:
        results: every request that finished, ok or failed (cancelled ones are counted by num_cancelled).
        duration_s: wall time of the level; throughputs divide by it.
        num_requests: requests the workload planned; those neither finished nor cancelled are `not_issued`.
    Returns:
        Counts, throughputs, latency stats in ms, token totals, goodput (null without an SLO) and, when
        any request has kind "long", the TTFT of the short ones separately.
    """
    ok = [r for r in results if r.is_ok]
    failed = [r for r in results if not r.is_ok]
    samples: list[str] = []
    for r in failed:
        if r.error not in samples and len(samples) < NUM_ERROR_SAMPLES:
            samples.append(r.error or "unknown error")
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    num_cached = sum(r.num_cached_tokens for r in ok)
    ttft = latency_stats([r.ttft_s for r in ok if r.ttft_s is not None])
    out: dict[str, Any] = {
        "num_requests": num_requests,
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": num_cancelled,
        "not_issued": num_requests - len(results) - num_cancelled,
        "error_samples": samples,
        "duration_s": round(duration_s, 3),
        "output_tokens": num_output,
        "output_tok_s": round(num_output / duration_s, 3) if duration_s > 0 else None,
        "request_throughput": round(len(ok) / duration_s, 4) if duration_s > 0 else None,
        "ttft_ms": ttft,
        "tpot_ms": latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": latency_stats([g for r in ok for g in r.itl_s]),
        "e2e_ms": latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "ttft_jitter": round(ttft["p99"] / ttft["p50"], 3) if ttft["p50"] else None,
        "prompt_tokens": num_prompt,
        "cached_prompt_tokens": num_cached,
        "cached_ratio": round(num_cached / num_prompt, 4) if num_prompt else None,
        "requests_without_usage": sum(not r.has_usage for r in ok),
        "goodput": None,
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok)
        out["goodput"] = {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "requests": good,
                          "req_s": round(good / duration_s, 4) if duration_s > 0 else None}
    if any(r.kind == "long" for r in results):
        out["short_ttft_ms"] = latency_stats([r.ttft_s for r in ok if r.kind == "short" and r.ttft_s is not None])
        out["long_ttft_ms"] = latency_stats([r.ttft_s for r in ok if r.kind == "long" and r.ttft_s is not None])
    return out


# ---- load ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Closed loop (concurrency conversations in flight) or open loop (Poisson rate, optional cap)."""

    concurrency: int | None = 8
    rate: float | None = None  # requests (conversations) per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 is Poisson
    max_concurrency: int | None = None
    duration_s: float | None = None  # stop issuing and cancel outstanding requests at this cap
    timeout_s: float = 300.0  # per request

    @property
    def limit(self) -> int | None:
        return self.concurrency if self.rate is None else self.max_concurrency


def arrival_times(n: int, rate: float | None, burstiness: float, seed: int) -> list[float]:
    """Start offsets (s) of n arrivals: all 0 in closed loop or at rate inf; else the first at 0 and gaps
    drawn from gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate, as in `vllm bench serve`."""
    if rate is None or math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, theta)
        times.append(t)
    return times


class LevelRun(NamedTuple):
    summary: dict[str, Any]
    results: list[RequestResult]


async def run_load(target: Target, workload: Workload, load: LoadConfig, progress: bool = True,
                   desc: str = "") -> tuple[list[RequestResult], int, float]:
    """Run every conversation of the workload under the load.

    A conversation holds one slot of load.limit from its first turn to its last, so at most `limit`
    requests are in flight. A failed turn ends its conversation (the later turns are not issued).
    Returns:
        (finished requests, number cancelled at the duration cap, wall seconds).
    """
    from tqdm import tqdm

    convs = workload.conversations
    arrivals = arrival_times(len(convs), load.rate, load.burstiness, workload.config.seed)
    sem = asyncio.Semaphore(load.limit) if load.limit else None
    results: list[RequestResult] = []
    cancelled: list[RequestResult] = []
    bar = tqdm(total=workload.num_requests, desc=desc, file=sys.stderr, disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(load.timeout_s)

    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        t_start = time.perf_counter()

        async def conversation(i: int, conv: Conversation) -> None:
            delay = arrivals[i] - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem or contextlib.nullcontext():
                messages: list[dict[str, str]] = []
                for turn, text in enumerate(conv.user_turns):
                    messages.append({"role": "user", "content": text})
                    r = RequestResult(i, turn, conv.kind, start_s=time.perf_counter() - t_start)
                    try:
                        async with asyncio.timeout(load.timeout_s):
                            prefill = [{"role": "assistant", "content": conv.prefill}] if conv.prefill else []
                            await send_request(client, target, conv.system, messages + prefill, r)
                    except TimeoutError:
                        r.error = f"timeout after {load.timeout_s:g} s"
                    except asyncio.CancelledError:
                        r.error = "cancelled at the duration cap"
                        cancelled.append(r)
                        raise
                    results.append(r)
                    bar.update(1)
                    if not r.is_ok:
                        break
                    messages.append({"role": "assistant", "content": r.text})

        tasks = [asyncio.create_task(conversation(i, c)) for i, c in enumerate(convs)]
        _, pending = await asyncio.wait(tasks, timeout=load.duration_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in tasks:  # surface bugs in the runner itself rather than losing them
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        wall_s = time.perf_counter() - t_start
    bar.close()
    return results, len(cancelled), wall_s


def run_level(target: Target, workload: Workload, load: LoadConfig, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, progress: bool = True, desc: str = "") -> LevelRun:
    """One workload at one load level; the summary as in `summarize`."""
    results, num_cancelled, wall_s = asyncio.run(run_load(target, workload, load, progress, desc))
    if load.duration_s is not None:
        wall_s = min(wall_s, load.duration_s)
    summary = summarize(results, wall_s, workload.num_requests, slo_ttft_ms, slo_tpot_ms, num_cancelled)
    return LevelRun(summary, results)


# ---- one benchmark: a level or a sweep -----------------------------------------------------------
def parse_sweep(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep takes comma-separated integers, not {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("--sweep levels must be positive integers")
    return levels


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Everything `serve` and `compare` share (all but --url)."""
    p.add_argument("--api", default="anthropic", choices=sorted(API_PATHS), help="default: anthropic (/v1/messages)")
    p.add_argument("--model", default=None, help="model id to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--allow-remote", action="store_true", help="allow a URL that is not a loopback address")
    p.add_argument("--workload", default="shared-prefix", choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-tokens", type=int, default=600, help="shared-prefix: system prompt size (~tokens)")
    p.add_argument("--question-tokens", type=int, default=24, help="short question size (~tokens)")
    p.add_argument("--long-tokens", type=int, default=1500, help="mixed-long: document size (~tokens)")
    p.add_argument("--long-every", type=int, default=8, help="mixed-long: one long request per this many")
    p.add_argument("--num-turns", type=int, default=4, help="multiturn: turns per conversation")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight (default 8)")
    load.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals/s (inf: all at once)")
    load.add_argument("--sweep", type=parse_sweep, default=None, help="closed loop at each concurrency: 1,8,16,32")
    p.add_argument("--burstiness", type=float, default=1.0, help="open loop: gamma shape of gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    p.add_argument("--num-warmups", type=int, default=1,
                   help="unrecorded unique-prompt requests per target before the first level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every reply runs to max-tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--duration-s", type=float, default=None, help="cap per level: stop issuing, cancel the rest")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write PNG charts into this folder")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = {"--num-requests": args.num_requests, "--num-turns": args.num_turns, "--long-every": args.long_every,
                "--max-tokens": args.max_tokens, "--timeout-s": args.timeout_s, "--burstiness": args.burstiness}
    positive |= {k: v for k, v in {"--concurrency": args.concurrency, "--rate": args.rate,
                                   "--max-concurrency": args.max_concurrency, "--duration-s": args.duration_s}.items()
                 if v is not None}
    for flag, value in positive.items():
        if value <= 0:
            p.error(f"{flag} must be positive")
    if args.num_warmups < 0:
        p.error("--num-warmups must be 0 or more")
    if args.max_concurrency is not None and args.rate is None:
        p.error("--max-concurrency applies to --rate (open loop); closed loop uses --concurrency")


def workload_config(args: argparse.Namespace, seed: int) -> WorkloadConfig:
    return WorkloadConfig(num_requests=args.num_requests, seed=seed, prefix_tokens=args.prefix_tokens,
                          question_tokens=args.question_tokens, long_tokens=args.long_tokens,
                          long_every=args.long_every, num_turns=args.num_turns)


def load_levels(args: argparse.Namespace) -> list[LoadConfig]:
    common = {"duration_s": args.duration_s, "timeout_s": args.timeout_s}
    if args.sweep:
        return [LoadConfig(concurrency=c, **common) for c in args.sweep]
    if args.rate is not None:
        return [LoadConfig(concurrency=None, rate=args.rate, burstiness=args.burstiness,
                           max_concurrency=args.max_concurrency, **common)]
    return [LoadConfig(concurrency=args.concurrency or 8, **common)]


def level_label(load: LoadConfig) -> str:
    if load.rate is None:
        return f"c={load.concurrency}"
    return f"rate={load.rate:g}" + (f" max_c={load.max_concurrency}" if load.max_concurrency else "")


def make_target(url: str, args: argparse.Namespace) -> Target:
    """Raises BenchError for a refused URL or an undiscoverable model."""
    check_url(url, args.allow_remote)
    url = base_url(url)
    model = args.model or discover_model(url, args.api_key)
    return Target(url=url, api=args.api, model=model, max_tokens=args.max_tokens, temperature=args.temperature,
                  is_ignore_eos=args.ignore_eos, api_key=args.api_key)


def run_target(target: Target, args: argparse.Namespace, label: str = "") -> list[tuple[LoadConfig, LevelRun]]:
    """Every load level against one target, in order. Sweep level i uses seed + i, so a level never
    finds the previous level's prompts in the server's prefix cache; every target gets the same seeds."""
    if args.num_warmups:
        # Distinct prompts on another seed: they warm the server and the connection, not the prefix cache.
        warm = make_workload("unique", WorkloadConfig(num_requests=args.num_warmups, seed=args.seed + WARMUP_SEED,
                                                      question_tokens=args.question_tokens))
        s = run_level(target, warm, LoadConfig(concurrency=1, timeout_s=args.timeout_s), progress=False).summary
        print(f"{label or target.url} warm-up: {s['completed']}/{s['num_requests']} ok"
              + (f"; {s['error_samples'][0]}" if s["error_samples"] else ""), file=sys.stderr, flush=True)
    runs = []
    for i, load in enumerate(load_levels(args)):
        workload = make_workload(args.workload, workload_config(args, args.seed + (i if args.sweep else 0)))
        desc = " ".join(x for x in (label, args.workload, level_label(load)) if x)
        run = run_level(target, workload, load, args.slo_ttft_ms, args.slo_tpot_ms, not args.no_progress, desc)
        s = run.summary
        print(f"{desc}: {s['completed']}/{s['num_requests']} ok, {s['output_tok_s']} tok/s, "
              f"TTFT p50 {s['ttft_ms']['p50']} ms", file=sys.stderr, flush=True)
        runs.append((load, run))
    return runs


def level_doc(load: LoadConfig, run: LevelRun, seed: int) -> dict[str, Any]:
    return {"concurrency": load.concurrency, "rate": load.rate, "burstiness": load.burstiness if load.rate else None,
            "max_concurrency": load.max_concurrency, "seed": seed, **run.summary}


def config_doc(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """The run's settings, resolved (the default concurrency filled in, the model discovered)."""
    is_closed_single = args.rate is None and not args.sweep
    return {
        "url": target.url, "api": target.api, "model": target.model, "workload": args.workload,
        "workload_config": {k: v for k, v in asdict(workload_config(args, args.seed)).items() if k != "num_requests"},
        "num_requests": args.num_requests, "num_warmups": args.num_warmups, "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos, "temperature": args.temperature,
        "concurrency": load_levels(args)[0].concurrency if is_closed_single else None, "rate": args.rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "sweep": args.sweep,
        "duration_s": args.duration_s, "timeout_s": args.timeout_s,
        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
    }


def result_doc(args: argparse.Namespace, target: Target, runs: list[tuple[LoadConfig, LevelRun]]) -> dict[str, Any]:
    """One level: its figures at the top level. A sweep: a `sweep` list of levels."""
    doc: dict[str, Any] = {"benchmark": "serve", "config": config_doc(args, target)}
    levels = [level_doc(load, run, args.seed + (i if args.sweep else 0)) for i, (load, run) in enumerate(runs)]
    if args.sweep:
        doc["sweep"] = levels
    else:
        doc.update(levels[0])
    return doc


def write_plots(out_dir: Path, runs_by_label: dict[str, list[tuple[LoadConfig, LevelRun]]], title: str) -> list[Path]:
    """ttft_cdf.png (every label and level), and throughput_vs_concurrency.png when there is more than one
    closed-loop level. Returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    many = len(runs_by_label) > 1
    cdf: dict[str, list[float]] = {}
    for label, runs in runs_by_label.items():
        for load, run in runs:
            name = " ".join(x for x in (label if many else "", level_label(load)) if x)
            cdf[name] = [r.ttft_s for r in run.results if r.is_ok and r.ttft_s is not None]
    paths = [plot_ttft_cdf(cdf, out_dir / "ttft_cdf.png", f"TTFT CDF: {title}")]
    sweep = {label: [(load.concurrency, run.summary["output_tok_s"]) for load, run in runs if load.rate is None]
             for label, runs in runs_by_label.items()}
    if any(len(points) > 1 for points in sweep.values()):
        paths.append(plot_throughput(sweep, out_dir / "throughput_vs_concurrency.png", f"Throughput: {title}"))
    return paths


def emit(doc: dict[str, Any], output: Path | None) -> None:
    text = json.dumps(doc, indent=2)
    print(text)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    """`stratum bench serve`: run the benchmark and print its JSON. Returns the exit status."""
    p = argparse.ArgumentParser(prog="stratum bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (default: %(default)s)")
    add_bench_args(p)
    args = p.parse_args(argv)
    check_args(p, args)
    try:
        target = make_target(args.url, args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = run_target(target, args)
    doc = result_doc(args, target, runs)
    if args.plot is not None:
        doc["plots"] = [str(x) for x in write_plots(args.plot, {target.url: runs}, f"{args.workload}, {args.api}")]
    emit(doc, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
