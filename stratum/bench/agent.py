"""`stratum bench agent`: an agent session as coding CLIs send it, with a second client's stream beside it.

The session (`agent_session.make_session`, seeded: every server gets the same bytes): a system prompt of
instructions and tool schemas (--system-tokens, about 10k), the task, then --turns turns that each add a
tool call and its result (--tool-result-tokens), streamed over the OpenAI chat API one turn after the
other; the schemas are written into the system prompt (`--tools-field`: sent as `tools`). A neighbour
client streams one short question's answer after another (--neighbour-tokens each, ignore_eos) from
before the first turn until the last one ends. Reported per server: the first turn's TTFT, the later
turns' TTFTs, the prompt tokens the server counted, and the neighbour's gaps between consecutive
tokens while the session ran (longest, p99), against GOALS.

Servers: --url runs against any OpenAI-compatible server; else `stratum serve` is started here (with
--stratum-args, a fresh disk-tier folder so the first turn is cold) and, with --llama-server PATH,
llama-server on the same GGUF (two slots of --max-model-len each, every core, `-fa auto`), one after
the other. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from stratum.bench.agent_session import Session, make_session
from stratum.bench.serve import emit, percentile
from stratum.bench.speculative import Server, start, stop
from stratum.bench.wire import RequestResult, apply_usage, discover_model, openai_event, sse_events
from stratum.bench.workloads import make_question

# the goals on the default model, two cores: seconds
GOALS = {"first_turn_ttft_s": 45.0, "later_turn_ttft_s": 2.0, "neighbour_longest_gap_s": 0.25}


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], r: RequestResult,
                 t_origin: float) -> None:
    """One streamed chat completion into r; chunk times are seconds since t_origin. Any delta (text,
    a tool call's, a thought's) is the first token; failures are recorded in r.error."""
    usage: dict[str, Any] = {}
    t0 = time.perf_counter()
    r.start_s = t0 - t_origin
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}")
            async for _, data in sse_events(resp.aiter_lines()):
                now = time.perf_counter()
                if '"tool_calls"' in data and r.ttft_s is None:
                    r.ttft_s = now - t0
                if openai_event(r, data, usage, now - t0):
                    break
        r.e2e_s = time.perf_counter() - t0
        if r.ttft_s is None:  # nothing streamed before the end (a reply held back whole): the end is the first token
            r.ttft_s = r.e2e_s
        r.chunk_times_s = [t + r.start_s for t in r.chunk_times_s]
        apply_usage(r, "openai", usage)
        r.is_ok = True
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"


async def neighbour(client: httpx.AsyncClient, url: str, model: str, args: argparse.Namespace, t_origin: float,
                    started: asyncio.Event, done: asyncio.Event) -> list[RequestResult]:
    """Answers streamed one after another until done; started is set at its first token."""
    import random

    rng = random.Random(args.seed + 1)
    results = []
    while not done.is_set():
        body = {"model": model, "stream": True, "max_tokens": args.neighbour_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": make_question(rng, 24)}]}
        r = RequestResult(conversation=1, turn=len(results), kind="neighbour")
        task = asyncio.create_task(stream(client, url, body, r, t_origin))
        while not task.done():
            await asyncio.sleep(0.05)
            if r.chunk_times_s:
                started.set()
        await task
        results.append(r)
        started.set()  # (a failed one too: the session must not wait forever)
        if r.error:
            break
    return results


async def run_session(url: str, model: str, session: Session, args: argparse.Namespace) -> dict[str, Any]:
    t_origin = time.perf_counter()
    started, done = asyncio.Event(), asyncio.Event()
    timeout = httpx.Timeout(args.timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        side = (asyncio.create_task(neighbour(client, url, model, args, t_origin, started, done))
                if args.neighbour_tokens > 0 else None)
        if side is not None:
            await started.wait()
        turns = []
        for k, messages in enumerate(session.turns):
            body = {"model": model, "stream": True, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "messages": messages, "stream_options": {"include_usage": True}}
            if session.tools:
                body |= {"tools": session.tools, "tool_choice": "auto"}
            r = RequestResult(conversation=0, turn=k, kind="agent")
            await stream(client, url, body, r, t_origin)
            turns.append(r)
            if r.error:
                break
        window = (turns[0].start_s, time.perf_counter() - t_origin)
        done.set()
        streams = await side if side is not None else []
    return {"turns": [turn_doc(r) for r in turns], "neighbour": neighbour_doc(streams, window),
            "errors": [r.error for r in turns + streams if r.error]}


def turn_doc(r: RequestResult) -> dict[str, Any]:
    return {"turn": r.turn + 1, "ttft_s": round(r.ttft_s, 3) if r.ttft_s is not None else None,
            "e2e_s": round(r.e2e_s, 3) if r.e2e_s is not None else None, "prompt_tokens": r.num_prompt_tokens,
            "cached_tokens": r.num_cached_tokens, "output_tokens": r.num_output_tokens, "error": r.error}


def neighbour_doc(streams: list[RequestResult], window: tuple[float, float]) -> dict[str, Any]:
    """The neighbour's gaps between consecutive tokens of one answer, those that ended while the
    session ran (its first token's wait is a TTFT, not a gap)."""
    lo, hi = window
    gaps = sorted(b - a for r in streams for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:]) if lo <= b <= hi)
    ttfts = [r.ttft_s for r in streams if r.ttft_s is not None]
    return {"streams": len(streams), "gaps": len(gaps),
            "longest_gap_s": round(gaps[-1], 3) if gaps else None,
            "p99_gap_s": round(percentile(gaps, 99), 3) if gaps else None,
            "p50_gap_s": round(percentile(gaps, 50), 4) if gaps else None,
            "longest_ttft_s": round(max(ttfts), 3) if ttfts else None}


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    turns = [t for t in doc["turns"] if t["ttft_s"] is not None]
    later = [t["ttft_s"] for t in turns[1:]]
    out = {"first_turn_ttft_s": turns[0]["ttft_s"] if turns else None,
           "first_turn_prompt_tokens": turns[0]["prompt_tokens"] if turns else None,
           "later_turn_ttft_s": max(later) if later else None,
           "later_turn_ttft_median_s": round(percentile(later, 50), 3) if later else None,
           "neighbour_longest_gap_s": doc["neighbour"]["longest_gap_s"],
           "neighbour_p99_gap_s": doc["neighbour"]["p99_gap_s"]}
    out["goals_met"] = {k: out[k] is not None and out[k] <= goal for k, goal in GOALS.items()}
    return out


async def warm_up(url: str, model: str) -> None:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}
        (await client.post(url + "/v1/chat/completions", json=body)).raise_for_status()


def measure(url: str, model: str | None, session: Session, args: argparse.Namespace) -> dict[str, Any]:
    model = model or discover_model(url, None)
    asyncio.run(warm_up(url, model))
    doc = asyncio.run(run_session(url, model, session, args))
    return {"summary": summary(doc), **doc}


def trained_context(model_path: str) -> int | None:
    """The GGUF's trained context (`<arch>.context_length`), or None where it does not say."""
    from gguf import GGUFReader

    fields = GGUFReader(model_path).fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    f = fields.get(f"{arch}.context_length")
    return int(f.parts[-1][0]) if f is not None else None


def servers(args: argparse.Namespace, model_path: str, kv_dir: str) -> list[Server]:
    """Stratum, and llama-server where given; both with YaRN at the same factor where --max-model-len
    is beyond the trained context (the default model's is 8,192)."""
    trained = trained_context(model_path)
    is_scaled = trained is not None and args.max_model_len > trained
    stratum = (sys.executable, "-m", "stratum.cli", "serve", "--model", args.model, "--data-dir", "",
               "--max-model-len", str(args.max_model_len), "--kv-disk-dir", kv_dir,
               *(("--rope-scaling", "yarn") if is_scaled else ()), *shlex.split(args.stratum_args))
    out = [Server("stratum", stratum)]
    if args.llama_server:
        threads = str(args.threads or os.cpu_count() or 1)
        scaling = (("--rope-scaling", "yarn", "--rope-scale", str(args.max_model_len / trained),
                    "--yarn-orig-ctx", str(trained)) if is_scaled else ())
        out.append(Server("llama-server", (args.llama_server, "-m", model_path, "-c", str(2 * args.max_model_len),
                                           "-np", "2", "-t", threads, "-fa", "auto", "--host", "127.0.0.1",
                                           *scaling), is_stratum=False))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stratum bench agent", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="an OpenAI-compatible server to measure (else servers start here)")
    p.add_argument("--served-model", default=None, help="the model name to ask --url for (default: its first)")
    p.add_argument("--model", default="smollm2-135m", help="what the started servers load (default: %(default)s)")
    p.add_argument("--llama-server", default=None, help="a llama-server binary: measured after Stratum")
    p.add_argument("--stratum-args", default="", help="more `stratum serve` options, as one string")
    p.add_argument("--max-model-len", type=int, default=16384, help="each server's context (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="llama-server's threads (default: every core)")
    p.add_argument("--system-tokens", type=int, default=11000,
                   help="the system prompt with its tools, about (default: %(default)s; the servers count it)")
    p.add_argument("--tools-field", action="store_true",
                   help="send the tool schemas as the request's `tools` (as the CLIs do) instead of in the system "
                        "prompt's text (the default: every server then reads the same text; llama-server drops "
                        "`tools` a template without tools cannot render)")
    p.add_argument("--turns", type=int, default=5, help="the first turn and those after tool calls")
    p.add_argument("--tool-result-tokens", type=int, default=200, help="each tool result, about")
    p.add_argument("--max-tokens", type=int, default=16, help="each turn's answer (its TTFT is measured)")
    p.add_argument("--neighbour-tokens", type=int, default=256, help="each neighbour answer (0: no neighbour)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=Path("bench-agent-logs"))
    p.add_argument("--output", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """`stratum bench agent`: the session against each server, one JSON document."""
    from stratum.kernels.cpu import cpu_name
    from stratum.models.registry import model_path, resolve_model_path

    args = parse_args(argv)
    load_before = os.getloadavg()  # the machine's load: these figures move with it on shared cores
    session = make_session(args.seed, args.system_tokens, args.turns, args.tool_result_tokens,
                           tools_in_system=not args.tools_field)
    results: dict[str, Any] = {}
    if args.url:
        results[args.url] = measure(args.url.rstrip("/"), args.served_model, session, args)
    else:
        path = str(resolve_model_path(args.model)) if Path(args.model).exists() else str(model_path(args.model))
        args.log_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="stratum-agent-kv-") as kv_dir:
            for server in servers(args, path, kv_dir):
                proc, url = start(server, args.log_dir / f"{server.label}.log")
                try:
                    results[server.label] = measure(url, None, session, args)
                finally:
                    stop(proc)
                print(f"{server.label}: {json.dumps(results[server.label]['summary'])}", file=sys.stderr, flush=True)
    doc = {"benchmark": "agent",
           "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                       "load_average_1m": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)}},
           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "session": {"turns": len(session.turns), "system_chars": session.num_system_chars,
                       "tools_in": "tools" if session.tools else "system prompt"},
           "goals": GOALS, "results": results}
    if not args.llama_server and not args.url:
        doc["llama_server"] = "not run: no --llama-server binary given"
    emit(doc, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
