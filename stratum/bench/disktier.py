"""`stratum bench disktier`: what the prefix cache's disk tier buys an agent session (TTFT after a restart
and after the pool evicted its prompt, with the tier and without, on `stratum serve`), and what it costs
(bytes read per token; running decode steps while it writes, tier on against off in one process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from stratum.bench.workloads import make_question, make_text
from stratum.kernels.cpu import cpu_name

GOAL_RESTART_RATIO = 0.1  # the tier's goals: after a restart, TTFT <= 0.1x the cold TTFT (6k prompt, default model)
GOAL_DECODE_SLOWDOWN = 0.05  # and no running decode step slower by more than 5% while the tier writes


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`stratum serve` in a subprocess: started, waited for (prepared kernels), stopped gracefully."""

    def __init__(self, args, disk_gb: float, kv_dir: Path, log: Path):
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "stratum.cli", "serve", "--model", args.model, "--port", str(self.port),
               "--kv-cache-mb", str(args.kv_cache_mb), "--kv-disk-gb", str(disk_gb), "--kv-disk-dir", str(kv_dir),
               "--data-dir", "", "--served-model-name", "bench"]
        self.log = open(log, "a")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 1200.0) -> "Server":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited (log: {self.log.name})")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200 and not r.json().get("preparing"):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server did not get ready (log: {self.log.name})")

    def stop(self) -> None:
        """SIGTERM, as a restart sends: the server drains and the engine writes what it has queued."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def tiers(self) -> dict[str, dict[str, float]]:
        """The stratum_kv_tier_* series of /metrics, per tier."""
        out: dict[str, dict[str, float]] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("stratum_kv_tier_") and "{" in line:
                name, rest = line.split("{", 1)
                tier = rest.split('tier="', 1)[1].split('"', 1)[0]
                out.setdefault(tier, {})[
                    name.removeprefix("stratum_kv_tier_").removesuffix("_total")] = float(line.split()[-1])
        return out


def ask(url: str, system: str, user: str, max_tokens: int = 8) -> dict:
    """One streamed Messages request: TTFT (first text delta), usage, and the trace's prefill step."""
    body = {"model": "bench", "system": system, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": user}]}
    out: dict = {}
    t0 = time.perf_counter()
    headers = {"X-Stratum-Debug": "true", "X-Stratum-Meta": "on"}  # the trace arrives with the cost event
    with httpx.stream("POST", url + "/v1/messages", json=body, headers=headers, timeout=3600) as r:
        r.raise_for_status()
        event = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if event == "content_block_delta" and "ttft_s" not in out:
                    out["ttft_s"] = round(time.perf_counter() - t0, 4)
                elif event == "message_delta":
                    out["usage"] = data["usage"]
                elif event == "stratum_cost" and "trace" in data:
                    from stratum.telemetry.trace import decode_trace

                    steps = decode_trace(data["trace"])["steps"]
                    out["prefill"] = next(s for s in steps if s["name"] == "prefill")
    out["total_s"] = round(time.perf_counter() - t0, 4)
    return out


def _checkpoint(model: str):
    from stratum.models.loader import load_checkpoint
    from stratum.models.registry import resolve_model_path

    return load_checkpoint(resolve_model_path(model))


def pool_mb(checkpoint, num_tokens: int) -> int:
    """A KV pool of num_tokens tokens (float32 K and V, as the CPU's pool keeps them), in MiB."""
    from stratum.engine.builder import kv_bytes_per_token

    return -(-num_tokens * kv_bytes_per_token(checkpoint.config, "float32") // 2**20)


def agent_system_prompt(checkpoint, num_tokens: int, seed: int) -> str:
    """An agent's system prompt of num_tokens tokens (by the model's own tokenizer)."""
    tok = checkpoint.tokenizer
    head = "You are a coding agent. Follow the rules and use the tools described below.\n\n"
    text = head + make_text(random.Random(seed), 2 * num_tokens)  # words run longer than CHARS_PER_TOKEN here
    ids = tok.encode(text)
    text = tok.decode(ids[: num_tokens + 64])
    ids = tok.encode(text)
    while len(ids) > num_tokens:  # trim whole sentences until it fits
        text = text[: text.rfind(".", 0, len(text) - 2) + 1]
        ids = tok.encode(text)
    return text


def sessions(args, system: str, work: Path) -> dict:
    """An agent session's requests (one system prompt, a new user turn each), on servers without and with
    the tier. Without: a fresh server's first request (what every restart pays), then the next one after
    unique requests pushed the prompt out of the pool. With: a first session (cold, then a pool hit), a
    restart (disk hit), the pool evicted under load (disk hit again), and a restart after the tier's files
    left the page cache (a disk hit read from the device, as after a reboot)."""
    rng = random.Random(args.seed)
    turn = lambda: make_question(rng, 24)  # noqa: E731
    off = Server(args, 0, work / "off", work / "serve.log").wait_ready()
    try:
        cold, (load_off, after_off) = ask(off.url, system, turn()), _evict(off, system, turn, args, rng)
    finally:
        off.stop()
    first = Server(args, args.kv_disk_gb, work / "kv", work / "serve.log").wait_ready()
    try:
        first_cold, first_pool = ask(first.url, system, turn()), ask(first.url, system, turn())
        written = first.tiers()
    finally:
        first.stop()
    again = Server(args, args.kv_disk_gb, work / "kv", work / "serve.log").wait_ready()
    try:
        warm = ask(again.url, system, turn())
        load_on, after_on = _evict(again, system, turn, args, rng)
        tiers = again.tiers()
    finally:
        again.stop()
    dropped = _drop_page_cache(work / "kv")
    rebooted = Server(args, args.kv_disk_gb, work / "kv", work / "serve.log").wait_ready()
    try:
        from_device = ask(rebooted.url, system, turn())
    finally:
        rebooted.stop()
    disk = tiers.get("disk", {})
    return {
        "restart": {
            "without_tier": {"after_restart": cold},
            "with_tier": {"first_session_first_request": first_cold, "first_session_second_request": first_pool,
                          "after_restart": warm, "after_restart_page_cache_dropped": from_device,
                          "page_cache_dropped_files": dropped, "tiers_after_first_session": written},
            "ttft_ratio_after_restart": round(warm["ttft_s"] / cold["ttft_s"], 4),
            "ttft_ratio_after_restart_page_cache_dropped": round(from_device["ttft_s"] / cold["ttft_s"], 4),
        },
        "evicted": {
            "without_tier": {**load_off, "after_eviction": after_off},
            "with_tier": {**load_on, "after_eviction": after_on, "tiers": tiers},
            "ttft_ratio_after_eviction": round(after_on["ttft_s"] / after_off["ttft_s"], 4),
        },
        "disk_bytes_read_per_token": round(disk["read_bytes"] / disk["hit_tokens"], 1)
        if disk.get("hit_tokens") else None,
        "reader_cpu_ms_per_mib": round(disk["read_cpu_seconds"] * 1e3 / (disk["read_bytes"] / 2**20), 3)
        if disk.get("read_bytes") else None,
    }


def _evict(server: "Server", system: str, turn, args, rng: random.Random) -> tuple[dict, dict]:
    """Unique requests, two at a time, until the pool let the prompt's blocks go; then the session's next turn."""
    prefix_blocks = args.prompt_tokens // 16 - 1
    before = server.tiers()["pool"]["evicted_blocks"]
    load = []
    while server.tiers()["pool"]["evicted_blocks"] - before < prefix_blocks and len(load) < 16:
        pairs = [(make_text(rng, args.load_tokens), make_question(rng, 24)) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            load += pool.map(lambda pair: ask(server.url, *pair), pairs)
    evicted = server.tiers()["pool"]["evicted_blocks"] - before
    after = ask(server.url, system, turn())
    return {"load_ttft_s": [x["ttft_s"] for x in load], "pool_evicted_blocks": evicted}, after


def _drop_page_cache(kv: Path) -> int:
    """The tier's files out of the page cache (each written back first): the next read is the device's."""
    n = 0
    for path in kv.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def decode_while_writing(args, work: Path) -> dict:
    """Two engines in this process, tier off and tier on, the same decoding streams in each. In rounds
    (the order alternating, so a drift in the machine's load hits both alike), each engine admits the
    same new long prompt and runs a fixed number of steps while the other waits with its tier's writes
    finished; the tier-on engine's writer writes the prompt's blocks (and the streams' new ones)
    meanwhile. Compared: the median decode-only step of each round (the engine's own step records)."""
    from stratum.engine import LLM
    from stratum.engine.sampling_params import SamplingParams

    # plain decoding: speculation would finish the streams early (each step a varying number of tokens)
    # and say nothing of the writer
    engines = {label: LLM(args.model, kv_cache_memory_mb=args.kv_cache_mb, kv_disk_gb=gb, kv_disk_dir=str(work / label),
                          serving=True, speculative="off").engine
               for label, gb in (("tier_off", 0), ("tier_on", args.kv_disk_gb))}
    rng = random.Random(args.seed)
    tok = engines["tier_on"].tokenizer
    streams = [tok.encode(make_text(rng, 128)) for _ in range(args.decode_streams)]
    for engine in engines.values():
        for ids in streams:
            engine.add_request(ids, SamplingParams(max_tokens=args.rounds * args.round_steps * 2 + 64, temperature=0.0,
                                                   ignore_eos=True))
        while any(not s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
    rounds, load = [], [os.getloadavg()[0]]
    for r in range(args.rounds):
        long_prompt = tok.encode(make_text(rng, args.load_tokens))
        row = {}
        for label in (("tier_off", "tier_on") if r % 2 == 0 else ("tier_on", "tier_off")):
            engines["tier_on"].tier.flush(120.0)
            row[label] = _round(engines[label], long_prompt, args)
        row["ratio"] = round(row["tier_on"]["decode_step_ms"] / row["tier_off"]["decode_step_ms"], 4)
        rounds.append(row)
    load.append(os.getloadavg()[0])
    disk = engines["tier_on"].tier.report()["disk"]
    for engine in engines.values():
        engine.tier.close()
    ratios = sorted(row["ratio"] for row in rounds)
    on = [row["tier_on"] for row in rounds]
    return {"rounds": rounds, "decode_step_slowdown_while_writing": round(statistics.median(ratios) - 1, 4),
            "slowdown_quartiles": [round(q - 1, 4) for q in statistics.quantiles(ratios, n=4)]
            if len(ratios) > 1 else None,
            "steps_while_writing": sum(x["steps_while_writing"] for x in on), "steps": sum(x["steps"] for x in on),
            # the writer's own CPU time (its thread's clock) over the wall time of the measured steps
            "writer_cpu_share_of_a_core": round(sum(x["writer_cpu_s"] for x in on)
                                                / sum(x["measured_s"] for x in on), 4),
            "writer_cpu_ms_per_mib": round(disk["write_cpu_s"] * 1e3 / (disk["written_bytes"] / 2**20), 3)
            if disk["written_bytes"] else None,
            "loadavg_1min_before_after": load}


def _round(engine, long_prompt: list[int], args) -> dict:
    """One engine's round: the long prompt admitted, round_steps steps; its decode-only steps measured."""
    from stratum.engine.sampling_params import SamplingParams

    report = engine.tier.report
    written0, cpu0 = report()["disk"]["written_bytes"], report()["disk"]["write_cpu_s"]
    engine.add_request(long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
    steps, cpu_s = [], 0.0
    for _ in range(args.round_steps):
        writing, cpu = report()["disk"]["pending_blocks"] > 0, report()["disk"]["write_cpu_s"]
        engine.step()
        s = engine.step_stats[-1]
        if s.num_seqs == s.num_decode_seqs == args.decode_streams:
            steps.append((s.step_s, writing or report()["disk"]["pending_blocks"] > 0))
            cpu_s += report()["disk"]["write_cpu_s"] - cpu
    return {"decode_step_ms": _ms([t for t, _ in steps]), "steps": len(steps),
            "steps_while_writing": sum(w for _, w in steps),
            "decode_step_ms_while_writing": _ms([t for t, w in steps if w]),
            "bytes_written_during_round": report()["disk"]["written_bytes"] - written0,
            "writer_cpu_s": cpu_s, "measured_s": sum(t for t, _ in steps),
            "writer_cpu_s_in_round": report()["disk"]["write_cpu_s"] - cpu0}


def index_read(work: Path, num_blocks: int = 50_000) -> dict:
    """What a start reads of the tier: its binding's keys from the index (no block's data), with
    num_blocks rows of its own and as many of another binding's (the default bound, 16 GiB, holds 23k
    of SmolLM2's 720 KiB blocks)."""
    from stratum.engine.disk_store import DiskStore

    store = DiskStore(work / "index", 1 << 50)
    conn = store.connect()
    for binding in (b"a" * 32, b"b" * 32):
        for i in range(0, num_blocks, 10_000):
            DiskStore.add(conn, binding, [(os.urandom(32), 737_376) for _ in range(min(10_000, num_blocks - i))])
    conn.close()
    t0 = time.perf_counter()
    conn = store.connect()
    keys, _ = DiskStore.keys(conn, b"a" * 32)
    read_s = time.perf_counter() - t0
    conn.close()
    return {"blocks": len(keys), "other_binding_blocks": num_blocks, "read_ms": round(read_s * 1e3, 2)}


def _ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 3) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stratum bench disktier", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or Hugging Face folder")
    p.add_argument("--prompt-tokens", type=int, default=6000, help="the agent's system prompt")
    p.add_argument("--kv-cache-mb", type=int, default=None,
                   help="the KV pool (default: the prompt, one load request and 512 tokens, so the load evicts it)")
    p.add_argument("--kv-disk-gb", type=float, default=8.0, help="the tier's bound where it is on")
    p.add_argument("--load-tokens", type=int, default=1500,
                   help="each unique request of the load that evicts the prompt")
    p.add_argument("--decode-streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=12, help="alternated tier off / on rounds of the decode figure")
    p.add_argument("--round-steps", type=int, default=16)
    p.add_argument("--scenarios", default="sessions,decode,index", help="sessions (restart, eviction), decode, index")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    checkpoint = _checkpoint(args.model)
    if args.kv_cache_mb is None:
        args.kv_cache_mb = pool_mb(checkpoint, args.prompt_tokens + args.load_tokens + 512)
    work = Path(tempfile.mkdtemp(prefix="stratum-bench-disktier-"))
    doc: dict = {"model": args.model, "prompt_tokens": args.prompt_tokens, "kv_cache_mb": args.kv_cache_mb,
                 "load_tokens": args.load_tokens,
                 "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                             "loadavg_1min_at_start": os.getloadavg()[0]}}
    t0 = time.perf_counter()
    try:
        scenarios = args.scenarios.split(",")
        if "sessions" in scenarios:
            doc.update(sessions(args, agent_system_prompt(checkpoint, args.prompt_tokens, args.seed), work))
            _save_partial(doc, args)  # a busy machine's run takes an hour: what it measured so far stays
        if "decode" in scenarios:
            doc["decode_while_writing"] = decode_while_writing(args, work)
            _save_partial(doc, args)
        if "index" in scenarios:
            doc["index_read_at_start"] = index_read(work)
        doc["goals"] = _goals(doc)
    finally:
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        log = work / "serve.log"
        doc["server_log_tail"] = log.read_text()[-1500:] if log.exists() else ""
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(doc, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


def _save_partial(doc: dict, args) -> None:
    if args.output:
        Path(args.output).write_text(json.dumps({**doc, "partial": True}, indent=2) + "\n")


def _goals(doc: dict) -> dict:
    """The tier's goals (GOAL_RESTART_RATIO, GOAL_DECODE_SLOWDOWN), where this run measured them (the restart
    goal is for the 6k prompt on the default model)."""
    goals = {}
    if "restart" in doc:
        goals["restart_ttft_ratio_le_0.1"] = doc["restart"]["ttft_ratio_after_restart"] <= GOAL_RESTART_RATIO
    if "decode_while_writing" in doc:
        goals["decode_slowdown_le_5pct"] = (doc["decode_while_writing"]["decode_step_slowdown_while_writing"]
                                            <= GOAL_DECODE_SLOWDOWN)
    return goals


if __name__ == "__main__":
    raise SystemExit(main())
