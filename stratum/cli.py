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

from stratum.cli_args import THREADS_HELP, add_activations_arg, add_engine_args, add_serve_args

if TYPE_CHECKING:
    from stratum.engine.client import EngineClient
    from stratum.server.models import ModelSet


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
                                  max_waiting=args.max_waiting, max_itl_ms=args.max_itl_ms),
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        draft_model=args.draft_model, pooling=getattr(args, "pooling", None),
    )


def cmd_pull(args) -> int:
    from stratum.models.registry import PullError, pull

    try:
        pull(args.name)
    except PullError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from stratum.models.bert import is_encoder
    from stratum.models.registry import model_path

    if is_encoder(model_path(args.name)):  # an encoder runs on PyTorch's step: no kernels to prepare
        return 0
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


@dataclass(slots=True)
class StartUp:
    """What `serve`'s start-up thread brought up, read by the main thread once the server stops: the
    engine's client (shut down then, even if a later stage failed), and why the start-up failed."""

    client: EngineClient | None = None
    error: str | None = None
    models: ModelSet | None = None  # every model's engine, once the app is built (the first's is `client`)


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
    refused = _refuse_serving(args)
    if refused is not None:
        return refused
    specs = args.specs
    config = specs[0].config
    # The engine process loads the model while this one opens the port and builds the web app.
    engine = (EngineProcess(config, _restart_policy(args)) if args.engine == "process" and args.replicas == 1
              else None)
    from stratum.server.startup import StartingApp

    name = specs[0].name
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
            app = _serving_app(args, client, specs)
            up.models = app.state.runtime.models
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
        if up.models is not None:
            up.models.shutdown()
        elif up.client is not None:
            up.client.shutdown()
            up.client.tokenizer.close()
        elif engine is not None:
            engine.shutdown()
    if up.error is not None:
        print(f"error: {up.error}", file=sys.stderr)
        return 1
    return 0


def _refuse_serving(args) -> int | None:
    """The exit status when the command line cannot be served, said on stderr; None when it can (then
    `args.specs` holds the models, and `args.policy_store` the content policy)."""
    from stratum.models.registry import PullError

    try:
        args.specs = _model_specs(args)
    except (PullError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if len(args.specs) > 1 and args.replicas > 1:
        print("error: --replicas serves one model; serve several models without it", file=sys.stderr)
        return 2
    refused = _refuse_replicas(args)
    if refused is None:
        refused = _refuse_any_origin(args)
    if refused is not None:
        return refused
    try:
        args.policy_store = _content_policy(args)
    except ValueError as e:  # policy.PolicyError: said before the engine loads
        print(f"stratum: --content-policy: {e}", file=sys.stderr)
        return 2
    return None


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
    from stratum.engine.encoder import make_engine

    starting.stage = "loading model"
    return start_thread_engine(make_engine(config)), "a thread"


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


def _model_specs(args):
    """The models `serve` serves, the first the default: each --model, then what --models-dir holds; with
    neither, the default registered model, then every model pulled into $STRATUM_HOME/models."""
    from stratum.home import stratum_home
    from stratum.server.models import model_specs

    entries, dirs = list(args.model or []), [Path(d) for d in args.models_dir or []]
    if not entries and not dirs:
        entries, dirs = ["smollm2-135m"], [stratum_home() / "models"]
    args.model = entries[0] if entries else None
    base = _engine_config(args, serving=True)
    kind = "thread" if args.engine == "thread" else "process"
    specs = model_specs(entries, dirs, base, args.served_model_name, engine=kind, restarts=_restart_policy(args))
    if not specs:
        raise ValueError(f"no model found under {', '.join(map(str, dirs))}")
    return specs


def _model_set(args, client, specs):
    """The served models: the first running on `client` already, the others started on first use."""
    from stratum.engine.config import host_free_memory
    from stratum.server.models import ModelSet, keep_alive_seconds

    budget = args.models_memory_mb * 2**20 if args.models_memory_mb else int(0.9 * host_free_memory()) + sum(
        s.weight_bytes + s.kv_bytes for s in specs[:1])  # free at start, the first model loaded already
    models = ModelSet(specs, memory_bytes=budget, keep_alive_s=keep_alive_seconds(args.keep_alive),
                      load_wait_s=args.model_load_wait_s,
                      patterns=tuple(p for p in (args.serve_models_matching or ["claude-*"]) if p))
    models.adopt(models.default, client)
    return models


def _serving_app(args, client, specs):
    """The web app over the served models (the first on `client`), with the settings the command line gave."""
    from stratum.server.app import ServerSettings, create_app
    from stratum.telemetry.cost import pricing_from_spec

    config, name = client.config, specs[0].name
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
    from stratum.server.models import LARGE_TEXT_CHARS

    client.tokenizer.offload_large_texts(LARGE_TEXT_CHARS)
    if keys:
        print(f"stratum: {len(keys)} API key{'s' if len(keys) != 1 else ''}; " + (
            "the prefix cache is SHARED across keys (--share-prefix-cache): a key can observe, through cache "
            "hits and their timing, prompts that another key sent" if args.share_prefix_cache else
            "each key is a tenant with a prefix cache of its own"), flush=True)
    return create_app(_model_set(args, client, specs), settings)


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
    """Chat in the terminal with a running server (--url; --model picks one of its models, by default its
    first), or with one started for the session (serving --model, by default smollm2-135m)."""
    from stratum.client import terminal

    proc = None
    url = args.url
    try:
        if url is None:
            print(f"stratum: starting {args.model or 'smollm2-135m'}...", file=sys.stderr, flush=True)
            proc, url = terminal.local_server(args.model or "smollm2-135m", ["--data-dir", ""])
            model = args.served_model_name or httpx_model(url, args.api_key) or args.model
        else:
            served = server_models(url, args.api_key)
            model = args.served_model_name or args.model or (served[0] if served else None)
            if model is None or (args.model and served and not _is_served(url, args.api_key, model)):
                print(f"error: {url} does not serve {model!r}; it serves {', '.join(served) or 'nothing'}",
                      file=sys.stderr)
                return 1
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
    """The model a server serves first (its default), from /v1/models."""
    served = server_models(url, api_key)
    return served[0] if served else None


def server_models(url: str, api_key: str | None) -> list[str]:
    """The models a server serves, from /v1/models (none where it does not answer)."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers={"x-api-key": api_key} if api_key else {}, timeout=10)
        return [m["id"] for m in r.json()["data"]]
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return []


def _is_served(url: str, api_key: str | None, model: str) -> bool:
    """Whether the server runs `model` (a served name, an alias or a name its patterns match)."""
    import httpx
    from urllib.parse import quote

    try:
        r = httpx.get(f"{url}/v1/models/{quote(model, safe='')}", headers={"x-api-key": api_key} if api_key else {},
                      timeout=10)
        return r.status_code == 200
    except httpx.HTTPError:
        return True  # said by the first answer instead


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
              "speculative", "disktier", "policy", "fuzz", "agent", "rag")


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
    add_engine_args(p, several=True)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)


def _chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat in the terminal, streaming, with each answer's cost")
    p.add_argument("--url", default=None, help="a running server; without it one is started for the session")
    p.add_argument("--model", default=None,
                   help="with --url, which of the server's models to chat with (default: its first); without, "
                        "the model a session's own server runs (default: smollm2-135m)")
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
    add_activations_arg(p)
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
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                   help="a model to report on, as `serve --model` takes it (repeatable; default smollm2-135m)")
    p.add_argument("--models-dir", action="append", default=None, metavar="DIR",
                   help="also every model under DIR, as `serve --models-dir` finds them")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="as `serve --dtype`")
    add_activations_arg(p)
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
    p = sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHMARKS)} (each takes --help)",
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
