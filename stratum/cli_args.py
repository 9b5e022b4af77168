"""The arguments of `stratum serve` and of the commands that start an engine (`stratum.cli` reads them)."""

from __future__ import annotations

import argparse

from stratum.home import stratum_home

THREADS_HELP = ("engine threads (default: $STRATUM_NUM_THREADS, else every core, of which the native step's kernel "
                "plan may take fewer; a server on the PyTorch step leaves one to its HTTP side, and --replicas "
                "share the cores but one)")


def add_activations_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", default="int16", choices=["int16", "int8"],
                   help="how the native step quantizes activation blocks: int16 (the numerics rule) or int8 "
                        "(as llama.cpp: about twice the multiply-adds per instruction on AVX2, a little lower "
                        "agreement with fp32; docs/numerics.md)")


def add_engine_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    """The engine's arguments; with `several`, --model is repeatable (a server of several models)."""
    if several:
        p.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                       help="a model to serve: registered name, .gguf file or Hugging Face folder, optionally named "
                            "NAME=...; repeatable (the first is the default, loaded at start; the others start on "
                            "first use). Default: smollm2-135m and every model pulled into $STRATUM_HOME/models")
    else:
        p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or Hugging Face folder")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: the numerics rule (fp32 on the CPU; docs/numerics.md); bfloat16 trades precision "
                        "for speed and KV memory")
    add_activations_arg(p)
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
    p.add_argument("--max-itl-ms", type=float, default=200.0,
                   help="while any request decodes, size each step's prefill chunks by the measured step cost so "
                        "no decoding request waits longer than this for its next token (default 200; 0: off, "
                        "prefill chunks of --max-batched-tokens always)")
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
    p.add_argument("--pooling", default=None, choices=["mean", "last"],
                   help="also serve embeddings (/v1/embeddings, /api/embed) from a chat model: the mean or the last "
                        "token of its final hidden states, at unit length (as llama-server's --pooling); an "
                        "encoder (BERT) pools as its files say")
    p.add_argument("--engine", default="process", choices=["process", "thread"],
                   help="where the engine loop runs: a process of its own (default), or a thread of the server "
                        "(with --replicas, each replica's process runs it)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The server's own: its address, keys, limits, lifecycle, batches, CORS, policies, budgets and replicas."""
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
    add_models_args(p)
    p.add_argument("--log-level", default="warning")


def add_models_args(p: argparse.ArgumentParser) -> None:
    """A server of several models (`server/models.py`): where they are found, how long they stay loaded,
    what they may take."""
    p.add_argument("--models-dir", action="append", default=None, metavar="DIR",
                   help="serve every GGUF file and Hugging Face folder under DIR too, named by file or folder "
                        "(repeatable; without --model, $STRATUM_HOME/models is served)")
    p.add_argument("--keep-alive", default="5m",
                   help="how long a model stays loaded after its last request, as Ollama's keep_alive (\"5m\", "
                        "seconds; 0 unloads at once; negative: forever); requests may set their own (Ollama's "
                        "keep_alive, X-Stratum-Keep-Alive). The first model stays loaded unless another needs its "
                        "memory")
    p.add_argument("--models-memory-mb", type=int, default=None,
                   help="what the loaded models may take together (weights' files + KV pools); a model that does "
                        "not fit unloads the least recently used idle ones (default: 90%% of the memory free at "
                        "start)")
    p.add_argument("--model-load-wait-s", type=float, default=120.0,
                   help="a request for a model that is loading waits this long, then gets 503 with retry-after")
