"""`stratum chat`: an interactive terminal chat over the Messages API, streaming, with each answer's cost.

It talks to a running server (`--url`), or starts one of its own on a free loopback port for the
session (`--model`). After each answer it prints the measured cost line: the `x-stratum-cost`
figures, the request's price under the server's pricing model, its tokens and speed. Commands:
`/reset` forgets the conversation, `/exit` (or end of input) leaves.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import IO, Iterator

import httpx


def _events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    event = None
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:") and event:
            yield event, json.loads(line[5:])


def cost_line(cost: dict, usage: dict, seconds: float) -> str:
    tokens = usage.get("output_tokens", 0)
    prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0) + usage.get(
        "cache_creation_input_tokens", 0)
    speed = f", {tokens / seconds:.1f} tok/s" if seconds > 0 and tokens else ""
    return (f"[{cost.get('header', '')} | ${cost.get('final_cost_estimate', 0):.6f} | {prompt} prompt tokens "
            f"({usage.get('cache_read_input_tokens', 0)} cached) + {tokens} output in {seconds:.2f}s{speed}]")


def ask(client: httpx.Client, model: str, messages: list[dict], max_tokens: int, system: str | None,
        out: IO[str]) -> str:
    """Stream one answer to `out`, then its cost line; returns the answer's text."""
    body = {"model": model, "max_tokens": max_tokens, "messages": messages, "stream": True}
    if system:
        body["system"] = system
    text, cost, usage, stop = "", {}, {}, None
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/messages", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        for event, data in _events(r):
            if event == "content_block_delta" and data["delta"].get("type") == "text_delta":
                text += data["delta"]["text"]
                out.write(data["delta"]["text"])
                out.flush()
            elif event == "message_delta":
                usage, stop = data.get("usage", {}), data.get("delta", {}).get("stop_reason")
            elif event == "stratum_cost":
                cost = data
            elif event == "error":
                raise RuntimeError(data.get("error", {}).get("message", "the stream failed"))
    if stop == "refusal":  # a content policy ended the answer (the rule's id, never what matched)
        rule = (cost.get("policy") or {}).get("blocked")
        out.write("\n[refused by the server's content policy" + (f": rule {rule}]" if rule else "]"))
    out.write("\n" + cost_line(cost, usage, time.perf_counter() - t0) + "\n")
    out.flush()
    return text


def repl(url: str, model: str, api_key: str | None, max_tokens: int, system: str | None,
         stdin: IO[str] = sys.stdin, out: IO[str] = sys.stdout) -> int:
    headers = {"anthropic-version": "2023-06-01", "x-stratum-meta": "on"}  # the cost event too
    if api_key:
        headers["x-api-key"] = api_key
    messages: list[dict] = []
    interactive = stdin.isatty()
    with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
        while True:
            if interactive:
                out.write(">>> ")
                out.flush()
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                return 0
            line = line.strip()
            if not line:
                continue
            if line == "/reset":
                messages = []
                out.write("[conversation cleared]\n")
                continue
            messages.append({"role": "user", "content": line})
            try:
                answer = ask(client, model, messages, max_tokens, system, out)
            except (RuntimeError, httpx.HTTPError) as e:
                messages.pop()
                out.write(f"[error: {e}]\n")
                continue
            messages.append({"role": "assistant", "content": answer or " "})


def local_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """Start `stratum serve` for the session on a free loopback port; returns it once it is ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "stratum.cli", "serve", "--model", model, "--port", str(port),
                             "--log-level", "warning", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start in time")
