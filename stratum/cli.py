"""The `stratum` command: pull, serve, chat, generate, info, trace, warmup, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stratum.home import stratum_home

if TYPE_CHECKING:
    from stratum.engine.client import EngineClient


def _engine_config(args, serving: bool = False):
    from stratum.engine.config import EngineConfig, SchedulerConfig

    return EngineConfig(
        serving=serving,
        defer_kernels=serving,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        activations=args.activations,
        kv_cache_memory_mb=args.kv_cache_mb,
        max_model_len=args.max_model_len,
        rope_scaling=args.rope_scaling, rope_scale=args.rope_scale, yarn_orig_ctx=args.yarn_orig_ctx,
        enable_prefix_cache=not args.no_prefix_cache, kv_disk_gb=args.kv_disk_gb, kv_disk_dir=args.kv_disk_dir,
        num_threads=args.threads,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_num_seqs,
                                  max_waiting=args.max_waiting),
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        draft_model=args.draft_model,
    )


THREADS_HELP = ("engine threads (default: $STRATUM_NUM_THREADS, else every core, of which the native step's kernel "
                "plan may take fewer; a server on the PyTorch step leaves one to its HTTP side, and --replicas "
                "share the cores but one)")


def _add_activations_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", default="int16", choices=["int16", "int8"],
                   help="how the native step quantizes activation blocks: int16 (the numerics rule) or int8 "
                        "(as llama.cpp: about twice the multiply-adds per instruction on AVX2, a little lower "
                        "agreement with fp32; docs/numerics.md)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or Hugging Face folder")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: the numerics rule (fp32 on the CPU; docs/numerics.md); bfloat16 trades precision "
                        "for speed and KV memory")
    _add_activations_arg(p)
    p.add_argument("--kv-cache-mb", type=int, default=None,
                   help="memory for the KV pool (default: room for 16,384 tokens, or the context up to 32,768, "
                        "within a quarter of the free memory; at least 256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's trained context; beyond it needs --rope-scaling)")
    p.add_argument("--rope-scaling", default=None, choices=["none", "linear", "yarn"],
                   help="extend the context beyond the trained one by scaling RoPE positions (default: none)")
    p.add_argument("--rope-scale", type=float, default=None,
                   help="the context scaling factor (default: --max-model-len / the trained context)")
    p.add_argument("--yarn-orig-ctx", type=int, default=None,
                   help="the context the scaling extends (default: the model's trained context)")
    p.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step (prefill chunk)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=256, help="waiting-queue cap; beyond it 529 overloaded")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--kv-disk-gb", type=float, default=None,
                   help="the prefix cache's disk tier bound in GiB (default: a tenth of the free disk, at most 16; "
                        "0: off)")
    p.add_argument("--kv-disk-dir", default=None, help="the disk tier's folder (default: $STRATUM_HOME/kv)")
    p.add_argument("--speculative", default="auto", choices=["auto", "off", "ngram", "draft"],
                   help="speculative decoding: auto (default) proposes by prompt lookup, or by --draft-model, "
                        "per request where the measured step cost and its acceptance say it pays; ngram / draft: "
                        "that proposer whenever it has a proposal; off: never")
    p.add_argument("--num-speculative-tokens", type=int, default=16,
                   help="the most tokens proposed per request and step")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="the shortest n-gram prompt lookup matches")
    p.add_argument("--prompt-lookup-max", type=int, default=5, help="the longest n-gram prompt lookup matches")
    p.add_argument("--draft-model", default=None, metavar="FILE",
                   help="a smaller model with the same tokenizer (GGUF file or folder) that proposes tokens")
    p.add_argument("--engine", default="process", choices=["process", "thread"],
                   help="where the engine loop runs: a process of its own (default), or a thread of the server "
                        "(with --replicas, each replica's process runs it)")


def cmd_pull(args) -> int:
    from stratum.models.registry import PullError, pull

    try:
        pull(args.name)
    except PullError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.no_prepare:
        try:
            prepare(args.name)
        except Exception as e:  # the model is pulled; the first serve prepares it, and reports why if it cannot
            print(f"{args.name}: pulled, not prepared ({type(e).__name__}: {e}); the first serve will prepare it",
                  file=sys.stderr)
    return 0


def prepare(model: str) -> None:
    """What a first `serve` of `model` would do in the background, done now so that it starts
    straight on the prepared kernels (`engine.prepare`)."""
    from stratum.engine.config import EngineConfig
    from stratum.engine.prepare import prepare as prepare_kernels
    from stratum.kernels import native

    t0 = time.perf_counter()
    resolved = prepare_kernels(EngineConfig(model=model, serving=True))
    numerics, plan = resolved.numerics, resolved.kernel_plan
    step = "native step" if numerics.step == "native" else f"PyTorch step, {numerics.dtype}"
    print(f"{model}: kernels {native.status()}; {step} (numerics {numerics.key()[:12]}); kernel plan ({plan.source}): "
          f"{plan.threads} threads, {plan.basis}; ready to serve ({time.perf_counter() - t0:.1f}s)")


# Texts this long are tokenized in a helper process, off this process's interpreter lock (see
# TextTokenizer.offload_large_texts): a 3.8 MB count_tokens stalled other streams 235 ms without it.
LARGE_TEXT_CHARS = 256 * 1024


@dataclass(slots=True)
class StartUp:
    """What `serve`'s start-up thread brought up, read by the main thread once the server stops: the
    engine's client (shut down then, even if a later stage failed), and why the start-up failed."""

    client: EngineClient | None = None
    error: str | None = None


def cmd_serve(args) -> int:
    """The port opens at once and answers 503 while the engine starts (`server.startup`); a cold
    engine serves on the PyTorch step while it prepares its kernels (`engine.prepare`)."""
    import logging
    import threading

    from stratum.engine.process import EngineProcess, EngineStartError
    from stratum.models.registry import PullError

    t0 = time.perf_counter()
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.DEBUG),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = _engine_config(args, serving=True)
    refused = _refuse_replicas(args)
    if refused is not None:
        return refused
    refused = _refuse_any_origin(args)
    if refused is not None:
        return refused
    try:
        args.policy_store = _content_policy(args)
    except ValueError as e:  # policy.PolicyError: said before the engine loads
        print(f"stratum: --content-policy: {e}", file=sys.stderr)
        return 2
    # The engine process loads the model while this one opens the port and builds the web app.
    engine = (EngineProcess(config, _restart_policy(args)) if args.engine == "process" and args.replicas == 1
              else None)
    from stratum.server.startup import StartingApp

    name = args.served_model_name or args.model
    starting = StartingApp(name)
    server = _http_server(args, starting)
    up = StartUp()
    stopped = threading.Event()

    def bring_up() -> None:
        try:
            import stratum.server.app  # noqa: F401  (the web stack's imports, while the engine loads)

            client, where = _start_engine(args, config, engine, starting)
            up.client = client
            starting.stage = "starting server"
            app = _serving_app(args, client, name)
            starting.wait_listening()
            starting.serve(app)
            server.rt = app.state.runtime
            client.tokenizer.plain  # noqa: B018  (built now rather than by the first request)
        except (PullError, ValueError, EngineStartError) as e:
            # a bad model, a failed engine: said, and the server stops
            up.error = str(e)
        except Exception as e:
            logging.getLogger("stratum.server").exception("start-up failed")
            up.error = f"{type(e).__name__}: {e}"
        if up.error is not None:
            server.should_exit = True
            return
        _say_ready(client, name, time.perf_counter() - t0, where)
        if args.replicas > 1:
            # Ray spawns its own processes (the GCS, the raylet) with a parent-death signal, which Linux
            # sends when the *thread* that spawned them exits: this one stays until the server stops
            stopped.wait()

    threading.Thread(target=bring_up, name="stratum-start", daemon=True).start()
    print(f"stratum: listening on http://{args.host}:{args.port}; /health answers 503 until {name} is loaded",
          flush=True)
    try:
        server.run()
    finally:
        stopped.set()
        if up.client is not None:
            up.client.shutdown()
            up.client.tokenizer.close()
        elif engine is not None:
            engine.shutdown()
    if up.error is not None:
        print(f"error: {up.error}", file=sys.stderr)
        return 1
    return 0


def _restart_policy(args):
    """How the engine process is replaced when it dies (`engine/supervisor.py`), as the command line set it."""
    from stratum.engine.supervisor import RestartPolicy

    return RestartPolicy(max_restarts=max(0, args.engine_restarts), window_s=args.engine_restart_window_s)


def _refuse_replicas(args) -> int | None:
    """The exit status when --replicas cannot be served here, said on stderr; None when it can."""
    if args.replicas < 1:
        print("error: --replicas must be at least 1", file=sys.stderr)
        return 2
    if args.replicas > 1:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            print("error: --replicas needs Ray Serve: pip install 'stratum-serve[ray]'", file=sys.stderr)
            return 1
    return None


def _http_server(args, app):
    """The HTTP server (uvicorn, hardened: `server.http`) for app, as the command line set it."""
    import uvicorn

    from stratum.server.http import Server, protocol

    return Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                 http=protocol(args.max_connections, args.read_timeout_s),
                                 h11_max_incomplete_event_size=args.max_header_bytes,
                                 timeout_graceful_shutdown=5, loop="asyncio"),
                  None, args.drain_timeout_s)


def _say_ready(client, name: str, elapsed_s: float, where: str) -> None:
    cfg, kernels = client.config, client.info.kernel_choices
    later = ("; preparing the native kernels in the background"
             if kernels.get("native_kernels") == "being prepared" else "")
    trade = ", int8 activations" if kernels.get("activations") == "int8" else ""
    print(f"stratum: {name} ready in {elapsed_s:.1f}s on {cfg.device}/{cfg.dtype} ({kernels['step']} "
          f"step{trade}), KV pool of {cfg.num_kv_blocks * cfg.block_size:,} tokens, {cfg.num_threads} engine threads "
          f"in {where}{later}", flush=True)


def _start_engine(args, config, engine, starting):
    """(the engine client, where its loop runs): the engine process's (started already), a
    thread's, or Ray Serve replicas'."""
    if args.replicas > 1:
        from stratum.cluster import launch

        starting.stage = "starting replicas"
        client = launch.start(config, args.replicas, args.ray_address, args.routing)
        return client, f"each of {args.replicas} Ray Serve replicas, routed by {args.routing}"
    if engine is not None:
        starting.wait_listening()  # the server's event loop reads the engine's events
        return engine.connect(on_stage=lambda stage: setattr(starting, "stage", stage), loop=starting.loop), "a process"
    from stratum.engine.thread_transport import start_thread_engine
    from stratum.engine.core import EngineCore

    starting.stage = "loading model"
    return start_thread_engine(EngineCore(config)), "a thread"


def _refuse_any_origin(args) -> int | None:
    """`--allowed-origin '*'` lets any web page spend a key its user holds: with API keys it needs
    --allow-any-origin-with-keys."""
    keyed = any(args.api_key or ()) or os.environ.get("STRATUM_API_KEYS", "").strip()
    if "*" in (args.cors_origin or ()) and keyed and not args.allow_any_origin_with_keys:
        print("stratum: --allowed-origin '*' with API keys lets any web page call this server with a key its "
              "visitor holds; name the origins, or add --allow-any-origin-with-keys to mean it", file=sys.stderr)
        return 2
    return None


def _content_policy(args):
    """The content policy store, loaded now (a bad file stops the start-up), reloaded on SIGHUP."""
    if not args.content_policy:
        return None
    import signal

    from stratum.server.policy import PolicyStore

    store = PolicyStore(Path(args.content_policy))
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: store.mark_stale())
    print(f"stratum: content policy {args.content_policy}: {len(store.policy.rules)} rules "
          "(reloaded when the file changes or on SIGHUP)", flush=True)
    return store


def _serving_app(args, client, name: str):
    """The web app over client, with the settings the command line gave."""
    from stratum.server.app import ServerSettings, create_app
    from stratum.telemetry.cost import pricing_from_spec

    config = client.config
    keys = tuple(k for k in (args.api_key or []) if k)
    keys += tuple(k.strip() for k in os.environ.get("STRATUM_API_KEYS", "").split(",") if k.strip())
    settings = ServerSettings(model_name=name, aliases=(client.info.model_name,), api_keys=keys,
                              model_patterns=tuple(p for p in (args.serve_models_matching or ["claude-*"]) if p),
                              max_body_bytes=args.max_body_bytes, max_header_bytes=args.max_header_bytes,
                              max_header_count=args.max_header_count, share_prefix_cache=args.share_prefix_cache,
                              body_timeout_s=args.read_timeout_s, cors_origins=tuple(args.cors_origin or ()),
                              content_policy=getattr(args, "policy_store", None),
                              header_wait_s=args.header_wait_s, data_dir=Path(args.data_dir) if args.data_dir else None,
                              batch_ttl_s=args.batch_expiry_h * 3600,
                              batch_retention_s=args.batch_retention_days * 86400,
                              console=args.console == "on" or (args.console == "auto" and (
                                  args.host in ("127.0.0.1", "localhost", "::1") or bool(keys))),
                              default_temperature=config.default_temperature, default_top_p=config.default_top_p,
                              tenant_budget_tokens=args.tenant_budget_tokens, budget_window_s=args.budget_window_s,
                              pollution_policy=args.pollution_policy, pricing=pricing_from_spec(args.pricing),
                              responses_store_bytes=args.responses_store_mb * 2**20,
                              reasoning_format=args.reasoning_format,
                              restart_wait_s=args.restart_wait_s,
                              reasoning_budget=args.reasoning_budget if args.reasoning_budget >= 0 else None)
    client.tokenizer.offload_large_texts(LARGE_TEXT_CHARS)
    if keys:
        print(f"stratum: {len(keys)} API key{'s' if len(keys) != 1 else ''}; " + (
            "the prefix cache is SHARED across keys (--share-prefix-cache): a key can observe, through cache "
            "hits and their timing, prompts that another key sent" if args.share_prefix_cache else
            "each key is a tenant with a prefix cache of its own"), flush=True)
    return create_app(client, settings)


def cmd_generate(args) -> int:
    from stratum.engine.llm import LLM
    from stratum.engine.sampling_params import SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype, activations=args.activations)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    messages = [{"role": "user", "content": args.prompt}]
    t0 = time.perf_counter()
    out = llm.chat(messages, params) if not args.raw else llm.generate([args.prompt], params)[0]
    elapsed = time.perf_counter() - t0
    print(out.text)
    s = out.stats
    decode_s = (s.finish_time - s.first_token_time) if s.first_token_time else 0.0
    decode_tps = (s.num_output_tokens - 1) / decode_s if decode_s > 0 and s.num_output_tokens > 1 else 0.0
    print(f"[{s.num_prompt_tokens} prompt + {s.num_output_tokens} output tokens in {elapsed:.2f}s; "
          f"prefill {1000 * (s.prefill_s or 0):.0f} ms; decode {decode_tps:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    """Chat in the terminal with a running server (--url), or with one started for the session (--model)."""
    from stratum.client import terminal

    proc = None
    url = args.url
    try:
        if url is None:
            print(f"stratum: starting {args.model}...", file=sys.stderr, flush=True)
            proc, url = terminal.local_server(args.model, ["--data-dir", ""])
        model = args.served_model_name or httpx_model(url, args.api_key) or args.model
        print(f"stratum: chatting with {model} at {url} (/reset, /exit)", file=sys.stderr, flush=True)
        return terminal.repl(url, model, args.api_key, args.max_tokens, args.system)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


def httpx_model(url: str, api_key: str | None) -> str | None:
    """The model a server serves, from /v1/models."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers={"x-api-key": api_key} if api_key else {}, timeout=10)
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def cmd_info(args) -> int:
    from stratum.info import print_info

    return print_info(args)


def cmd_trace(args) -> int:
    from stratum.telemetry.trace import decode_trace

    value = args.value if args.value != "-" else sys.stdin.read()
    value = value.split(":", 1)[1] if value.lower().startswith("x-stratum-trace:") else value
    try:
        doc = decode_trace(value)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2, ensure_ascii=False))
    return 0


def cmd_warmup(args) -> int:
    """Prefill and pin each prompt of FILE on a running server (max_tokens 0)."""
    from stratum.client.warmup import read_prompts, warmup_http

    try:
        prompts = read_prompts(args.file)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = warmup_http(args.url, args.model, prompts, api_key=args.api_key)
    print(json.dumps(report, indent=2))
    return 0 if report["failed"] == 0 else 1


BENCHMARKS = ("offline", "serve", "compare", "roofline", "soak", "constrained", "batch", "cluster", "startup",
              "speculative", "disktier", "policy", "fuzz")


def cmd_bench(args, rest) -> int:
    """Each benchmark is a program of its own, `stratum.bench.<kind>.main(argv)`."""
    import importlib

    return importlib.import_module(f"stratum.bench.{args.kind}").main(rest)


# ---- the command line: one function per command's arguments ---------------------------------------
def _pull_parser(sub) -> None:
    p = sub.add_parser("pull",
                       help="fetch a registered model into $STRATUM_HOME/models and prepare it for this machine")
    p.add_argument("name", nargs="?", default="smollm2-135m")
    p.add_argument("--no-prepare", action="store_true",
                   help="only fetch: do not build the native kernels or measure the kernel plan now "
                        "(the first serve will)")
    p.set_defaults(func=cmd_pull)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the Anthropic and OpenAI APIs")
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", action="append", help="accepted API key (repeatable); also STRATUM_API_KEYS=k1,k2")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--serve-models-matching", action="append", metavar="GLOB", default=None,
                   help="other model names the loaded model answers to (repeatable; default 'claude-*', so "
                        "Anthropic's clients work unchanged; '' to answer to the served name only)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    p.add_argument("--max-header-bytes", type=int, default=32 * 1024, help="larger request headers get 431")
    p.add_argument("--max-header-count", type=int, default=256, help="requests with more headers get 431")
    p.add_argument("--max-connections", type=int, default=1024, help="requests on connections beyond this get 529")
    p.add_argument("--read-timeout-s", type=float, default=30.0,
                   help="headers that take longer to arrive, or a body that stalls this long, get 408")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may still run before they are ended with an error")
    p.add_argument("--engine-restarts", type=int, default=5,
                   help="an engine process that dies is replaced (bounded backoff), up to this many times within "
                        "--engine-restart-window-s; the next death is a crash loop and the engine stays dead "
                        "(0: never replaced; the Ray replicas of --replicas restart by Ray's rules)")
    p.add_argument("--engine-restart-window-s", type=float, default=300.0)
    p.add_argument("--restart-wait-s", type=float, default=5.0,
                   help="a request arriving while the engine is replaced waits this long, then gets 503 with "
                        "retry-after")
    p.add_argument("--data-dir", default=str(stratum_home() / "data"),
                   help="where Message Batches and the tenants' budget windows are kept, in SQLite "
                        "(default $STRATUM_HOME/data); '' to serve no batches and keep budgets in memory")
    p.add_argument("--batch-expiry-h", type=float, default=24.0, help="a batch expires this long after creation")
    p.add_argument("--batch-retention-days", type=float, default=29.0,
                   help="results are kept this long after a batch ends")
    p.add_argument("--responses-store-mb", type=int, default=64,
                   help="stored Responses API responses, kept in memory up to this much JSON (oldest dropped first)")
    p.add_argument("--console", choices=["auto", "on", "off"], default="auto",
                   help="the web console at /console; auto: on when serving loopback only or with API keys")
    p.add_argument("--header-wait-s", type=float, default=2.0,
                   help="a stream waits this long for prefill, to send its cost figures with its headers (default 2)")
    p.add_argument("--allowed-origin", "--cors-origin", dest="cors_origin", action="append", metavar="ORIGIN",
                   help="let web pages from this origin call the API (CORS; repeatable; '*' for any, which with API "
                        "keys needs --allow-any-origin-with-keys); default: none")
    p.add_argument("--allow-any-origin-with-keys", action="store_true",
                   help="accept --allowed-origin '*' on a server with API keys")
    p.add_argument("--content-policy", metavar="FILE",
                   help="screen prompts and streamed answers with this policy's rules (JSON or YAML; see README)")
    p.add_argument("--share-prefix-cache", action="store_true",
                   help="with API keys: share cached prompts across keys (one organisation); default: a cache per key")
    p.add_argument("--tenant-budget-tokens", type=int, default=None,
                   help="admission by cost: tokens a tenant may spend per window (default: unlimited)")
    p.add_argument("--budget-window-s", type=float, default=60.0)
    p.add_argument("--pollution-policy", default="advise", choices=["reject", "advise", "off"])
    p.add_argument("--reasoning-format", default="auto", choices=["auto", "none"],
                   help="a reasoning model's thought: auto returns it apart (thinking blocks, reasoning_content, "
                        "reasoning items); none leaves it in the answer's text as the model wrote it")
    p.add_argument("--reasoning-budget", type=int, default=-1,
                   help="thought tokens before the runtime ends a thought, for requests that set no budget "
                        "(-1: no budget, max_tokens alone)")
    p.add_argument("--pricing", default="article", help="article[:k=v,...] or tokens[:k=v,...] (see docs/telemetry.md)")
    p.add_argument("--replicas", type=int, default=1,
                   help="engine replicas on Ray Serve behind this server, routed by prefix (default 1: no Ray)")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: the Ray cluster to join (auto, or the head's host:port); "
                        "default: start one here")
    p.add_argument("--routing", default="prefix", choices=["prefix", "round-robin", "power-of-two"],
                   help="with --replicas: how a request picks its replica (default: the one holding its prefix)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_serve)


def _chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat in the terminal, streaming, with each answer's cost")
    p.add_argument("--url", default=None, help="a running server; without it one is started for the session")
    p.add_argument("--model", default="smollm2-135m", help="the model a session's own server runs")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=os.environ.get("STRATUM_API_KEY"))
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=512)
    p.set_defaults(func=cmd_chat)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt (chat-formatted unless --raw)")
    p.add_argument("prompt")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    _add_activations_arg(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.set_defaults(func=cmd_generate)


def _info_parser(sub) -> None:
    p = sub.add_parser("info", help="hardware, the model's architecture and tensor types, what runs packed, "
                                    "and the kernel plan")
    p.add_argument("file", nargs="?", default=None, help="a .gguf file or Hugging Face folder (default: --model)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="as `serve --dtype`")
    _add_activations_arg(p)
    p.add_argument("--remeasure", action="store_true", help="measure the kernel plan again and cache the new one")
    p.set_defaults(func=cmd_info)


def _trace_parser(sub) -> None:
    p = sub.add_parser("trace", help="decode an x-stratum-trace header")
    p.add_argument("action", choices=["decode"])
    p.add_argument("value", help="the header value (base64), or - for stdin")
    p.set_defaults(func=cmd_trace)


def _warmup_parser(sub) -> None:
    p = sub.add_parser("warmup", help="prefill and pin prompts on a running server")
    p.add_argument("file", help="a text file (one prompt per line) or JSONL "
                                "({\"system\":..., \"messages\":[...]} per line)")
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key", default=None)
    p.set_defaults(func=cmd_warmup)


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: offline, serve, compare, roofline, soak, constrained, batch, "
                                     "cluster, startup, speculative, disktier, fuzz (each takes --help)",
                       add_help=False)
    p.add_argument("kind", choices=BENCHMARKS)
    p.set_defaults(func=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stratum", description="Stratum LLM serving runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_pull_parser, _serve_parser, _chat_parser, _generate_parser, _info_parser, _trace_parser,
                _warmup_parser, _bench_parser):
        add(sub)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
