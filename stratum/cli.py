"""The `stratum` command: pull, serve, generate, info, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _engine_config(args):
    from stratum.config import EngineConfig, SchedulerConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory_mb=args.kv_cache_mb,
        max_model_len=args.max_model_len,
        enable_prefix_cache=not args.no_prefix_cache,
        num_threads=args.threads,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_num_seqs,
                                  max_waiting=args.max_waiting),
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or Hugging Face folder")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--kv-cache-mb", type=int, default=256, help="memory for the KV pool")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step (prefill chunk)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=256, help="waiting-queue cap; beyond it 529 overloaded")
    p.add_argument("--threads", type=int, default=None, help="engine threads (serve default: cores - 1)")
    p.add_argument("--no-prefix-cache", action="store_true")


def cmd_pull(args) -> int:
    from stratum.models.registry import PullError, pull

    try:
        pull(args.name)
    except PullError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_serve(args) -> int:
    import uvicorn

    from stratum.engine import AsyncEngine, LLMEngine
    from stratum.models.registry import PullError, sampling_defaults
    from stratum.server.app import ServerSettings, create_app
    from stratum.telemetry.cost import pricing_from_spec

    t0 = time.perf_counter()
    if args.threads is None and not os.environ.get("STRATUM_NUM_THREADS"):
        # Leave a core to the HTTP side (event loop, SSE, clients on the same host): measured on the
        # 2-core reference machine, 1 engine thread served 1.6x (one stream) and 1.16x (32 streams)
        # the tokens/s of 2 threads, whose spin-waiting lost to the server's own work.
        args.threads = max(1, (os.cpu_count() or 1) - 1)
    try:
        engine = LLMEngine(_engine_config(args))
    except (PullError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    keys = tuple(k for k in (args.api_key or []) if k)
    keys += tuple(k.strip() for k in os.environ.get("STRATUM_API_KEYS", "").split(",") if k.strip())
    name = args.served_model_name or args.model
    defaults = sampling_defaults(args.model)
    settings = ServerSettings(model_name=name, aliases=(engine.model_config.name,), api_keys=keys,
                              max_body_bytes=args.max_body_bytes,
                              default_temperature=defaults.get("temperature", 1.0), default_top_p=defaults.get("top_p", 1.0),
                              tenant_budget_tokens=args.tenant_budget_tokens, budget_window_s=args.budget_window_s,
                              pollution_policy=args.pollution_policy, pricing=pricing_from_spec(args.pricing))
    app = create_app(AsyncEngine(engine), settings)
    print(f"stratum: {name} loaded in {time.perf_counter() - t0:.1f}s on {engine.config.device}/{engine.config.dtype}, "
          f"{engine.block_manager.num_blocks} KV blocks; serving on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def cmd_generate(args) -> int:
    from stratum.engine import LLM
    from stratum.sampling_params import SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, ignore_eos=args.ignore_eos)
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


def cmd_info(args) -> int:
    """The hardware, and the kernel plan for a model with the measured times behind it."""
    import platform

    import torch

    from stratum.layers import native
    from stratum.layers.kernels import cpu_flags, cpu_name, select_plan
    from stratum.layers.quant import is_packable
    from stratum.models.loader import load_checkpoint
    from stratum.models.registry import PullError, resolve_model_path, stratum_home

    flags = cpu_flags()
    info = {
        "python": platform.python_version(), "torch": torch.__version__, "cpu": cpu_name(),
        "cpu_count": os.cpu_count(), "cpu_features": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cuda": torch.cuda.is_available(),
        "native_kernels": native.status(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    try:
        ck = load_checkpoint(resolve_model_path(args.model))
    except (PullError, ValueError) as e:
        info["plan_error"] = str(e)
    else:
        threads = args.threads or os.cpu_count() or 1
        can_pack = any(is_packable(t.qtype) for t in ck.quantized.values())
        plan = select_plan(stratum_home(), ck.config.hidden_size, ck.config.intermediate_size, threads, can_pack)
        info["model"] = args.model
        info["kernel_plan"] = plan.describe()
    print(json.dumps(info, indent=2))
    return 0


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


BENCHMARKS = ("offline", "serve", "compare", "roofline")


def cmd_bench(args, rest) -> int:
    """Each benchmark is a program of its own, `stratum.bench.<kind>.main(argv)`."""
    import importlib

    return importlib.import_module(f"stratum.bench.{args.kind}").main(rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stratum", description="Stratum LLM serving runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch a registered model into $STRATUM_HOME/models")
    p.add_argument("name", nargs="?", default="smollm2-135m")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("serve", help="serve the Anthropic and OpenAI APIs")
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", action="append", help="accepted API key (repeatable); also STRATUM_API_KEYS=k1,k2")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    p.add_argument("--tenant-budget-tokens", type=int, default=None,
                   help="admission by cost: estimated tokens a tenant may spend per window (default: unlimited)")
    p.add_argument("--budget-window-s", type=float, default=60.0)
    p.add_argument("--pollution-policy", default="advise", choices=["reject", "advise", "off"])
    p.add_argument("--pricing", default="article", help="article[:k=v,...] or tokens[:k=v,...] (see docs/telemetry.md)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="complete one prompt (chat-formatted unless --raw)")
    p.add_argument("prompt")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("info", help="hardware, and the kernel plan with its measured times")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=None, help="engine threads (serve default: cores - 1)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("trace", help="decode an x-stratum-trace header")
    p.add_argument("action", choices=["decode"])
    p.add_argument("value", help="the header value (base64), or - for stdin")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("warmup", help="prefill and pin prompts on a running server")
    p.add_argument("file", help="a text file (one prompt per line) or JSONL ({\"system\":..., \"messages\":[...]} per line)")
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key", default=None)
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("bench", help="benchmarks: offline, serve, compare, roofline (each takes --help)", add_help=False)
    p.add_argument("kind", choices=BENCHMARKS)
    p.set_defaults(func=None)

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
