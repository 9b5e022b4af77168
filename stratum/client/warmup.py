"""Cache warm-up: prefill and pin prompts with `max_tokens: 0`, Anthropic's own prefill-only semantics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """One prompt per line: plain text (a user message) or a JSON object with `messages` (and `system`).

    Raises:
        ValueError: a JSON line without a messages list.
    """
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            obj = json.loads(line)
            if not isinstance(obj.get("messages"), list):
                raise ValueError(f"{path}:{n}: a JSON line needs a messages list")
            prompts.append(obj)
        else:
            prompts.append({"messages": [{"role": "user", "content": line}]})
    return prompts


def warmup_http(url: str, model: str, prompts: list[dict[str, Any]], api_key: str | None = None,
                timeout: float = 300.0) -> dict[str, Any]:
    """Send each prompt with max_tokens 0. Reports the cache_creation_input_tokens the server measured."""
    headers = {"x-api-key": api_key} if api_key else {}
    created = cached = failed = 0
    results = []
    with httpx.Client(base_url=url, timeout=timeout, headers=headers) as client:
        for p in prompts:
            r = client.post("/v1/messages", json={"model": model, "max_tokens": 0, **p})
            if r.status_code != 200:
                failed += 1
                results.append({"status": r.status_code, "error": r.text[:200]})
                continue
            usage = r.json()["usage"]
            created += usage.get("cache_creation_input_tokens", 0)
            cached += usage.get("cache_read_input_tokens", 0)
            results.append({"status": 200, "usage": usage, "x-stratum-cost": r.headers.get("x-stratum-cost")})
    return {"prompts": len(prompts), "failed": failed, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": cached, "results": results}
