"""`stratum bench speculative`: decoding with and without speculation, side by side, on workloads that
copy from their prompt and on one that does not.

Workloads (seeded; every server gets the same text):
    edit       the prompt holds a 300-800 token Python file; the answer rewrites it with one small change
    json-echo  the prompt holds a JSON document; the answer returns it with one field changed
    unique     distinct short questions (the control: nothing in the prompt to copy)
Servers, all started here and stopped at the end: `stratum serve --speculative off` (the baseline),
`stratum serve` (speculation on its default, auto), with `--draft-model` also Stratum with that draft;
with `--llama-server PATH` also llama-server plain, with its n-gram lookup (`--spec-type ngram-simple`)
and with the draft model. Each workload runs at one stream and at `-c 8`, greedy, over the OpenAI chat
API, streaming, in rounds that visit every server in turn (`run_case`). Prints one JSON document: per
server, workload and concurrency the decode tokens/s of a stream (output tokens after the first / time
after the first token), the output tokens/s of the run and TTFT; Stratum's acceptance figures from its /metrics;
whether each answer equals the baseline's; and the ratios against the baseline with the goals (GOALS).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from stratum.bench.serve import LoadConfig, Target, emit, run_level
from stratum.bench.workloads import WORDS, Conversation, Workload, WorkloadConfig, make_workload

WORKLOADS = ("edit", "json-echo", "unique")
# The goals: decode tokens/s against the baseline (edit at one stream, edit at c=8, the control)
GOALS = {("edit", 1): 1.8, ("edit", 8): 1.3, ("unique", 1): 0.97, ("unique", 8): 0.97}


# ---- workloads ------------------------------------------------------------------------------------
NOUNS = ("item", "user", "order", "record", "invoice", "ticket", "session", "message", "account", "device")
# Ordinary small functions over a noun ({n}, plural {ns}, class name {N}): files built from them read as
# the code an agent edits, which a model copies far more faithfully than invented names
FUNCTIONS = (
    'def load_{ns}(path):\n    """Read the {ns} stored as JSON at path."""\n'
        '    with open(path) as f:\n        return json.load(f)\n',
    'def save_{ns}({ns}, path):\n    """Write the {ns} to path as JSON."""\n'
        '    with open(path, "w") as f:\n        json.dump({ns}, f, indent=2)\n',
    'def find_{n}({ns}, {n}_id):\n    """The {n} with the given id, or None."""\n'
        '    for {n} in {ns}:\n        if {n}["id"] == {n}_id:\n            return {n}\n    return None\n',
    'def count_{ns}({ns}, status):\n    """How many {ns} have the given status."""\n'
        '    return sum(1 for {n} in {ns} if {n}.get("status") == status)\n',
    'def group_{ns}_by_owner({ns}):\n    """The {ns} of each owner, in their order."""\n    groups = {{}}\n'
        '    for {n} in {ns}:\n        groups.setdefault({n}["owner"], []).append({n})\n    return groups\n',
    'def newest_{n}({ns}):\n    """The {n} created last, or None when there is none."""\n'
        '    if not {ns}:\n        return None\n    return max({ns}, key=lambda {n}: {n}["created"])\n',
    'def total_{n}_amount({ns}):\n    """The sum of the amounts of all {ns}, rounded to cents."""\n    total = 0.0\n'
        '    for {n} in {ns}:\n        total += {n}.get("amount", 0.0)\n    return round(total, 2)\n',
    'def validate_{n}({n}):\n    """Raise ValueError when the {n} misses a required field."""\n'
        '    for field in ("id", "owner", "status"):\n        if field not in {n}:\n'
        '            raise ValueError(f"{n} is missing {{field}}")\n    return {n}\n',
    'def {n}_path(root, {n}_id):\n    """Where the {n} with the given id is stored under root."""\n'
        '    return os.path.join(root, "{ns}", str({n}_id) + ".json")\n',
    'def archive_{ns}({ns}, days):\n    """The {ns} older than the given number of days."""\n'
        '    cutoff = time.time() - days * 86400\n    return [{n} for {n} in {ns} if {n}["created"] < cutoff]\n',
    'def format_{n}({n}):\n    """One line describing the {n}."""\n'
        '    return f"#{{{n}[\'id\']}} {{{n}[\'owner\']}} ({{{n}[\'status\']}})"\n',
    'def sort_{ns}({ns}, reverse=False):\n    """The {ns} ordered by creation time."""\n'
        '    return sorted({ns}, key=lambda {n}: {n}["created"], reverse=reverse)\n',
    'class {N}Store:\n    """Keeps {ns} in memory, by id."""\n\n    def __init__(self):\n        self.{ns} = {{}}\n\n'
        '    def add(self, {n}):\n        self.{ns}[{n}["id"]] = {n}\n\n'
        '    def remove(self, {n}_id):\n        return self.{ns}.pop({n}_id, None)\n',
)
RENAMES = {"load": "read", "save": "write", "find": "lookup", "count": "tally", "newest": "latest", "sort": "order",
           "format": "describe", "archive": "expire", "validate": "check"}


def make_code_file(rng: random.Random, num_functions: int) -> tuple[str, str, str]:
    """A Python module of num_functions functions over one noun. Returns (the source, the name of a
    function, the name it is to be renamed to)."""
    n = rng.choice(NOUNS)
    names = {"n": n, "ns": n + "s", "N": n.title()}
    chosen = rng.sample(FUNCTIONS, num_functions)
    body = "\n\n".join(f.format(**names) for f in chosen)
    source = f'"""Helpers for {n}s."""\n\nimport json\nimport os\nimport time\n\n\n{body}'
    defs = [m for m in re.findall(r"^def (\w+)", source, re.M) if m.split("_")[0] in RENAMES]
    old = rng.choice(defs)
    verb = old.split("_")[0]
    return source, old, RENAMES[verb] + old[len(verb):]


SYSTEM_EDIT = "You edit code. Reply with the complete edited file in one code block."
# The answer's start, as an agent's harness often writes it: without it the default model (135M) tends to
# describe the change in prose rather than rewrite the file
EDIT_PREFILL = "```python\n"


def edit_conversations(n: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        source, old, new = make_code_file(rng, rng.randint(8, 12))
        convs.append(Conversation((f"```python\n{source}```\n\nRename the function `{old}` to `{new}`.",),
                                  system=SYSTEM_EDIT, prefill=EDIT_PREFILL))
    return convs


def json_conversations(n: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        items = [{"id": rng.randint(1000, 9999), "name": " ".join(rng.sample(WORDS, 2)), "city": rng.choice(WORDS),
                  "tags": rng.sample(WORDS, 3), "score": round(rng.random() * 100, 2)}
                 for _ in range(rng.randint(5, 8))]
        doc = json.dumps({"status": "pending", "owner": rng.choice(WORDS), "items": items}, indent=2)
        convs.append(Conversation((f"Return this JSON document exactly as it is, except that \"status\" becomes "
                                   f"\"done\". Reply with the JSON only.\n\n{doc}",)))
    return convs


def make_spec_workload(name: str, n: int, seed: int) -> Workload:
    """Raises ValueError for an unknown name."""
    if name == "edit":
        return Workload(name, WorkloadConfig(num_requests=n, seed=seed), tuple(edit_conversations(n, seed)))
    if name == "json-echo":
        return Workload(name, WorkloadConfig(num_requests=n, seed=seed), tuple(json_conversations(n, seed)))
    if name == "unique":
        return make_workload("unique", WorkloadConfig(num_requests=n, seed=seed))
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


# ---- servers --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Server:
    label: str
    argv: tuple[str, ...]  # without the port
    port_flag: str = "--port"
    is_stratum: bool = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: Server, log: Path, timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """Launch and wait until /health answers 200. Raises RuntimeError when it exits or times out."""
    port = _free_port()
    with open(log, "w") as f:
        proc = subprocess.Popen([*server.argv, server.port_flag, str(port)], stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.label} exited ({proc.returncode}); see {log}")
        try:
            health = httpx.get(url + "/health", timeout=2)
            # a cold start serves on the PyTorch step while its kernels are prepared: wait for them
            if health.status_code == 200 and not (server.is_stratum and health.json().get("preparing")):
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"{server.label}: not ready in {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def spec_counters(url: str) -> dict[str, float]:
    """Stratum's speculative counters from /metrics (totals since start)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("proposed_tokens", "accepted_tokens", "verify_steps"):
        m = re.search(rf"^stratum_spec_{name}_total (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def servers(args: argparse.Namespace, model_path: str) -> list[Server]:
    stratum = (sys.executable, "-m", "stratum.cli", "serve", "--model", args.model, "--data-dir", "",
               "--max-num-seqs", "16", *(("--threads", str(args.threads)) if args.threads else ()))
    out = [Server("stratum-off", (*stratum, "--speculative", "off")), Server("stratum", stratum)]
    if args.draft_model:
        out.append(Server("stratum-draft", (*stratum, "--draft-model", args.draft_model)))
    if args.llama_server:
        threads = str(args.threads or os.cpu_count() or 1)
        base = (args.llama_server, "-m", model_path, "-c", str(8 * 4096), "-np", "8", "-t", threads,
                "--host", "127.0.0.1")
        out.append(Server("llama-server", base, is_stratum=False))
        out.append(Server("llama-server-ngram", (*base, "--spec-type", "ngram-simple", "--spec-draft-n-max", "16"),
                          is_stratum=False))
        if args.draft_model:
            out.append(Server("llama-server-draft", (*base, "-md", args.draft_model, "--spec-draft-n-max", "16"),
                              is_stratum=False))
    return out


# ---- runs -----------------------------------------------------------------------------------------
def measure(url: str, model: str, workload: Workload, concurrency: int, max_tokens: int) -> tuple[list, float]:
    """One round: the workload's conversations at one concurrency. Returns (its requests, wall seconds)."""
    target = Target(url=url, api="openai", model=model, max_tokens=max_tokens, temperature=0.0)
    run = run_level(target, workload, LoadConfig(concurrency=concurrency, timeout_s=1800.0), progress=False)
    return run.results, run.summary["duration_s"]


def case_doc(results: list, duration_s: float, counters: dict[str, float] | None) -> dict:
    """One server's figures for one workload and concurrency, over every round: decode tokens/s of a
    stream (output tokens after the first / time after the first token, the mean over requests), output
    tokens/s (all output tokens / the rounds' wall time), TTFT, a digest of every answer, and the
    speculative counters the server counted meanwhile."""
    ok = [r for r in results if r.is_ok]
    decode = [(r.num_output_tokens - 1) / (r.e2e_s - r.ttft_s) for r in ok
              if r.num_output_tokens > 1 and r.e2e_s is not None and r.ttft_s is not None and r.e2e_s > r.ttft_s]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    num_output = sum(r.num_output_tokens for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok),
        "error_samples": sorted({r.error or "unknown error" for r in results if not r.is_ok})[:3],
        "output_tokens": num_output, "duration_s": round(duration_s, 3),
        "output_tok_s": round(num_output / duration_s, 3) if duration_s > 0 else None,
        "decode_tok_s_per_stream": round(sum(decode) / len(decode), 2) if decode else None,
        "ttft_ms_p50": round(1000 * ttft[len(ttft) // 2], 1) if ttft else None,
        "answers": [hashlib.sha256(r.text.encode()).hexdigest()[:16]
                    for r in sorted(results, key=lambda r: r.conversation)],
    }
    if counters is not None:
        d = counters
        out["speculative"] = {**{k: int(v) for k, v in d.items()},
                              "acceptance_rate": round(d["accepted_tokens"] / d["proposed_tokens"], 4)
                              if d["proposed_tokens"] else None,
                              "tokens_per_verify_step": round((d["accepted_tokens"] + d["verify_steps"])
                                                              / d["verify_steps"], 3)
                              if d["verify_steps"] else None}
    return out


def run_case(running: dict[str, tuple[Server, str]], args: argparse.Namespace, name: str, c: int) -> dict[str, dict]:
    """One workload at one concurrency on every server, round by round: each round sends its c
    conversations to each server in turn, the order rotating, so a load on the machine that drifts
    during the run weighs on every server alike (two cores shared with other work)."""
    rounds = args.requests if c == 1 else max(1, -(-args.requests // c))
    workload = make_spec_workload(name, rounds * c, args.seed + 10 * c)
    labels = list(running)
    results: dict[str, list] = {label: [] for label in labels}
    seconds = dict.fromkeys(labels, 0.0)
    spec: dict[str, dict[str, float]] = {}
    for label in labels:
        server, url = running[label]
        spec[label] = spec_counters(url) if server.is_stratum else {}
    for r in range(rounds):
        part = Workload(name, WorkloadConfig(num_requests=c, seed=args.seed),
                        workload.conversations[r * c : (r + 1) * c])
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            server, url = running[label]
            done, wall = measure(url, "default" if not server.is_stratum else args.model, part, c, args.max_tokens)
            for res in done:
                res.conversation += r * c
            results[label] += done
            seconds[label] += wall
    out = {}
    for label in labels:
        server, url = running[label]
        counters = None
        if server.is_stratum:
            after = spec_counters(url)
            counters = {k: after[k] - spec[label][k] for k in after}
        out[label] = case_doc(results[label], seconds[label], counters)
        print(f"{label} {name} c={c}: decode {out[label]['decode_tok_s_per_stream']} tok/s per stream, "
              f"{out[label]['output_tok_s']} tok/s", file=sys.stderr, flush=True)
    return out


def run_all(chosen: list[Server], args: argparse.Namespace, log_dir: Path) -> dict[str, dict]:
    """Start every server, warm each, run every case on all of them (`run_case`), stop them."""
    procs: list[subprocess.Popen] = []
    running: dict[str, tuple[Server, str]] = {}
    try:
        for server in chosen:
            proc, url = start(server, log_dir / f"{server.label}.log")
            procs.append(proc)
            running[server.label] = (server, url)
        for server, url in running.values():
            warm = make_spec_workload("unique", 2, args.seed + 1000)  # distinct prompts: warm, not cached
            model = args.model if server.is_stratum else "default"
            run_level(Target(url, "openai", model, max_tokens=16), warm, LoadConfig(concurrency=1), progress=False)
        results: dict[str, dict] = {label: {} for label in running}
        for name in args.workloads:
            for c in args.concurrency:
                for label, case in run_case(running, args, name, c).items():
                    results[label].setdefault(name, {})[str(c)] = case
        return results
    finally:
        for proc in procs:
            stop(proc)


def compare(results: dict[str, dict]) -> dict:
    """Per server, workload and concurrency: decode tok/s per stream and output tok/s as ratios, whether
    every answer equals the reference's, and the goals met or missed. Stratum's servers and plain
    llama-server are set against `stratum-off`; llama-server's speculative ones against plain llama-server
    (their answers come from its own numerics), and against `stratum-off` too."""
    out: dict[str, Any] = {}
    for label, by_workload in results.items():
        refs = ["llama-server", "stratum-off"] if label.startswith("llama-server-") else ["stratum-off"]
        for ref_label in refs:
            if label == ref_label or ref_label not in results:
                continue
            for name, by_c in by_workload.items():
                for c, case in by_c.items():
                    ref = results[ref_label].get(name, {}).get(c)
                    if ref is None:
                        continue
                    row: dict[str, Any] = {"against": ref_label}
                    row.update({key: round(case[key] / ref[key], 3) if case.get(key) and ref.get(key) else None
                                for key in ("decode_tok_s_per_stream", "output_tok_s")})
                    row["identical_answers"] = case["answers"] == ref["answers"]
                    goal = GOALS.get((name, int(c))) if label == "stratum" else None
                    if goal is not None and row["decode_tok_s_per_stream"] is not None:
                        row["goal"] = goal
                        row["goal_met"] = row["decode_tok_s_per_stream"] >= goal
                    key = label if ref_label == refs[0] else f"{label} vs {ref_label}"
                    out.setdefault(key, {}).setdefault(name, {})[c] = row
    return out


def main(argv: list[str] | None = None) -> int:
    """`stratum bench speculative`: start each server, run every workload on it, print the JSON."""
    from stratum.kernels.cpu import cpu_name
    from stratum.models.registry import model_path, resolve_model_path

    p = argparse.ArgumentParser(prog="stratum bench speculative", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registered name or GGUF file (default: %(default)s)")
    p.add_argument("--draft-model", default=None, help="a draft GGUF with the model's tokenizer (adds draft columns)")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (adds its columns)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), type=lambda s: [w for w in s.split(",") if w])
    p.add_argument("--concurrency", default="1,8", type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--requests", type=int, default=3,
                   help="rounds at one stream (one request each); at c > 1, requests in rounds of c "
                        "(at least one round)")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None,
                   help="every server's threads (default: Stratum's own choice, llama-server every core)")
    p.add_argument("--only", default=None, help="comma-separated server labels to run (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=Path("bench-speculative-logs"))
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    for name in args.workloads:
        if name not in WORKLOADS:
            p.error(f"unknown workload {name!r}")
    path = str(resolve_model_path(args.model)) if Path(args.model).exists() else str(model_path(args.model))
    chosen = servers(args, path)
    if args.only:
        keep = set(args.only.split(","))
        chosen = [s for s in chosen if s.label in keep or s.label == "stratum-off"]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results = run_all(chosen, args, args.log_dir)
    doc = {"benchmark": "speculative",
           "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
           "config": {"model": args.model, "draft_model": args.draft_model, "llama_server": args.llama_server,
                      "workloads": args.workloads, "concurrency": args.concurrency, "requests": args.requests,
                      "max_tokens": args.max_tokens, "seed": args.seed, "temperature": 0.0},
           "results": results, "against_baseline": compare(results)}
    if not args.llama_server:
        doc["llama_server"] = "not run: no --llama-server binary given"
    emit(doc, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
