"""`stratum bench soak`: a long run at fixed concurrency, for what only shows up over time.

A 15-minute soak of 16 clients once took the server's RSS from 927 to 1,640 MB. This program keeps N
closed-loop clients busy (30 minutes by default) on a mix that reaches every place memory can pile
up: both APIs, streamed and not; one long shared system prompt (prefix-cache hits) and unique
prompts of varied lengths (cache churn and eviction); clients that hang up mid-stream; a new
conversation id (metadata.user_id, OpenAI's user) on every request, so per-session and per-tenant
state must stay bounded. It samples the RSS of the server and its child processes (the engine), and
the goal is an RSS at the end within 5% of the RSS after the first 2 minutes, once warm-up
allocations are done. It also sends a fixed greedy probe throughout, whose text must not change (no
state leaks between requests), and once the server is idle again reads /health: no KV block may
still be in use (no leaked sequences).
Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from stratum.bench.serve import emit
from stratum.bench.wire import (API_PATHS, BenchError, RequestResult, StreamError, Target, anthropic_event, apply_usage,
                                auth_headers, base_url, check_url, openai_event, request_body, sse_events)
from stratum.bench.workloads import make_question, make_text

WARM_S = 120.0  # RSS growth is measured from the first sample at or after this
TEMPERATURE = 0.7
MIN_PROMPT_TOKENS = 20
STREAM_FRACTION = 0.7
SHARED_FRACTION = 0.5  # requests that carry the shared system prompt
PROBE_PROMPT = "Name the four seasons of the year, one per line."
PROBE_MAX_TOKENS = 32
REJECTED_STATUSES = (429, 529)  # admission said "not now": reported, but not lost requests
NUM_FAILURE_SAMPLES = 5
BACKOFF_S = 0.5  # after a failure or a rejection, so a dead or full server is not hit in a tight loop
DRAIN_S = 60.0  # in-flight requests may finish for this long after the duration
IDLE_WAIT_S = 30.0
STOP_WAIT_S = 60.0  # after SIGTERM; the server may drain in-flight requests for a while first


class Outcome(NamedTuple):
    """How one request ended: kind is "ok", "failed", "rejected" or "disconnected" (the client hung up)."""

    kind: str
    detail: str = ""  # failed: what went wrong
    key: str = ""  # failed: the HTTP status, or "stream", "timeout", "connection", "drain"
    text: str = ""
    num_output_tokens: int = 0


@dataclass(slots=True)
class Tally:
    """Every request's outcome, probes included."""

    requests: int = 0
    failures: int = 0
    failure_samples: list[str] = field(default_factory=list)
    failures_by_status: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    disconnects: int = 0
    output_tokens: int = 0

    def add(self, o: Outcome) -> None:
        if o.kind == "ok":
            self.requests += 1
            self.output_tokens += o.num_output_tokens
        elif o.kind == "rejected":
            self.rejected += 1
        elif o.kind == "disconnected":
            self.disconnects += 1
        else:
            self.failures += 1
            self.failures_by_status[o.key] = self.failures_by_status.get(o.key, 0) + 1
            if o.detail not in self.failure_samples and len(self.failure_samples) < NUM_FAILURE_SAMPLES:
                self.failure_samples.append(o.detail)


@dataclass(slots=True)
class Probe:
    """The greedy probe's texts; the first one is the reference, and counts as matched."""

    count: int = 0
    matched: int = 0
    mismatched: int = 0
    first_text: str | None = None
    first_mismatch: str | None = None

    def add(self, text: str) -> None:
        self.count += 1
        self.first_text = text if self.first_text is None else self.first_text
        if text == self.first_text:
            self.matched += 1
        else:
            self.mismatched += 1
            if self.first_mismatch is None:
                self.first_mismatch = text


# ---- memory --------------------------------------------------------------------------------------
def rss_mb(pid: int | None) -> dict[str, float | None]:
    """api_mb: the process itself; children_mb: its child processes, recursively; total_mb: both.
    All None without a pid or once the process is gone."""
    import psutil

    none = {"api_mb": None, "children_mb": None, "total_mb": None}
    if pid is None:
        return none
    try:
        proc = psutil.Process(pid)
        api = proc.memory_info().rss
        children = 0
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # a child that exited between the listing and the read
                children += child.memory_info().rss
    except psutil.Error:
        return none
    return {"api_mb": round(api / 2**20, 1), "children_mb": round(children / 2**20, 1),
            "total_mb": round((api + children) / 2**20, 1)}


def rss_after(samples: list[dict[str, Any]], t_s: float) -> float | None:
    """total_mb of the first sample taken at or after t_s that has one."""
    return next((s["total_mb"] for s in samples if s["t_s"] >= t_s and s["total_mb"] is not None), None)


def growth_pct(start_mb: float | None, end_mb: float | None) -> float | None:
    """(end - start) / start in percent, rounded to 0.01; None when either is unknown."""
    if start_mb is None or end_mb is None or start_mb <= 0:
        return None
    return round((end_mb - start_mb) / start_mb * 100, 2)


# ---- one request ---------------------------------------------------------------------------------
def reply_outcome(api: str, obj: Any) -> Outcome:
    """The outcome of a non-streamed reply body."""
    if not isinstance(obj, dict):
        return Outcome("failed", f"unexpected reply: {str(obj)[:200]}", "stream")
    if api == "anthropic":
        text = "".join(b.get("text", "") for b in obj.get("content") or [] if b.get("type") == "text")
        num_output = (obj.get("usage") or {}).get("output_tokens")
    else:
        text = (((obj.get("choices") or [{}])[0]).get("message") or {}).get("content") or ""
        num_output = (obj.get("usage") or {}).get("completion_tokens")
    return Outcome("ok", text=text, num_output_tokens=int(num_output or 0))


def status_outcome(status: int, body: str) -> Outcome:
    if status in REJECTED_STATUSES:
        return Outcome("rejected", key=str(status))
    return Outcome("failed", f"HTTP {status}: {body[:300]}", str(status))


async def send(client: httpx.AsyncClient, target: Target, system: str | None, messages: list[dict[str, str]],
               is_stream: bool, timeout_s: float, drop_after: int | None = None, user: str | None = None) -> Outcome:
    """Send one request and say how it ended; nothing is raised but cancellation.

    drop_after: a streamed request is closed by the client after this many events (an intentional disconnect).
    user: sent as metadata.user_id (Anthropic) or user (OpenAI), as agent frameworks label a conversation.
    """
    body = request_body(target, system, messages)
    if user is not None:
        if target.api == "anthropic":
            body["metadata"] = {"user_id": user}
        else:
            body["user"] = user
    if not is_stream:
        body["stream"] = False
        body.pop("stream_options", None)
    url, headers = target.url + API_PATHS[target.api], auth_headers(target.api, target.api_key)
    try:
        async with asyncio.timeout(timeout_s):
            if not is_stream:
                resp = await client.post(url, json=body, headers=headers)
                if not resp.is_success:
                    return status_outcome(resp.status_code, resp.text)
                return reply_outcome(target.api, resp.json())
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if not resp.is_success:
                    return status_outcome(resp.status_code, (await resp.aread()).decode(errors="replace"))
                r, usage, num_events = RequestResult(0, 0, "soak"), {}, 0
                async for name, data in sse_events(resp.aiter_lines()):
                    if target.api == "anthropic":
                        is_done = anthropic_event(r, name, data, usage, 0.0)
                    else:
                        is_done = openai_event(r, data, usage, 0.0)
                    if is_done:
                        apply_usage(r, target.api, usage)
                        return Outcome("ok", text=r.text, num_output_tokens=r.num_output_tokens)
                    num_events += 1
                    if drop_after is not None and num_events >= drop_after:
                        return Outcome("disconnected")  # leaving the block closes the connection mid-stream
                return Outcome("failed", "stream ended before its final event", "stream")
    except StreamError as e:
        return Outcome("failed", str(e), "stream")
    except TimeoutError:
        return Outcome("failed", f"timeout after {timeout_s:g} s", "timeout")
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a malformed JSON body or event
        return Outcome("failed", f"{type(e).__name__}: {e}", "connection")


def make_prompt(rng: random.Random, shared_system: str, shared_tokens: int,
                max_prompt_tokens: int) -> tuple[str | None, list[dict[str, str]]]:
    """(system, messages): the shared system prompt and a fresh question, or a unique text and question."""
    if rng.random() < SHARED_FRACTION:
        num_tokens = rng.randint(10, max(10, max_prompt_tokens - shared_tokens))
        return shared_system, [{"role": "user", "content": make_question(rng, num_tokens)}]
    num_tokens = rng.randint(MIN_PROMPT_TOKENS, max_prompt_tokens)
    text = f"{make_text(rng, num_tokens - 10)}\n\n{make_question(rng, 10)}"
    return None, [{"role": "user", "content": text}]


# ---- the run -------------------------------------------------------------------------------------
async def until_stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep for seconds or until stop is set; True if it was set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


async def every(period_s: float, stop: asyncio.Event, fn: Callable[[], Awaitable[None]]) -> None:
    """fn() at period_s, 2 period_s, ... from now until stop; on a fixed grid, so a slow probe does not drift it."""
    next_s = time.monotonic() + period_s
    while not await until_stopped(stop, max(0.0, next_s - time.monotonic())):
        await fn()
        next_s += period_s


async def wait_idle(client: httpx.AsyncClient, url: str, timeout_s: float) -> dict[str, Any]:
    """/health once nothing runs or waits and no KV block is in use, or the last one read at timeout_s."""
    deadline, health = time.monotonic() + timeout_s, {}
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = (await client.get(url + "/health", timeout=5)).json()
        is_idle = health.get("running") == 0 and health.get("waiting") == 0 and not health.get("queued")
        if (is_idle and (health.get("kv_blocks") or {}).get("in_use") == 0) or time.monotonic() >= deadline:
            return health
        await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    """Run the clients, samples and probes for args.duration_s, drain, and return the JSON document."""
    probe_target = Target(url, "anthropic", args.model, PROBE_MAX_TOKENS, 0.0, api_key=args.api_key)
    shared_tokens = args.max_prompt_tokens // 2
    shared_system = ("You are a helpful assistant. Use the background below to answer.\n\n"
                     + make_text(random.Random(args.seed), shared_tokens))
    tally, probe, samples, stop = Tally(), Probe(), [], asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s), limits=limits, trust_env=False) as client:
        t0 = time.monotonic()

        async def sample() -> None:
            s = {"t_s": round(time.monotonic() - t0, 1), **rss_mb(pid), "requests_done": tally.requests}
            samples.append(s)
            if not args.no_progress:
                print(f"[{s['t_s']:7.1f} s] RSS {s['total_mb']} MB (api {s['api_mb']}, children {s['children_mb']}); "
                      f"{tally.requests} ok, {tally.failures} failed, {tally.rejected} rejected, "
                      f"{tally.disconnects} disconnects; probe {probe.mismatched}/{probe.count} mismatched",
                      file=sys.stderr, flush=True)

        async def send_probe() -> None:
            o = await send(client, probe_target, None, [{"role": "user", "content": PROBE_PROMPT}], False,
                           args.timeout_s)
            tally.add(o._replace(detail=f"probe: {o.detail}") if o.kind == "failed" else o)
            if o.kind == "ok":
                probe.add(o.text)

        async def run_client(i: int) -> None:
            rng, n = random.Random(args.seed + i), 0
            while not stop.is_set():
                api = rng.choice(tuple(API_PATHS))
                is_stream = rng.random() < STREAM_FRACTION
                drop_after = rng.randint(1, 4) if is_stream and rng.random() < args.disconnect_fraction else None
                t = Target(url, api, args.model, rng.randint(16, args.max_tokens), TEMPERATURE, api_key=args.api_key)
                system, messages = make_prompt(rng, shared_system, shared_tokens, args.max_prompt_tokens)
                n += 1
                try:  # every request a conversation of its own: the server must not keep state per id forever
                    o = await send(client, t, system, messages, is_stream, args.timeout_s, drop_after,
                                   user=f"soak-{i}-{n}")
                except asyncio.CancelledError:
                    tally.add(Outcome("failed", f"still running {DRAIN_S:g} s after the end", "drain"))
                    raise
                tally.add(o)
                if o.kind in ("failed", "rejected"):
                    await until_stopped(stop, BACKOFF_S)

        await sample()
        await send_probe()  # the reference text, on an idle server
        clients = [asyncio.create_task(run_client(i)) for i in range(args.clients)]
        monitors = [asyncio.create_task(every(args.sample_every_s, stop, sample)),
                    asyncio.create_task(every(args.probe_every_s, stop, send_probe))]
        await asyncio.sleep(args.duration_s)
        stop.set()
        duration_s = time.monotonic() - t0
        _, pending = await asyncio.wait(clients + monitors, timeout=DRAIN_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*clients, *monitors, return_exceptions=True)
        for task in clients + monitors:  # surface bugs in the runner itself rather than losing them
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        health = await wait_idle(client, url, IDLE_WAIT_S)
        await sample()  # the end state: idle, after the drain

    at_warm = rss_after(samples, WARM_S) if duration_s >= WARM_S else None
    end = samples[-1]["total_mb"]
    kv = health.get("kv_blocks")
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "out", "no_progress", "url")}
    return {"benchmark": "soak", "config": {"url": url, **config, "pid": pid, "temperature": TEMPERATURE},
            "requests": tally.requests, "failures": tally.failures, "failure_samples": tally.failure_samples,
            "failures_by_status": tally.failures_by_status, "rejected": tally.rejected,
            "disconnects": tally.disconnects, "output_tokens": tally.output_tokens, "duration_s": round(duration_s, 1),
            "rss_mb": samples, "rss_at_2min_mb": at_warm, "rss_end_mb": end, "rss_growth_pct": growth_pct(at_warm, end),
            "kv_blocks_end": kv, "kv_leaked": kv["in_use"] if kv else None,
            "probe": asdict(probe)}


# ---- a server of its own -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def spawn_server(serve_args: str, timeout_s: float) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """`stratum serve ARGS --port P` on a free port with this interpreter, ready (GET /health 200) on entry and
    stopped with SIGTERM on exit. Yields (url, process, log file).

    Raises:
        BenchError: the server exited, or was not ready within timeout_s.
    """
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="stratum-soak-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "stratum.cli", "serve", *shlex.split(serve_args), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not _is_healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"not ready in {timeout_s:g} s" if proc.returncode is None else f"exited with {proc.returncode}"
                raise BenchError(f"`{shlex.join(cmd)}` {why}; its log, {log}:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url, proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _is_healthy(url: str) -> bool:
    """200, and no cold start's kernels still being prepared: a switch mid-run would drop the cache."""
    try:
        r = httpx.get(url + "/health", timeout=2, trust_env=False)
        return r.status_code == 200 and not r.json().get("preparing")
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    """`stratum bench soak`: run the soak and print its JSON. Returns the exit status (2: bad input)."""
    p = argparse.ArgumentParser(prog="stratum bench soak", description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8080", help="a running server (default: %(default)s)")
    where.add_argument("--serve", default=None, metavar="ARGS", help='start `stratum serve ARGS` ("--model m ...")')
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, to read its RSS")
    p.add_argument("--allow-remote", action="store_true", help="allow a URL that is not a loopback address")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=96, help="max_tokens is drawn from [16, this]")
    p.add_argument("--max-prompt-tokens", type=int, default=600, help="prompts are ~20 tokens to this")
    p.add_argument("--disconnect-fraction", type=float, default=0.05, help="streamed requests dropped mid-stream")
    p.add_argument("--sample-every-s", type=float, default=30.0)
    p.add_argument("--probe-every-s", type=float, default=30.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="with --serve")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    for name in ("clients", "duration_s", "sample_every_s", "probe_every_s", "timeout_s", "startup_timeout_s"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_tokens < 16 or args.max_prompt_tokens < MIN_PROMPT_TOKENS:
        p.error(f"--max-tokens must be at least 16 and --max-prompt-tokens at least {MIN_PROMPT_TOKENS}")
    if not 0 <= args.disconnect_fraction <= 1:
        p.error("--disconnect-fraction must be in [0, 1]")
    try:
        if args.serve is not None:
            with spawn_server(args.serve, args.startup_timeout_s) as (url, proc, log):
                doc = asyncio.run(soak(args, url, proc.pid))
            doc["server"] = {"log": str(log), "exit_code": proc.returncode}
        else:
            check_url(args.url, args.allow_remote)
            if args.pid is None:
                print("no --pid: RSS is not measured", file=sys.stderr)
            doc = asyncio.run(soak(args, base_url(args.url), args.pid))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
